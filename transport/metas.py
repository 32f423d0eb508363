"""The metas that carry values, both directions: a PUT's (its values' lengths, keys and data frames), a GET's or an
EXISTS's (its keys), a GET reply's (its values' lengths and segments), and the data segments values travel in
(`transport.protocol` has the header, the limits and the rules every frame keeps). Pure functions, no I/O.

Contract:
* PUT meta: value_lens u64[count] | key_lens u32[count] | frame_lens u64[data frames] | frame_ends u8[data frames] |
  keys; the data frame count is `(meta_len - 12*count - sum(key_lens)) / 9`. GET/EXISTS meta: key_lens
  u32[count] | keys; an EXISTS with `flags` LEASE asks the node to lease the keys it finds and carries the lease's
  milliseconds (u32) before that, one with PIN asks it to pin them (`transport/exists_holds.py`). PING: nothing.
* GET reply meta: i64[count] (value length, -1 = miss) | segment_ends u8[segments of the present values], then one
  data frame per segment (unless the data came inline in the head).
* Values travel in **segments** (`segment_plan`): a value of at least SEGMENT_BYTES is a segment of its own (sent
  without copying); runs of smaller values are packed into segments of about SEGMENT_BYTES, so a batch of small
  values costs few messages. A PUT splits segments further into data frames (e.g. a value's header and payload parts),
  which must never cross a segment boundary.
* A client encodes requests (`encode_keys_meta`, `encode_put_meta`) and decodes replies (`decode_get_reply`); a
  node decodes requests (`decode_keys_meta`, `decode_put_meta`) and encodes replies (`encode_get_reply`). Every
  decode checks each length against the protocol's limits before anything is allocated, and raises
  `ProtocolError` for a meta that breaks a rule (the receiver closes that connection). Both sides compute the same
  segment plan (`segment_plan`, `segment_bounds`).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ems.transport import protocol


def segment_plan(value_lens: np.ndarray) -> np.ndarray:
    """int64 `[values]`: the segment index of each value (vectorised; both sides compute the same plan).

    A value of at least protocol.SEGMENT_BYTES is a segment of its own; each run of smaller values is cut into segments
    where its running byte count crosses a multiple of protocol.SEGMENT_BYTES.
    """
    lens = np.asarray(value_lens, dtype=np.int64)
    if lens.size == 0:
        return np.zeros(0, dtype=np.int64)
    big = lens >= protocol.SEGMENT_BYTES
    small_lens = np.where(big, 0, lens)
    cum_small = np.cumsum(small_lens) - small_lens  # small bytes before each value
    # small bytes before the current run of smalls: the running value at the last big value
    run_base = np.maximum.accumulate(np.where(big, cum_small, 0))
    bucket = (cum_small - run_base) // protocol.SEGMENT_BYTES
    starts = np.ones(lens.size, dtype=bool)
    starts[1:] = big[1:] | big[:-1] | (bucket[1:] != bucket[:-1])
    return np.cumsum(starts) - 1


def segment_bounds(value_lens: np.ndarray, plan: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(offsets of each value inside its segment, byte size of each segment), both int64."""
    lens = np.asarray(value_lens, dtype=np.int64)
    nseg = int(plan[-1]) + 1 if plan.size else 0
    sizes = np.bincount(plan, weights=lens, minlength=nseg).astype(np.int64) if plan.size else np.zeros(0, np.int64)
    seg_start = np.cumsum(sizes) - sizes
    offsets = (np.cumsum(lens) - lens) - seg_start[plan] if plan.size else np.zeros(0, np.int64)
    return offsets, sizes


def encode_keys_meta(keys: Sequence[bytes]) -> bytes:
    """GET/EXISTS request meta."""
    if len(keys) == 1 and len(keys[0]) <= protocol.MAX_KEY_BYTES:  # the common 1-key call, without numpy
        return len(keys[0]).to_bytes(4, "little") + bytes(keys[0])
    lens, blob = protocol.encode_keys(keys)
    return lens.tobytes() + blob


def decode_keys_meta(count: int, meta: memoryview | bytes) -> list[bytes]:
    if len(meta) < 4 * count:
        raise protocol.ProtocolError("meta frame shorter than its key lengths")
    if count == 1:  # the common 1-key call, without numpy; the same checks
        key_len = int.from_bytes(bytes(meta[:4]), "little")
        if key_len > protocol.MAX_KEY_BYTES:
            raise protocol.ProtocolError(f"a key of {key_len} bytes, limit {protocol.MAX_KEY_BYTES}")
        if key_len != len(meta) - 4:
            raise protocol.ProtocolError("key lengths do not match the key bytes")
        return [bytes(memoryview(meta)[4:])]
    key_lens = np.frombuffer(meta, dtype="<u4", count=count)
    return protocol.split_keys(key_lens, memoryview(meta)[4 * count :])


def encode_put_meta(keys: Sequence[bytes], value_lens: np.ndarray, frame_lens: np.ndarray, frame_ends: bytes) -> bytes:
    """PUT request meta; `frame_ends`: each data frame's last byte (`end_bytes`)."""
    lens, blob = protocol.encode_keys(keys)
    if len(frame_ends) != len(frame_lens):
        raise ValueError(f"{len(frame_ends)} end bytes for {len(frame_lens)} data frames")
    return (
        np.asarray(value_lens, dtype="<u8").tobytes()
        + lens.tobytes()
        + np.asarray(frame_lens, dtype="<u8").tobytes()
        + bytes(frame_ends)
        + blob
    )


@dataclass(frozen=True)
class PutRequest:
    keys: list[bytes]
    value_lens: np.ndarray  # int64 [count]
    frame_lens: np.ndarray  # int64 [data frames]
    frame_ends: bytes  # [data frames]: the last byte of each (module docstring, "end bytes")
    plan: np.ndarray  # segment of each value
    value_offsets: np.ndarray  # offset of each value in its segment
    segment_sizes: np.ndarray
    frame_segments: np.ndarray  # segment of each data frame
    frame_offsets: np.ndarray  # offset of each data frame in its segment


def decode_put_meta(count: int, data_len: int, meta: memoryview | bytes) -> PutRequest:
    """Parse and check a PUT meta frame: lengths within limits, data frames adding up and inside segments."""
    if count == 1:  # the common 1-value save, without numpy's per-call costs; the same checks, the same request
        return _decode_one_put(data_len, memoryview(meta))
    return _decode_put_meta(count, data_len, meta)


_ONE_PUT = struct.Struct("<QI")  # a 1-value PUT meta's value length and key length


def _decode_one_put(data_len: int, meta: memoryview) -> PutRequest:
    """`decode_put_meta` of one value (tests/transport/test_request_limits.py holds it to the general path)."""
    if len(meta) < _ONE_PUT.size:
        raise protocol.ProtocolError("PUT meta frame shorter than its lengths")
    value_len, key_len = _ONE_PUT.unpack_from(meta)
    rest = len(meta) - _ONE_PUT.size - key_len
    if rest < 0 or rest % protocol.PUT_META_PER_FRAME:
        raise protocol.ProtocolError("PUT meta frame does not add up")
    nframes = rest // protocol.PUT_META_PER_FRAME
    if nframes > protocol.MAX_DATA_FRAMES:
        raise protocol.ProtocolError(f"{nframes} data frames in one PUT, limit {protocol.MAX_DATA_FRAMES}")
    if key_len > protocol.MAX_KEY_BYTES:
        raise protocol.ProtocolError(f"a key of {key_len} bytes, limit {protocol.MAX_KEY_BYTES}")
    frame_lens = struct.unpack_from(f"<{nframes}Q", meta, _ONE_PUT.size)
    if value_len > protocol.MAX_VALUE_BYTES:
        raise protocol.ProtocolError(f"a value of {value_len} bytes, limit {protocol.MAX_VALUE_BYTES}")
    if value_len != data_len or sum(frame_lens) != data_len:
        raise protocol.ProtocolError("value and data frame lengths do not match data_len")
    if nframes and min(frame_lens) <= 0:
        raise protocol.ProtocolError("an empty data frame")
    if nframes == 0:  # the value's one segment must end at a data frame's end
        raise protocol.ProtocolError("a data frame crosses a segment boundary")
    ends_at = _ONE_PUT.size + 8 * nframes
    key = bytes(meta[ends_at + nframes :])
    return PutRequest(
        [key],
        np.array([value_len], dtype=np.int64),
        np.array(frame_lens, dtype=np.int64),
        bytes(meta[ends_at : ends_at + nframes]),
        np.zeros(1, dtype=np.int64),
        np.zeros(1, dtype=np.int64),
        np.array([value_len], dtype=np.int64),
        np.zeros(nframes, dtype=np.int64),
        np.array((0, *itertools.accumulate(frame_lens[:-1])), dtype=np.int64),  # (a ufunc costs more, this small)
    )


def _decode_put_meta(count: int, data_len: int, meta: memoryview | bytes) -> PutRequest:
    meta = memoryview(meta)
    if len(meta) < 12 * count:
        raise protocol.ProtocolError("PUT meta frame shorter than its lengths")
    value_lens = np.frombuffer(meta, dtype="<u8", count=count).astype(np.int64)
    key_lens = np.frombuffer(meta, dtype="<u4", count=count, offset=8 * count)
    key_bytes = int(key_lens.sum(dtype=np.int64))
    rest = len(meta) - 12 * count - key_bytes
    if rest < 0 or rest % protocol.PUT_META_PER_FRAME:
        raise protocol.ProtocolError("PUT meta frame does not add up")
    nframes = rest // protocol.PUT_META_PER_FRAME
    if nframes > protocol.MAX_DATA_FRAMES:
        raise protocol.ProtocolError(f"{nframes} data frames in one PUT, limit {protocol.MAX_DATA_FRAMES}")
    frame_lens = np.frombuffer(meta, dtype="<u8", count=nframes, offset=12 * count).astype(np.int64)
    ends_at = 12 * count + 8 * nframes
    frame_ends = bytes(meta[ends_at : ends_at + nframes])
    keys = protocol.split_keys(key_lens, meta[ends_at + nframes :])
    if value_lens.size and (int(value_lens.max()) > protocol.MAX_VALUE_BYTES or int(value_lens.min()) < 0):
        raise protocol.ProtocolError(f"a value of {int(value_lens.max())} bytes, limit {protocol.MAX_VALUE_BYTES}")
    # each frame bounded before any sum (u64 lengths of 2**63 and above read as negative here): frame lengths near
    # 2**64 could otherwise wrap around to data_len in the int64 sum and pass
    if frame_lens.size and int(frame_lens.min()) <= 0:
        raise protocol.ProtocolError("an empty data frame (or one of 2**63 bytes or more)")
    if frame_lens.size and int(frame_lens.max()) > protocol.MAX_DATA_BYTES:
        raise protocol.ProtocolError(f"a data frame of {int(frame_lens.max())} bytes, limit {protocol.MAX_DATA_BYTES}")
    if int(value_lens.sum()) != data_len or int(frame_lens.sum()) != data_len:
        raise protocol.ProtocolError("value and data frame lengths do not match data_len")
    plan = segment_plan(value_lens)
    value_offsets, segment_sizes = segment_bounds(value_lens, plan)
    seg_ends = np.cumsum(segment_sizes)
    frame_stops = np.cumsum(frame_lens)
    # every segment end must be a data frame end: no data frame crosses a segment boundary
    at = np.searchsorted(frame_stops, seg_ends)  # frame_stops is increasing (no empty data frame)
    if (at >= frame_stops.size).any() or (frame_stops[np.minimum(at, frame_stops.size - 1)] != seg_ends).any():
        raise protocol.ProtocolError("a data frame crosses a segment boundary")
    frame_starts = frame_stops - frame_lens
    frame_segments = np.searchsorted(seg_ends, frame_starts, side="right")
    seg_starts = seg_ends - segment_sizes
    frame_offsets = frame_starts - seg_starts[frame_segments] if frame_lens.size else frame_starts
    return PutRequest(keys, value_lens, frame_lens, frame_ends, plan, value_offsets, segment_sizes, frame_segments, frame_offsets)


class GetReply(NamedTuple):
    """A GET reply's meta, checked: each value's length (-1: a miss), and the segments of the present values."""

    lens: np.ndarray  # int64 [count]
    present: np.ndarray  # int64: the indices of the present values
    plan: np.ndarray  # int64 [present values]: the segment of each (`segment_plan`)
    segment_ends: bytes  # [segments]: the last byte of each (module docstring, "end bytes")


def encode_get_reply(lens: np.ndarray, segments: Sequence[protocol.Buffer_]) -> bytes:
    """GET reply meta: the value lengths (-1: a miss) and the end byte of each segment of the present values."""
    return np.asarray(lens, dtype="<i8").tobytes() + protocol.end_bytes(segments)


def decode_get_reply(count: int, data_len: int, meta: memoryview | bytes) -> GetReply:
    if len(meta) < 8 * count:
        raise protocol.ProtocolError(f"GET reply meta of {len(meta)} bytes for {count} keys")
    lens = np.frombuffer(meta, dtype="<i8", count=count).astype(np.int64)
    if lens.size and (int(lens.max()) > protocol.MAX_VALUE_BYTES or int(lens.min()) < -1):
        raise protocol.ProtocolError("GET reply value length out of range")
    if int(lens[lens > 0].sum()) != data_len:
        raise protocol.ProtocolError("GET reply lengths do not match data_len")
    present = np.nonzero(lens >= 0)[0]
    plan = segment_plan(lens[present])
    segments = int(plan[-1]) + 1 if plan.size else 0
    if len(meta) != 8 * count + segments:
        raise protocol.ProtocolError(f"GET reply meta of {len(meta)} bytes for {count} keys and {segments} segments")
    return GetReply(lens, present, plan, bytes(memoryview(meta)[8 * count :]))

"""The pool-node wire protocol, version 7 (`VERSION`): frames, limits and the data-segment plan (pure functions, no I/O).

Contract:
* Every exchange starts with one fixed 32-byte little-endian **header**:

      magic u32 'EMSP' | version u16 | op u16 | status u16 | flags u8 | meta_end u8 | count u32 | meta_len u32 |
      request_id u32 | data_len u64

  followed by the **meta** (`meta_len` bytes, absent when 0), then the **data** (`data_len` bytes in all). Frames
  are UCX tagged messages on one endpoint; on one tag their order is the send order.
* **Every frame's last byte is known to its receiver before the frame arrives** ("end bytes"), which is how a
  receiver knows a frame's length exactly although UCX does not report it (`ucx.frames`): the receiver sets that
  byte to another value before the receive and refuses the frame when it still holds it afterwards (a frame short
  by any number of bytes never writes its last byte); a frame longer than its buffer fails in UCX itself. Where
  each frame's end byte is stated: a header's last byte is data_len's top byte, always 0; an inline head's is its
  end byte, always 0 (`head_layout`: at least one zero pad byte); a meta frame's is the header's `meta_end` (the
  meta's last byte, 0 when there is no meta); a PUT's data frames' are in its meta (`frame_ends`), a GET reply's
  segments' in its meta (`segment_ends`).
* **Flags** are defined per op (`ALLOWED_FLAGS`): a header with a flag its op does not define is malformed.
* Two framings. **Classic** (flags without INLINE; the handshake is always classic): the header, the meta and each
  data frame are separate messages on the connection's base tag, and the reply comes back the same way; a node
  serves classic requests of one connection one after the other.
  **Inline** (flags INLINE, what `UcxNode` sends): one **head** message on the base tag carries the header, then the
  meta when `head_layout` says it fits, then all the data when that fits too, zero-padded to a multiple of 8 bytes
  (HEAD_BYTES at most). Every other frame of the request travels on the request's own tag, and so does the whole
  reply, which is inline the same way. Several inline requests may be in flight on one connection; the node serves
  them concurrently (within its in-flight budget) and each reply finds its caller by its tag, so replies may come
  back in any order.
* Tags: each side of a connection receives on a 64-bit base tag it chose (exchanged when UCX connects); a request's
  own tag is that base tag with its low 32 bits XORed with `request_id` (`ucx.progress.request_tag`), so every tag
  of one connection shares the base tag's high 32 bits. A node gives each live connection distinct high bits and
  discards every message it has not received on a connection's tags when that connection ends, as well as messages
  on tags of no connection at all, so unread messages never pile up past their connection. It does so while they
  arrive (`ucx.connections.ConnectionTable.sweep_front`), so the memory UCX takes for them (it goes back into UCX's
  buffer pools, which keep their largest size) stays bounded by what arrives between two sweeps (measured: 12,000
  frames of 4 KiB on request tags before and after the handshake and on tags of no connection, +7 to +12 MiB 10 s
  after five rounds, flat; +62 to +64 MiB when they were swept only by the watchdog). Before the handshake completes, only
  the base tag may carry messages: a message on another tag of the connection closes it; after it, a message on the
  tag of a request id not in flight, with no head waiting, closes it too (a client sends a request's head first).
* Request ids: an inline request's id is 1..MAX_REQUEST_ID (0 is the base tag) and unique among the connection's
  requests in flight. An id is in flight from its head until the node starts its reply; a client may reuse it as
  soon as it has received that reply in full (the node never refuses such a reuse). A head naming an id still in
  flight is malformed (the connection is closed).
* Versions: a node answers a HELLO of another version with a header of its own version, status BAD_REQUEST and a
  message, then closes; a client refuses a reply of another version. No frame of another version is ever read.
* Handshake (once per connection): client HELLO (meta: access_id, may be empty) → node CHALLENGE (meta: 32-byte
  nonce; flags: AUTH_REQUIRED) → client AUTH (meta: HMAC-SHA256(key, nonce ‖ access_id) or empty) → node AUTH reply
  (status OK, or AUTH_FAILED with a UTF-8 message in meta, then the node closes). The key never crosses the wire.
* PUT meta: value_lens u64[count] | key_lens u32[count] | frame_lens u64[data frames] | frame_ends u8[data frames] |
  keys; the data frame count is `(meta_len - 12*count - sum(key_lens)) / 9`. GET/EXISTS meta: key_lens
  u32[count] | keys; an EXISTS with `flags` LEASE asks the node to lease the keys it finds and carries the lease's
  milliseconds (u32) before that, one with PIN asks it to pin them (`transport/exists_holds.py`). PING: nothing.
  SHM_OPEN, SHM_PUT, SHM_GET: see `transport.shm` (values in a region of shared memory, never in data frames).
* Replies: PUT/EXISTS meta u8[count] (1 = stored / held, and kept as asked); GET meta i64[count] (value length,
  -1 = miss) | segment_ends u8[segments of the present values], then one data frame per segment (unless the data
  came inline in the head).
* Values travel in **segments** (`segment_plan`): a value of at least SEGMENT_BYTES is a segment of its own (sent
  without copying); runs of smaller values are packed into segments of about SEGMENT_BYTES, so a batch of small
  values costs few messages. A PUT splits segments further into data frames (e.g. a value's header and payload parts),
  which must never cross a segment boundary.
* Every length is checked against the limits below before anything is allocated; a frame that breaks a rule raises
  `ProtocolError`, and the receiver closes that connection (never the server). Every frame must arrive with exactly
  its announced length; receivers verify it by its end byte (above), since UCX does not report a short message.
* A node may refuse a request it will not receive (too large for its in-flight budget, or busy): it answers the
  request's reply op with status BAD_REQUEST and a UTF-8 message as meta, then closes the connection, whose
  remaining frames it never read.
"""

from __future__ import annotations

import enum
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import numpy as np

from ems.transport.auth import MAC_BYTES, NONCE_BYTES, auth_mac, check_mac  # noqa: F401 - part of the protocol

MAGIC = 0x50534D45  # b"EMSP" read as little-endian u32
# 7: every frame's last byte is stated before it arrives (flags u8 + meta_end u8 in the header, a zero end byte
# closing every inline head, frame_ends in a PUT's meta, segment_ends in a GET reply's meta), flags defined per op;
# 6: an EXISTS may ask for a lease or a pin on the keys it finds (transport/exists_holds.py); 5: a same-host GET may name a
# progress word (`transport.shm`); 4: request tags are the base tag XOR the request
# id (3 hashed them); 3: version 2 plus the shared-memory ops
VERSION = 7
HEADER_DTYPE = np.dtype(
    [
        ("magic", "<u4"),
        ("version", "<u2"),
        ("op", "<u2"),
        ("status", "<u2"),
        ("flags", "u1"),
        ("meta_end", "u1"),
        ("count", "<u4"),
        ("meta_len", "<u4"),
        ("request_id", "<u4"),
        ("data_len", "<u8"),
    ]
)
HEADER_SIZE = HEADER_DTYPE.itemsize  # 32
_HEADER = struct.Struct("<IHHHBBIIIQ")  # the same layout as HEADER_DTYPE (struct: a few times faster per header)
if _HEADER.size != HEADER_SIZE:
    raise ImportError("protocol header layouts disagree")
Buffer_ = Any  # anything exposing the buffer protocol (bytes, memoryview, a numpy array)

# Frame limits: a peer announcing more is malformed, and its connection is closed.
MAX_KEYS = 1 << 16  # keys per request
MAX_KEY_BYTES = 4096  # one key
MAX_META_BYTES = 64 << 20  # one meta frame
MAX_VALUE_BYTES = 1 << 30  # one value
MAX_DATA_BYTES = 4 << 30  # all data frames of one request or reply
MAX_DATA_FRAMES = 4 * MAX_KEYS  # data frames of one PUT
MAX_ID_BYTES = 512  # access_id

# What each key of a request costs of its meta frame (the layouts below): a PUT's value length u64 and key length
# u32 (and a u64 per data frame), a GET's or EXISTS's key length u32; plus the key's bytes.
PUT_META_PER_KEY = 12
PUT_META_PER_FRAME = 9  # its length u64 and its end byte u8
KEY_META_PER_KEY = 4

SEGMENT_BYTES = 1 << 20  # values this large travel alone; smaller ones are packed up to about this size
HEAD_BYTES = 8 << 10  # the largest head message of the inline framing (header + meta + small data + padding)
HEAD_END = 0  # the last byte of every inline head (its last pad byte)
MAX_REQUEST_ID = (1 << 32) - 1


class Op(enum.IntEnum):
    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    PUT = 4
    GET = 5
    EXISTS = 6
    PING = 7
    SHM_OPEN = 8  # same-host shared memory (`transport.shm`): open this connection's region
    SHM_PUT = 9  # a PUT whose values are in the region
    SHM_GET = 10  # a GET whose values are placed in the region


REPLY = 0x8000  # op | REPLY in a node's answer to a request


class Status(enum.IntEnum):
    OK = 0
    AUTH_FAILED = 1
    BAD_REQUEST = 2
    SERVER_ERROR = 3


class Flags(enum.IntFlag):
    NONE = 0
    AUTH_REQUIRED = 1  # CHALLENGE: the node only serves clients that prove a configured key
    INLINE = 2  # a request (and its reply) in the inline framing, on the request's own tag
    LEASE = 4  # EXISTS: lease the keys found (transport/exists_holds.py)
    PIN = 8  # EXISTS: pin the keys found


ALL_FLAGS = Flags.AUTH_REQUIRED | Flags.INLINE | Flags.LEASE | Flags.PIN
_INLINE = int(Flags.INLINE)  # plain ints on the per-request path (IntFlag arithmetic is slow)


def _allowed_flags() -> dict[int, int]:
    """op (a reply: op | REPLY) -> the flags it may carry; any other flag is malformed."""
    allowed = {int(op): 0 for op in Op} | {int(op) | REPLY: 0 for op in Op}
    for op in (Op.PUT, Op.GET, Op.PING, Op.SHM_OPEN, Op.SHM_PUT, Op.SHM_GET):  # the requests that travel inline
        allowed[int(op)] = allowed[int(op) | REPLY] = _INLINE
    allowed[int(Op.EXISTS)] = int(Flags.INLINE | Flags.LEASE | Flags.PIN)
    allowed[int(Op.EXISTS) | REPLY] = _INLINE
    allowed[int(Op.CHALLENGE)] = int(Flags.AUTH_REQUIRED)
    return allowed


ALLOWED_FLAGS: dict[int, int] = _allowed_flags()  # HELLO, AUTH and their replies: none


class ProtocolError(Exception):
    """A frame broke the protocol: the connection it came from must be closed."""


class VersionMismatch(ProtocolError):
    """A well-formed header of another protocol version (`version`): refused, never read further."""

    def __init__(self, version: int) -> None:
        super().__init__(f"the peer speaks protocol version {version}, this side speaks {VERSION}")
        self.version = version


def pack_header(
    op: int,
    *,
    count: int = 0,
    meta_len: int = 0,
    data_len: int = 0,
    status: Status = Status.OK,
    flags: int = 0,
    request_id: int = 0,
    meta_end: int = 0,
) -> np.ndarray:
    """A header frame as a 32-byte uint8 array (ready to send; writable). `meta_end`: the meta's last byte
    (`end_byte(meta)`), which the receiver of a meta frame checks its length by."""
    raw = bytearray(HEADER_SIZE)
    _HEADER.pack_into(raw, 0, MAGIC, VERSION, op, int(status), flags, meta_end, count, meta_len, request_id, data_len)
    return np.frombuffer(raw, dtype=np.uint8)


def end_byte(frame: Buffer_) -> int:
    """The last byte of a frame (0 for an empty one): what its sender states for it (module docstring)."""
    view = memoryview(frame)
    if view.nbytes == 0:
        return 0
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return int(view[-1])


def end_bytes(frames: Sequence[Buffer_]) -> bytes:
    """`end_byte` of each frame, as the u8 array a meta carries."""
    return bytes(end_byte(f) for f in frames)


def check_meta_end(header: Header, meta: Buffer_) -> None:
    """ProtocolError when `meta` (received whole: inline in a head, or over a stream) does not end with the byte its
    header states."""
    if end_byte(meta) != header.meta_end:
        raise ProtocolError("the meta does not end with the byte its header states")


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed header (slots: one is made per message, on the hot path)."""

    op: int
    status: int
    flags: int
    count: int
    meta_len: int
    data_len: int
    request_id: int = 0
    meta_end: int = 0

    @property
    def inline(self) -> bool:
        return bool(self.flags & _INLINE)


def unpack_header(frame: np.ndarray | bytes | memoryview) -> Header:
    """Parse and check a header frame against the limits; ProtocolError if it is not one."""
    view = memoryview(cast(Any, frame))
    if view.nbytes != HEADER_SIZE:
        raise ProtocolError(f"header frame of {view.nbytes} bytes, expected {HEADER_SIZE}")
    magic, version, op, status, flags, meta_end, count, meta_len, request_id, data_len = _HEADER.unpack_from(view.cast("B"))
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic:#x}")
    if version != VERSION:
        raise VersionMismatch(version)
    allowed = ALLOWED_FLAGS.get(op)
    if allowed is None:
        raise ProtocolError(f"unknown op {op}")
    if flags & ~allowed:
        raise ProtocolError(f"flags {flags:#x} on op {op:#x}, which defines {allowed:#x}")
    if count > MAX_KEYS:
        raise ProtocolError(f"{count} keys in one request, limit {MAX_KEYS}")
    if meta_len > MAX_META_BYTES:
        raise ProtocolError(f"meta frame of {meta_len} bytes, limit {MAX_META_BYTES}")
    if meta_len == 0 and meta_end:
        raise ProtocolError("an end byte for an empty meta")
    if data_len > MAX_DATA_BYTES:
        raise ProtocolError(f"{data_len} data bytes in one request, limit {MAX_DATA_BYTES}")
    return Header(op, status, flags, count, meta_len, data_len, request_id, meta_end)


# ---- request limits ----

Costs = tuple[np.ndarray, np.ndarray, np.ndarray]  # per key: data bytes, meta bytes, data frames (int64 each)


@dataclass(frozen=True)
class RequestLimits:
    """The most one request to one node may carry, and what each key costs of it: the one place request limits are
    decided. The pool client cuts a call's keys into requests with `batches`, the jobs cut a request into chunks
    with the same (`capped` to their chunk size), and the costs are the wire's meta layout (`put_costs`,
    `key_costs`), so no layer above the protocol knows it. `WIRE_LIMITS` is this protocol's; a backend with other
    limits (Mooncake) makes its own."""

    max_keys: int = MAX_KEYS
    max_data_bytes: int = MAX_DATA_BYTES
    max_meta_bytes: int = MAX_META_BYTES
    max_data_frames: int = MAX_DATA_FRAMES

    def capped(self, max_data_bytes: int) -> RequestLimits:
        """These limits with at most `max_data_bytes` of data per request."""
        return RequestLimits(self.max_keys, min(self.max_data_bytes, max_data_bytes), self.max_meta_bytes, self.max_data_frames)

    @staticmethod
    def put_costs(key_lens: np.ndarray, value_bytes: np.ndarray, frames: np.ndarray) -> Costs:
        """Per key of a PUT: its value's bytes, its meta bytes and its data frames (`frames`: the value's parts)."""
        frames = np.asarray(frames, dtype=np.int64)
        meta = np.asarray(key_lens, dtype=np.int64) + PUT_META_PER_KEY + PUT_META_PER_FRAME * frames
        return np.asarray(value_bytes, dtype=np.int64), meta, frames

    @staticmethod
    def key_costs(key_lens: np.ndarray, reply_bytes: np.ndarray | None = None) -> Costs:
        """Per key of a GET or EXISTS: the reply bytes it is expected to bring (`reply_bytes`, None: none known), its
        meta bytes, no data frames."""
        meta = np.asarray(key_lens, dtype=np.int64) + KEY_META_PER_KEY
        data = np.zeros(meta.size, dtype=np.int64) if reply_bytes is None else np.asarray(reply_bytes, dtype=np.int64)
        return data, meta, np.zeros(meta.size, dtype=np.int64)

    def batches(self, costs: Costs) -> list[slice]:
        """Consecutive slices of the keys (per key: data bytes, meta bytes, data frames) such that each slice keeps
        every limit; a key that alone exceeds one still travels, alone (the node then refuses it)."""
        data, meta, frames = costs
        n = len(data)
        if (  # the common call: one request
            0 < n <= self.max_keys
            and int(data.sum()) <= self.max_data_bytes
            and int(meta.sum()) <= self.max_meta_bytes
            and int(frames.sum()) <= self.max_data_frames
        ):
            return [slice(0, n)]
        cums = [np.concatenate(([0], np.cumsum(c, dtype=np.int64))) for c in (data, meta, frames)]
        caps = (self.max_data_bytes, self.max_meta_bytes, self.max_data_frames)
        batches: list[slice] = []
        start = 0
        while start < n:
            end = min(n, start + self.max_keys)
            for cum, cap in zip(cums, caps):
                # the largest end with cum[end] - cum[start] <= cap
                end = min(end, int(np.searchsorted(cum, cum[start] + cap, side="right")) - 1)
            end = max(end, start + 1)
            batches.append(slice(start, end))
            start = end
        return batches


WIRE_LIMITS = RequestLimits()


def key_lens(keys: Sequence[bytes]) -> np.ndarray:
    """int64 byte length of each key."""
    return np.fromiter((len(k) for k in keys), dtype=np.int64, count=len(keys))


# ---- the inline framing ----


class HeadLayout(NamedTuple):
    """Where the parts of an inline request or reply travel: in the head message or as frames of their own."""

    meta_inline: bool
    data_inline: bool
    length: int  # bytes of the head message (a multiple of 8)


def head_layout(meta_len: int, data_len: int) -> HeadLayout:
    """The head of an inline message (both sides compute the same): the meta goes inline when it fits in
    HEAD_BYTES, the data too when meta and data together fit; the head is then zero-padded to a multiple of 8 bytes
    with at least one pad byte, so its last byte is always HEAD_END (the receiver's length check,
    `ucx.frames.parse_head`)."""
    room = HEAD_BYTES - HEADER_SIZE - 1
    meta_inline = meta_len <= room
    data_inline = meta_inline and meta_len + data_len <= room
    body = (meta_len if meta_inline else 0) + (data_len if data_inline else 0)
    return HeadLayout(meta_inline, data_inline, HEADER_SIZE + ((body + 8) & ~7))


def pack_head(header: np.ndarray, meta: bytes | memoryview, data: Sequence[Buffer_] = ()) -> np.ndarray:
    """An inline head: `header` (from `pack_header`, with flags INLINE), then `meta` and `data` where
    `head_layout` puts them inline (the caller sends the rest as frames of their own), zero-padded."""
    raw = memoryview(cast(Any, header)).cast("B")
    fields = _HEADER.unpack_from(raw)
    layout = head_layout(fields[7], fields[9])
    head = bytearray(layout.length)
    head[:HEADER_SIZE] = raw
    at = HEADER_SIZE
    if layout.meta_inline and len(meta):
        head[at : at + len(meta)] = meta
        at += len(meta)
    if layout.data_inline:
        for part in data:
            view = memoryview(part).cast("B")
            head[at : at + view.nbytes] = view
            at += view.nbytes
    return np.frombuffer(head, dtype=np.uint8)


def pack_meta_reply(op: int, request_id: int, meta: bytes = b"", count: int = 0) -> bytearray:
    """An inline reply (status OK) that carries only `meta`, in its head: the same bytes as `pack_head` of its
    header, without building the header twice (the reply of an EXISTS or PING). ValueError when `meta` does not fit."""
    layout = head_layout(len(meta), 0)
    if not layout.meta_inline:
        raise ValueError(f"a reply meta of {len(meta)} bytes does not fit in a head")
    head = bytearray(layout.length)
    _HEADER.pack_into(head, 0, MAGIC, VERSION, op | REPLY, 0, _INLINE, end_byte(meta), count, len(meta), request_id, 0)
    head[HEADER_SIZE : HEADER_SIZE + len(meta)] = meta
    return head


# ---- authentication (transport/auth.py) ----


def check_access_id(raw: bytes) -> str:
    if len(raw) > MAX_ID_BYTES:
        raise ProtocolError(f"access_id of {len(raw)} bytes, limit {MAX_ID_BYTES}")
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("access_id is not ASCII") from None


# ---- segments ----


def segment_plan(value_lens: np.ndarray) -> np.ndarray:
    """int64 `[values]`: the segment index of each value (vectorised; both sides compute the same plan).

    A value of at least SEGMENT_BYTES is a segment of its own; each run of smaller values is cut into segments
    where its running byte count crosses a multiple of SEGMENT_BYTES.
    """
    lens = np.asarray(value_lens, dtype=np.int64)
    if lens.size == 0:
        return np.zeros(0, dtype=np.int64)
    big = lens >= SEGMENT_BYTES
    small_lens = np.where(big, 0, lens)
    cum_small = np.cumsum(small_lens) - small_lens  # small bytes before each value
    # small bytes before the current run of smalls: the running value at the last big value
    run_base = np.maximum.accumulate(np.where(big, cum_small, 0))
    bucket = (cum_small - run_base) // SEGMENT_BYTES
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


# ---- meta frames ----


def encode_keys(keys: Sequence[bytes]) -> tuple[np.ndarray, bytes]:
    """(key_lens u32, concatenated keys), checking the limits."""
    if len(keys) > MAX_KEYS:
        raise ValueError(f"{len(keys)} keys in one request, limit {MAX_KEYS}")
    lens = np.fromiter((len(k) for k in keys), dtype=np.uint32, count=len(keys))
    if lens.size and int(lens.max()) > MAX_KEY_BYTES:
        raise ValueError(f"a key of {int(lens.max())} bytes, limit {MAX_KEY_BYTES}")
    return lens, b"".join(keys)


def split_keys(key_lens: np.ndarray, blob: memoryview | bytes) -> list[bytes]:
    """The keys of a meta frame, checking the limits; ProtocolError when they do not add up."""
    if key_lens.size and int(key_lens.max()) > MAX_KEY_BYTES:
        raise ProtocolError(f"a key of {int(key_lens.max())} bytes, limit {MAX_KEY_BYTES}")
    ends = np.cumsum(key_lens, dtype=np.int64)
    if (int(ends[-1]) if ends.size else 0) != len(blob):
        raise ProtocolError("key lengths do not match the key bytes")
    blob = bytes(blob)
    starts = (ends - key_lens).tolist()
    return [blob[a:b] for a, b in zip(starts, ends.tolist())]


def encode_keys_meta(keys: Sequence[bytes]) -> bytes:
    """GET/EXISTS request meta."""
    if len(keys) == 1 and len(keys[0]) <= MAX_KEY_BYTES:  # the common 1-key call, without numpy
        return len(keys[0]).to_bytes(4, "little") + bytes(keys[0])
    lens, blob = encode_keys(keys)
    return lens.tobytes() + blob


def decode_keys_meta(count: int, meta: memoryview | bytes) -> list[bytes]:
    if len(meta) < 4 * count:
        raise ProtocolError("meta frame shorter than its key lengths")
    if count == 1:  # the common 1-key call, without numpy; the same checks
        key_len = int.from_bytes(bytes(meta[:4]), "little")
        if key_len > MAX_KEY_BYTES:
            raise ProtocolError(f"a key of {key_len} bytes, limit {MAX_KEY_BYTES}")
        if key_len != len(meta) - 4:
            raise ProtocolError("key lengths do not match the key bytes")
        return [bytes(memoryview(meta)[4:])]
    key_lens = np.frombuffer(meta, dtype="<u4", count=count)
    return split_keys(key_lens, memoryview(meta)[4 * count :])


def encode_put_meta(keys: Sequence[bytes], value_lens: np.ndarray, frame_lens: np.ndarray, frame_ends: bytes) -> bytes:
    """PUT request meta; `frame_ends`: each data frame's last byte (`end_bytes`)."""
    lens, blob = encode_keys(keys)
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
        raise ProtocolError("PUT meta frame shorter than its lengths")
    value_len, key_len = _ONE_PUT.unpack_from(meta)
    rest = len(meta) - _ONE_PUT.size - key_len
    if rest < 0 or rest % PUT_META_PER_FRAME:
        raise ProtocolError("PUT meta frame does not add up")
    nframes = rest // PUT_META_PER_FRAME
    if nframes > MAX_DATA_FRAMES:
        raise ProtocolError(f"{nframes} data frames in one PUT, limit {MAX_DATA_FRAMES}")
    if key_len > MAX_KEY_BYTES:
        raise ProtocolError(f"a key of {key_len} bytes, limit {MAX_KEY_BYTES}")
    frame_lens = struct.unpack_from(f"<{nframes}Q", meta, _ONE_PUT.size)
    if value_len > MAX_VALUE_BYTES:
        raise ProtocolError(f"a value of {value_len} bytes, limit {MAX_VALUE_BYTES}")
    if value_len != data_len or sum(frame_lens) != data_len:
        raise ProtocolError("value and data frame lengths do not match data_len")
    if nframes and min(frame_lens) <= 0:
        raise ProtocolError("an empty data frame")
    if nframes == 0:  # the value's one segment must end at a data frame's end
        raise ProtocolError("a data frame crosses a segment boundary")
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
        raise ProtocolError("PUT meta frame shorter than its lengths")
    value_lens = np.frombuffer(meta, dtype="<u8", count=count).astype(np.int64)
    key_lens = np.frombuffer(meta, dtype="<u4", count=count, offset=8 * count)
    key_bytes = int(key_lens.sum(dtype=np.int64))
    rest = len(meta) - 12 * count - key_bytes
    if rest < 0 or rest % PUT_META_PER_FRAME:
        raise ProtocolError("PUT meta frame does not add up")
    nframes = rest // PUT_META_PER_FRAME
    if nframes > MAX_DATA_FRAMES:
        raise ProtocolError(f"{nframes} data frames in one PUT, limit {MAX_DATA_FRAMES}")
    frame_lens = np.frombuffer(meta, dtype="<u8", count=nframes, offset=12 * count).astype(np.int64)
    ends_at = 12 * count + 8 * nframes
    frame_ends = bytes(meta[ends_at : ends_at + nframes])
    keys = split_keys(key_lens, meta[ends_at + nframes :])
    if value_lens.size and (int(value_lens.max()) > MAX_VALUE_BYTES or int(value_lens.min()) < 0):
        raise ProtocolError(f"a value of {int(value_lens.max())} bytes, limit {MAX_VALUE_BYTES}")
    # each frame bounded before any sum (u64 lengths of 2**63 and above read as negative here): frame lengths near
    # 2**64 could otherwise wrap around to data_len in the int64 sum and pass
    if frame_lens.size and int(frame_lens.min()) <= 0:
        raise ProtocolError("an empty data frame (or one of 2**63 bytes or more)")
    if frame_lens.size and int(frame_lens.max()) > MAX_DATA_BYTES:
        raise ProtocolError(f"a data frame of {int(frame_lens.max())} bytes, limit {MAX_DATA_BYTES}")
    if int(value_lens.sum()) != data_len or int(frame_lens.sum()) != data_len:
        raise ProtocolError("value and data frame lengths do not match data_len")
    plan = segment_plan(value_lens)
    value_offsets, segment_sizes = segment_bounds(value_lens, plan)
    seg_ends = np.cumsum(segment_sizes)
    frame_stops = np.cumsum(frame_lens)
    # every segment end must be a data frame end: no data frame crosses a segment boundary
    at = np.searchsorted(frame_stops, seg_ends)  # frame_stops is increasing (no empty data frame)
    if (at >= frame_stops.size).any() or (frame_stops[np.minimum(at, frame_stops.size - 1)] != seg_ends).any():
        raise ProtocolError("a data frame crosses a segment boundary")
    frame_starts = frame_stops - frame_lens
    frame_segments = np.searchsorted(seg_ends, frame_starts, side="right")
    seg_starts = seg_ends - segment_sizes
    frame_offsets = frame_starts - seg_starts[frame_segments] if frame_lens.size else frame_starts
    return PutRequest(keys, value_lens, frame_lens, frame_ends, plan, value_offsets, segment_sizes, frame_segments, frame_offsets)


def decode_flags(count: int, meta: memoryview | bytes) -> list[bool]:
    if len(meta) != count:
        raise ProtocolError(f"reply of {len(meta)} flags for {count} keys")
    return [b != 0 for b in bytes(meta)]


def encode_flags(flags: Sequence[bool]) -> bytes:
    """PUT/EXISTS reply meta."""
    return bytes(1 if f else 0 for f in flags)


class GetReply(NamedTuple):
    """A GET reply's meta, checked: each value's length (-1: a miss), and the segments of the present values."""

    lens: np.ndarray  # int64 [count]
    present: np.ndarray  # int64: the indices of the present values
    plan: np.ndarray  # int64 [present values]: the segment of each (`segment_plan`)
    segment_ends: bytes  # [segments]: the last byte of each (module docstring, "end bytes")


def encode_get_reply(lens: np.ndarray, segments: Sequence[Buffer_]) -> bytes:
    """GET reply meta: the value lengths (-1: a miss) and the end byte of each segment of the present values."""
    return np.asarray(lens, dtype="<i8").tobytes() + end_bytes(segments)


def decode_get_reply(count: int, data_len: int, meta: memoryview | bytes) -> GetReply:
    if len(meta) < 8 * count:
        raise ProtocolError(f"GET reply meta of {len(meta)} bytes for {count} keys")
    lens = np.frombuffer(meta, dtype="<i8", count=count).astype(np.int64)
    if lens.size and (int(lens.max()) > MAX_VALUE_BYTES or int(lens.min()) < -1):
        raise ProtocolError("GET reply value length out of range")
    if int(lens[lens > 0].sum()) != data_len:
        raise ProtocolError("GET reply lengths do not match data_len")
    present = np.nonzero(lens >= 0)[0]
    plan = segment_plan(lens[present])
    segments = int(plan[-1]) + 1 if plan.size else 0
    if len(meta) != 8 * count + segments:
        raise ProtocolError(f"GET reply meta of {len(meta)} bytes for {count} keys and {segments} segments")
    return GetReply(lens, present, plan, bytes(memoryview(meta)[8 * count :]))

"""`RequestLimits`: the wire's per-key costs are exactly what the encoders write, and `batches` cut within limits."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ems.transport import metas, protocol
from ems.transport.protocol import WIRE_LIMITS, RequestLimits, key_lens
from ems.transport.ucx import frames as ucx_frames

keys_st = st.lists(st.binary(min_size=0, max_size=64), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(keys=keys_st, data=st.data())
def test_put_costs_are_the_encoded_put_meta(keys, data):
    parts = np.asarray(data.draw(st.lists(st.integers(1, 3), min_size=len(keys), max_size=len(keys))), dtype=np.int64)
    value_lens = np.asarray(data.draw(st.lists(st.integers(0, 5000), min_size=len(keys), max_size=len(keys))))
    frame_lens = np.ones(int(parts.sum()), dtype=np.int64)  # one u64 per data frame, whatever its length
    meta = metas.encode_put_meta(keys, value_lens, frame_lens, bytes(len(frame_lens)))
    data_cost, meta_cost, frames = RequestLimits.put_costs(key_lens(keys), value_lens, parts)
    assert int(meta_cost.sum()) == len(meta)
    assert (data_cost == value_lens).all() and (frames == parts).all()


@settings(max_examples=200, deadline=None)
@given(keys=keys_st)
def test_key_costs_are_the_encoded_keys_meta(keys):
    meta = metas.encode_keys_meta(keys)
    data, meta_cost, frames = RequestLimits.key_costs(key_lens(keys))
    assert int(meta_cost.sum()) == len(meta)
    assert not data.any() and not frames.any()
    reply = np.arange(len(keys), dtype=np.int64)
    assert (RequestLimits.key_costs(key_lens(keys), reply)[0] == reply).all()


@settings(max_examples=200, deadline=None)
@given(keys=keys_st, cap=st.integers(1, 100_000))
def test_capped_batches_of_a_put_keep_every_limit(keys, cap):
    """What the jobs do with a chunk size (`capped`), on the wire's own costs: every batch keeps the cap and the
    protocol's limits unless it is one key alone; the batches cover the keys in order."""
    lens = np.asarray([len(k) * 100 for k in keys], dtype=np.int64)
    costs = RequestLimits.put_costs(key_lens(keys), lens, np.full(len(keys), 2, dtype=np.int64))
    limits = WIRE_LIMITS.capped(cap)
    assert limits.max_data_bytes == min(cap, protocol.MAX_DATA_BYTES) and limits.max_keys == protocol.MAX_KEYS
    batches = limits.batches(costs)
    assert [i for b in batches for i in range(b.start, b.stop)] == list(range(len(keys)))
    for b in batches:
        assert b.stop - b.start == 1 or int(lens[b].sum()) <= cap


def test_no_keys_no_batches():
    empty = np.zeros(0, dtype=np.int64)
    assert WIRE_LIMITS.batches((empty, empty, empty)) == []


def test_meta_reply_is_the_packed_head():
    """The at-once reply head (`pack_meta_reply`) has the very bytes of `pack_head` of the same reply."""
    meta = bytes([1, 0, 1])
    header = protocol.pack_header(
        protocol.Op.EXISTS | protocol.REPLY, count=3, meta_len=3, flags=protocol.Flags.INLINE, request_id=77, meta_end=1
    )
    assert bytes(ucx_frames.pack_meta_reply(protocol.Op.EXISTS, 77, meta, 3)) == ucx_frames.pack_head(header, meta).tobytes()
    assert (
        bytes(ucx_frames.pack_meta_reply(protocol.Op.PING, 5))
        == ucx_frames.pack_head(
            protocol.pack_header(protocol.Op.PING | protocol.REPLY, flags=protocol.Flags.INLINE, request_id=5), b""
        ).tobytes()
    )


def _outcome(decode, count, data_len, meta):
    try:
        request = decode(count, data_len, meta)
    except protocol.ProtocolError:
        return "refused"
    return (
        request.keys,
        request.frame_ends,
        *(getattr(request, f).tolist() for f in ("value_lens", "frame_lens", "plan", "value_offsets")),
        *(getattr(request, f).tolist() for f in ("segment_sizes", "frame_segments", "frame_offsets")),
    )


@settings(max_examples=400, deadline=None)
@given(
    key=st.binary(max_size=40),
    value_len=st.one_of(
        st.none(), st.integers(0, 1 << 21), st.sampled_from([protocol.MAX_VALUE_BYTES + 1, (1 << 64) - 1, 1 << 63])
    ),
    frames=st.lists(st.one_of(st.integers(0, 1 << 20), st.just((1 << 64) - 1)), max_size=4),
    data_len=st.one_of(st.none(), st.integers(0, 1 << 21)),
    cut=st.integers(-3, 3),
)
def test_one_value_put_meta_is_decoded_as_the_general_path_does(key, value_len, frames, data_len, cut):
    """The 1-value fast path accepts exactly what the general path accepts, with the same request (well-formed,
    lying about lengths, empty frames, truncated or padded meta)."""
    value_len = sum(frames) if value_len is None else value_len
    if value_len >= 1 << 64:
        value_len = (1 << 64) - 1
    meta = (
        np.array([value_len], dtype="<u8").tobytes()
        + np.array([len(key)], dtype="<u4").tobytes()
        + np.array(frames, dtype="<u8").tobytes()
        + bytes(i * 37 % 256 for i in range(len(frames)))  # the frames' end bytes
        + key
    )
    meta = meta[: len(meta) + cut] if cut < 0 else meta + bytes(cut)
    data_len = sum(frames) if data_len is None else data_len
    assert _outcome(metas.decode_put_meta, 1, data_len, meta) == _outcome(metas._decode_put_meta, 1, data_len, meta)


def test_one_value_put_meta_well_formed():
    meta = metas.encode_put_meta([b"key"], np.array([100]), np.array([40, 60]), bytes(2))
    request = metas.decode_put_meta(1, 100, meta)
    assert _outcome(metas.decode_put_meta, 1, 100, meta) == _outcome(metas._decode_put_meta, 1, 100, meta)
    assert request.keys == [b"key"] and request.frame_offsets.tolist() == [0, 40] and request.segment_sizes.tolist() == [100]

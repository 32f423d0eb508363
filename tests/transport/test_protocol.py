"""Wire protocol v2 (pure functions): header round trip and limits, segment plans, meta frames, the HMAC proof."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ems.transport import protocol as P


def test_header_round_trip():
    frame = P.pack_header(P.Op.PUT, count=3, meta_len=100, data_len=1 << 31, status=P.Status.OK, flags=1)
    assert frame.nbytes == P.HEADER_SIZE == 32
    h = P.unpack_header(frame)
    assert (h.op, h.count, h.meta_len, h.data_len, h.flags) == (P.Op.PUT, 3, 100, 1 << 31, 1)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda f: f.__setitem__(slice(0, 4), 0), "magic"),
        (lambda f: f.__setitem__(4, 9), "version"),
        (lambda f: f.__setitem__(slice(6, 8), 0x7F), "op"),
    ],
)
def test_header_rejects_garbage(mutate, message):
    frame = P.pack_header(P.Op.GET, count=1, meta_len=5).copy()
    mutate(frame)
    with pytest.raises(P.ProtocolError, match=message):
        P.unpack_header(frame)


def test_header_limits():
    with pytest.raises(P.ProtocolError, match="keys"):
        P.unpack_header(P.pack_header(P.Op.GET, count=P.MAX_KEYS + 1))
    with pytest.raises(P.ProtocolError, match="meta"):
        P.unpack_header(P.pack_header(P.Op.GET, meta_len=P.MAX_META_BYTES + 1))
    with pytest.raises(P.ProtocolError, match="data"):
        P.unpack_header(P.pack_header(P.Op.PUT, data_len=P.MAX_DATA_BYTES + 1))
    with pytest.raises(P.ProtocolError, match="bytes"):
        P.unpack_header(np.zeros(31, np.uint8))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3 * P.SEGMENT_BYTES), max_size=40))
def test_segment_plan_properties(lens):
    lens = np.array(lens, dtype=np.int64)
    plan = P.segment_plan(lens)
    offsets, sizes = P.segment_bounds(lens, plan)
    assert plan.size == lens.size
    if lens.size == 0:
        return
    assert plan[0] == 0 and np.all(np.diff(plan) >= 0) and np.all(np.diff(plan) <= 1)  # contiguous, in order
    assert sizes.sum() == lens.sum()
    big = lens >= P.SEGMENT_BYTES
    counts = np.bincount(plan)
    assert np.all(counts[plan[big]] == 1)  # a big value travels alone
    # offsets tile each segment exactly
    assert np.all(offsets + lens <= sizes[plan])
    # packed segments of small values only exceed SEGMENT_BYTES by their last value
    for seg in np.nonzero(counts > 1)[0]:
        members = lens[plan == seg]
        assert members[:-1].sum() < P.SEGMENT_BYTES


def test_put_meta_round_trip_and_chunk_checks():
    keys = [b"a", b"bb", b"ccc"]
    lens = np.array([100, P.SEGMENT_BYTES + 8, 50])
    # value 1 (big) is sent in two parts; values 0 and 2 each sit in their own packed segment
    chunks = np.array([100, 40, P.SEGMENT_BYTES - 32, 50])
    meta = P.encode_put_meta(keys, lens, chunks)
    req = P.decode_put_meta(3, int(lens.sum()), meta)
    assert req.keys == keys
    assert req.value_lens.tolist() == lens.tolist()
    assert req.chunk_segments.tolist() == [0, 1, 1, 2]
    assert req.chunk_offsets.tolist() == [0, 0, 40, 0]
    # a chunk crossing a segment boundary is malformed
    bad = P.encode_put_meta(keys, lens, np.array([140, P.SEGMENT_BYTES - 32, 50]))
    with pytest.raises(P.ProtocolError, match="crosses"):
        P.decode_put_meta(3, int(lens.sum()), bad)
    with pytest.raises(P.ProtocolError, match="data_len"):
        P.decode_put_meta(3, int(lens.sum()) + 1, meta)
    with pytest.raises(P.ProtocolError):
        P.decode_put_meta(3, int(lens.sum()), meta[:-1])


def test_keys_meta_round_trip_and_limits():
    keys = [b"", b"x" * 100, bytes(range(256))]
    assert P.decode_keys_meta(3, P.encode_keys_meta(keys)) == keys
    with pytest.raises(P.ProtocolError):
        P.decode_keys_meta(4, P.encode_keys_meta(keys))
    with pytest.raises(ValueError):
        P.encode_keys_meta([b"k" * (P.MAX_KEY_BYTES + 1)])


def test_auth_mac_binds_key_nonce_and_tenant():
    key, nonce = "K" * 40, b"n" * 32
    mac = P.auth_mac(key, nonce, "tenant-a")
    assert len(mac) == P.MAC_BYTES and key.encode() not in mac
    assert P.check_mac(key, nonce, "tenant-a", mac)
    assert not P.check_mac("L" * 40, nonce, "tenant-a", mac)
    assert not P.check_mac(key, b"m" * 32, "tenant-a", mac)
    assert not P.check_mac(key, nonce, "tenant-b", mac)


def test_version_mismatch_and_unknown_flags_are_refused():
    header = P.pack_header(P.Op.PING)
    header.view(P.HEADER_DTYPE)["version"] = 1
    with pytest.raises(P.VersionMismatch) as info:
        P.unpack_header(header)
    assert info.value.version == 1
    with pytest.raises(P.ProtocolError, match="flags"):
        P.unpack_header(P.pack_header(P.Op.PING, flags=0x80))
    assert P.unpack_header(P.pack_header(P.Op.GET, request_id=P.MAX_REQUEST_ID)).request_id == P.MAX_REQUEST_ID


@given(st.integers(0, 3 * P.HEAD_BYTES), st.integers(0, 3 * P.HEAD_BYTES))
def test_head_layout_properties(meta_len, data_len):
    layout = P.head_layout(meta_len, data_len)
    assert layout.length % 8 == 0 and P.HEADER_SIZE <= layout.length <= P.HEAD_BYTES
    assert layout.data_inline <= layout.meta_inline
    body = meta_len * layout.meta_inline + data_len * layout.data_inline
    assert body <= layout.length - P.HEADER_SIZE < body + 8
    assert layout.meta_inline == (meta_len <= P.HEAD_BYTES - P.HEADER_SIZE)


def test_pack_head_puts_meta_and_data_inline():
    meta, data = b"m" * 13, [b"ab", np.frombuffer(b"cde", np.uint8)]
    header = P.pack_header(P.Op.PUT, count=1, meta_len=len(meta), data_len=5, flags=P.Flags.INLINE, request_id=3)
    head = P.pack_head(header, meta, data)
    assert len(head) == P.HEADER_SIZE + 24
    assert bytes(head[P.HEADER_SIZE : P.HEADER_SIZE + 18]) == meta + b"abcde" and not head[P.HEADER_SIZE + 18 :].any()
    parsed = P.unpack_header(head[: P.HEADER_SIZE])
    assert parsed.inline and parsed.request_id == 3

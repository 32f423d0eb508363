"""Wire protocol (pure functions): header round trip and limits, segment plans, meta frames, the HMAC proof."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ems.transport import metas, protocol
from ems.transport.ucx import frames as ucx_frames


def test_header_round_trip():
    frame = protocol.pack_header(
        protocol.Op.PUT, count=3, meta_len=100, data_len=1 << 31, status=protocol.Status.OK, flags=2, meta_end=0xAB
    )
    assert frame.nbytes == protocol.HEADER_SIZE == 32
    assert frame[-1] == 0  # data_len's top byte: the receiver's exact length check of a header frame
    h = protocol.unpack_header(frame)
    assert (h.op, h.count, h.meta_len, h.data_len, h.flags, h.meta_end) == (protocol.Op.PUT, 3, 100, 1 << 31, 2, 0xAB)


_EVERY_OP = sorted({int(op) for op in protocol.Op} | {int(op) | protocol.REPLY for op in protocol.Op})


@pytest.mark.parametrize("op", _EVERY_OP)
def test_flags_are_defined_per_op(op):
    """Every op (requests and replies) against every flag bit: a flag the op does not define is malformed."""
    defined = {
        int(protocol.Op.CHALLENGE): protocol.Flags.AUTH_REQUIRED,
        int(protocol.Op.EXISTS): protocol.Flags.INLINE | protocol.Flags.LEASE | protocol.Flags.PIN,
        int(protocol.Op.HELLO): 0,
        int(protocol.Op.AUTH): 0,
        int(protocol.Op.AUTH) | protocol.REPLY: 0,
        int(protocol.Op.HELLO) | protocol.REPLY: 0,
        int(protocol.Op.CHALLENGE) | protocol.REPLY: 0,
    }.get(op, protocol.Flags.INLINE)
    assert protocol.ALLOWED_FLAGS[op] == int(defined)
    for bit in range(8):
        frame = protocol.pack_header(op, flags=1 << bit)
        if (1 << bit) & int(defined):
            assert protocol.unpack_header(frame).flags == 1 << bit
        else:
            with pytest.raises(protocol.ProtocolError, match="flags"):
                protocol.unpack_header(frame)


def test_an_end_byte_for_no_meta_is_malformed():
    with pytest.raises(protocol.ProtocolError, match="empty meta"):
        protocol.unpack_header(protocol.pack_header(protocol.Op.GET, meta_end=7))


@pytest.mark.parametrize("meta_len, data_len", [(0, 0), (1, 0), (7, 0), (8, 0), (100, 900), (8159, 0), (8160, 0), (9000, 5)])
def test_every_head_ends_with_its_end_byte(meta_len, data_len):
    """An inline head's last byte is HEAD_END whatever it carries, and it is never longer than HEAD_BYTES."""
    layout = ucx_frames.head_layout(meta_len, data_len)
    header = protocol.pack_header(protocol.Op.PUT, meta_len=meta_len, data_len=data_len, flags=protocol.Flags.INLINE)
    head = ucx_frames.pack_head(header, b"\xff" * meta_len, [b"\xee" * data_len])
    assert head.size == layout.length <= ucx_frames.HEAD_BYTES and head.size % 8 == 0
    assert head[-1] == ucx_frames.HEAD_END


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda f: f.__setitem__(slice(0, 4), 0), "magic"),
        (lambda f: f.__setitem__(4, 9), "version"),
        (lambda f: f.__setitem__(slice(6, 8), 0x7F), "op"),
    ],
)
def test_header_rejects_garbage(mutate, message):
    frame = protocol.pack_header(protocol.Op.GET, count=1, meta_len=5).copy()
    mutate(frame)
    with pytest.raises(protocol.ProtocolError, match=message):
        protocol.unpack_header(frame)


def test_header_limits():
    with pytest.raises(protocol.ProtocolError, match="keys"):
        protocol.unpack_header(protocol.pack_header(protocol.Op.GET, count=protocol.MAX_KEYS + 1))
    with pytest.raises(protocol.ProtocolError, match="meta"):
        protocol.unpack_header(protocol.pack_header(protocol.Op.GET, meta_len=protocol.MAX_META_BYTES + 1))
    with pytest.raises(protocol.ProtocolError, match="data"):
        protocol.unpack_header(protocol.pack_header(protocol.Op.PUT, data_len=protocol.MAX_DATA_BYTES + 1))
    with pytest.raises(protocol.ProtocolError, match="bytes"):
        protocol.unpack_header(np.zeros(31, np.uint8))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3 * protocol.SEGMENT_BYTES), max_size=40))
def test_segment_plan_properties(lens):
    lens = np.array(lens, dtype=np.int64)
    plan = metas.segment_plan(lens)
    offsets, sizes = metas.segment_bounds(lens, plan)
    assert plan.size == lens.size
    if lens.size == 0:
        return
    assert plan[0] == 0 and np.all(np.diff(plan) >= 0) and np.all(np.diff(plan) <= 1)  # contiguous, in order
    assert sizes.sum() == lens.sum()
    big = lens >= protocol.SEGMENT_BYTES
    counts = np.bincount(plan)
    assert np.all(counts[plan[big]] == 1)  # a big value travels alone
    # offsets tile each segment exactly
    assert np.all(offsets + lens <= sizes[plan])
    # packed segments of small values only exceed SEGMENT_BYTES by their last value
    for seg in np.nonzero(counts > 1)[0]:
        members = lens[plan == seg]
        assert members[:-1].sum() < protocol.SEGMENT_BYTES


def test_put_meta_round_trip_and_data_frame_checks():
    keys = [b"a", b"bb", b"ccc"]
    lens = np.array([100, protocol.SEGMENT_BYTES + 8, 50])
    # value 1 (big) is sent in two parts; values 0 and 2 each sit in their own packed segment
    frames = np.array([100, 40, protocol.SEGMENT_BYTES - 32, 50])
    meta = metas.encode_put_meta(keys, lens, frames, bytes(len(frames)))
    req = metas.decode_put_meta(3, int(lens.sum()), meta)
    assert req.keys == keys
    assert req.value_lens.tolist() == lens.tolist()
    assert req.frame_segments.tolist() == [0, 1, 1, 2]
    assert req.frame_offsets.tolist() == [0, 0, 40, 0]
    # a data frame crossing a segment boundary is malformed
    bad = metas.encode_put_meta(keys, lens, np.array([140, protocol.SEGMENT_BYTES - 32, 50]), bytes(3))
    with pytest.raises(protocol.ProtocolError, match="crosses"):
        metas.decode_put_meta(3, int(lens.sum()), bad)
    with pytest.raises(protocol.ProtocolError, match="data_len"):
        metas.decode_put_meta(3, int(lens.sum()) + 1, meta)
    with pytest.raises(protocol.ProtocolError):
        metas.decode_put_meta(3, int(lens.sum()), meta[:-1])


@pytest.mark.parametrize(
    "frames",
    [
        [1 << 62, 1 << 62, 1 << 62, (1 << 62) + 100],  # positive in int64, their int64 sum wraps around to 100
        [(1 << 64) - 1, 101],  # -1 and 101 once read as int64
        [1 << 63, (1 << 63) + 100],  # both negative in int64
    ],
)
def test_put_meta_frame_lengths_cannot_wrap_around_to_data_len(frames):
    """Data frame lengths are u64 on the wire: lengths whose sum wraps around to data_len in int64 arithmetic are
    malformed, never decoded into frames that address outside their segments."""
    meta = metas.encode_put_meta([b"a", b"b"], np.array([50, 50]), np.array(frames, dtype=np.uint64), bytes(len(frames)))
    assert sum(frames) % (1 << 64) == 100
    with pytest.raises(protocol.ProtocolError):
        metas.decode_put_meta(2, 100, meta)


def test_keys_meta_round_trip_and_limits():
    keys = [b"", b"x" * 100, bytes(range(256))]
    assert metas.decode_keys_meta(3, metas.encode_keys_meta(keys)) == keys
    with pytest.raises(protocol.ProtocolError):
        metas.decode_keys_meta(4, metas.encode_keys_meta(keys))
    with pytest.raises(ValueError):
        metas.encode_keys_meta([b"k" * (protocol.MAX_KEY_BYTES + 1)])


def test_auth_mac_binds_key_nonce_and_tenant():
    key, nonce = "K" * 40, b"n" * 32
    mac = protocol.auth_mac(key, nonce, "tenant-a")
    assert len(mac) == protocol.MAC_BYTES and key.encode() not in mac
    assert protocol.check_mac(key, nonce, "tenant-a", mac)
    assert not protocol.check_mac("L" * 40, nonce, "tenant-a", mac)
    assert not protocol.check_mac(key, b"m" * 32, "tenant-a", mac)
    assert not protocol.check_mac(key, nonce, "tenant-b", mac)


def test_version_mismatch_and_unknown_flags_are_refused():
    header = protocol.pack_header(protocol.Op.PING)
    header.view(protocol.HEADER_DTYPE)["version"] = 1
    with pytest.raises(protocol.VersionMismatch) as info:
        protocol.unpack_header(header)
    assert info.value.version == 1
    with pytest.raises(protocol.ProtocolError, match="flags"):
        protocol.unpack_header(protocol.pack_header(protocol.Op.PING, flags=0x80))
    assert (
        protocol.unpack_header(protocol.pack_header(protocol.Op.GET, request_id=protocol.MAX_REQUEST_ID)).request_id
        == protocol.MAX_REQUEST_ID
    )


@given(st.integers(0, 3 * ucx_frames.HEAD_BYTES), st.integers(0, 3 * ucx_frames.HEAD_BYTES))
def test_head_layout_properties(meta_len, data_len):
    layout = ucx_frames.head_layout(meta_len, data_len)
    assert layout.length % 8 == 0 and protocol.HEADER_SIZE <= layout.length <= ucx_frames.HEAD_BYTES
    assert layout.data_inline <= layout.meta_inline
    body = meta_len * layout.meta_inline + data_len * layout.data_inline
    assert body < layout.length - protocol.HEADER_SIZE <= body + 8  # at least one pad byte: the head's end byte
    assert layout.meta_inline == (meta_len <= ucx_frames.HEAD_BYTES - protocol.HEADER_SIZE - 1)


def test_pack_head_puts_meta_and_data_inline():
    meta, data = b"m" * 13, [b"ab", np.frombuffer(b"cde", np.uint8)]
    header = protocol.pack_header(
        protocol.Op.PUT,
        count=1,
        meta_len=len(meta),
        meta_end=protocol.end_byte(meta),
        data_len=5,
        flags=protocol.Flags.INLINE,
        request_id=3,
    )
    head = ucx_frames.pack_head(header, meta, data)
    assert len(head) == protocol.HEADER_SIZE + 24
    assert (
        bytes(head[protocol.HEADER_SIZE : protocol.HEADER_SIZE + 18]) == meta + b"abcde"
        and not head[protocol.HEADER_SIZE + 18 :].any()
    )
    parsed = protocol.unpack_header(head[: protocol.HEADER_SIZE])
    assert parsed.inline and parsed.request_id == 3

"""Requests the node answers from a connection's own loop (an inline EXISTS or PING whose meta is in its head), seen
from a raw client: the same replies as any request, ids reusable right after their reply, several in flight, and a
malformed one closing its connection only."""

from __future__ import annotations

import numpy as np
from pool_testlib import make_values
from raw_ucx import CLOSED, RawSession

from ems.transport import metas, protocol
from ems.transport.ucx import frames as ucx_frames


def _inline_head(op: int, request_id: int, meta: bytes = b"", count: int = 0) -> np.ndarray:
    header = protocol.pack_header(
        op, count=count, meta_len=len(meta), meta_end=protocol.end_byte(meta), flags=protocol.Flags.INLINE, request_id=request_id
    )
    return ucx_frames.pack_head(header, meta)


def _reply(raw: RawSession, request_id: int, meta_len: int) -> protocol.Header | str:
    got = raw.recv_tagged(ucx_frames.head_layout(meta_len, 0).length, request_id)
    if isinstance(got, str):
        return got
    header = protocol.unpack_header(got[: protocol.HEADER_SIZE])
    assert header.inline and header.request_id == request_id and header.status == protocol.Status.OK
    assert header.meta_len == meta_len and header.data_len == 0
    return header


def _exists(raw: RawSession, request_id: int, keys: list[bytes]) -> list[bool] | str:
    raw.post_sends(_inline_head(protocol.Op.EXISTS, request_id, metas.encode_keys_meta(keys), len(keys)))
    got = raw.recv_tagged(ucx_frames.head_layout(len(keys), 0).length, request_id)
    if isinstance(got, str):
        return got
    header = protocol.unpack_header(got[: protocol.HEADER_SIZE])
    assert header.op == protocol.Op.EXISTS | protocol.REPLY and header.request_id == request_id
    assert header.count == len(keys) and header.inline
    return protocol.decode_flags(len(keys), got[protocol.HEADER_SIZE : protocol.HEADER_SIZE + len(keys)].tobytes())


def test_exists_and_ping_answered_with_ids_reused_at_once(shared_node, node_clients):
    client = node_clients(shared_node.address)
    assert client.put([b"at-once-held"], make_values(1, 4096, seed=4), 5.0) == [True]
    keys = [b"at-once-held", b"at-once-missing"]
    with RawSession(shared_node.port) as raw:
        raw.login()
        for _ in range(40):  # one id, reused as soon as its reply is in: never "already in flight"
            assert _exists(raw, 7, keys) == [True, False]
        raw.post_sends(_inline_head(protocol.Op.PING, 7))
        ping = _reply(raw, 7, 0)
        assert isinstance(ping, protocol.Header) and ping.op == protocol.Op.PING | protocol.REPLY
        # several in flight at once, answered each on its own tag
        ids = list(range(100, 116))
        raw.post_sends(*[_inline_head(protocol.Op.EXISTS, i, metas.encode_keys_meta(keys), 2) for i in ids])
        for i in ids:
            got = raw.recv_tagged(ucx_frames.head_layout(2, 0).length, i)
            assert not isinstance(got, str), (i, got)
            assert got[protocol.HEADER_SIZE : protocol.HEADER_SIZE + 2].tolist() == [1, 0]
        assert _exists(raw, 7, keys) == [True, False]


def test_a_malformed_request_answered_at_once_closes_its_connection_only(shared_node, node_clients):
    with RawSession(shared_node.port) as raw, RawSession(shared_node.port) as bystander:
        raw.login()
        bystander.login()
        assert _exists(bystander, 1, [b"k"]) == [False]
        raw.post_sends(_inline_head(protocol.Op.PING, 3, b"junk"))  # a PING carries nothing
        assert raw.recv_tagged(protocol.HEADER_SIZE + 8, 3, timeout_s=10) == CLOSED
        assert _exists(bystander, 1, [b"k"]) == [False]  # the same id again, on the connection that behaved
        assert _exists(raw, 4, [b"k"]) == CLOSED
    assert node_clients(shared_node.address).ping(2.0)

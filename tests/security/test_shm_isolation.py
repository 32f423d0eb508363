"""Attacks on same-host shared memory from raw clients: mapping another connection's region (wrong, replayed or
leaked tokens, other credentials, a connection that has ended), resizing a region under the node, ranges outside
the region, and reading another tenant's values through it. No client may ever map memory that holds another
connection's values."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from pool_testlib import KEY_A, KEY_B, PoolProcess, joined, make_values

from ems.transport import protocol
from ems.transport.base import TransportError
from ems.transport.shm import wire
from ems.transport.shm.client import ShmMode, encode_ranged

pytestmark = pytest.mark.slow


def _offer(node, uid: int | None = None, pid: int | None = None) -> wire.OpenReply:
    """SHM_OPEN on `node`'s connection stating `uid` / `pid` (default: this process's)."""
    from ems.transport.ucx.client_requests import request

    meta = wire.encode_open(os.getuid() if uid is None else uid, os.getpid() if pid is None else pid)

    def run(ex, rid):
        reply, body = request(ex, rid, protocol.Op.SHM_OPEN, meta=meta)
        return wire.decode_open_reply(bytes(body[: reply.meta_len]))

    offer = node._call(run, 5.0)
    assert offer.region_bytes > 0
    return offer


def _present(name: bytes, token: bytes) -> tuple[bytes, list[int]]:
    """Present `token` on the node's socket: (the node's one-byte answer, the descriptors it sent); (b"", []) when
    the node closed the socket instead (a peer for whom no region waits is closed at accept)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5.0)
        sock.connect(name)
        try:
            sock.sendall(token)
            message, fds, _, _ = socket.recv_fds(sock, 1, 4)
        except (ConnectionResetError, BrokenPipeError):
            return b"", []
    return message, fds


def _refused(answer: tuple[bytes, list[int]]) -> bool:
    message, fds = answer
    for fd in fds:
        os.close(fd)
    return message != b"\1" and not fds


def _raw(node_clients, address: str, **kwargs):
    """A client that never opens a region by itself (the tests drive SHM_OPEN and the hand-over)."""
    return node_clients(address, shm=ShmMode.OFF, **kwargs)


def test_wrong_and_replayed_tokens_are_refused(shared_node, node_clients):
    client = _raw(node_clients, shared_node.address)
    offer = _offer(client)
    assert _refused(_present(offer.socket_name, os.urandom(wire.TOKEN_BYTES)))
    assert _refused(_present(offer.socket_name, offer.token[:-1] + bytes([offer.token[-1] ^ 1])))
    message, fds = _present(offer.socket_name, offer.token)  # the right one still works once
    assert message == b"\1" and len(fds) == 1
    os.close(fds[0])
    assert _refused(_present(offer.socket_name, offer.token))  # replayed


@pytest.mark.parametrize("who", ["other-uid", "other-pid"])
def test_a_token_is_useless_to_other_credentials(shared_node, node_clients, who):
    client = _raw(node_clients, shared_node.address)
    offer = _offer(client, uid=os.getuid() + 1) if who == "other-uid" else _offer(client, pid=os.getppid())
    assert _refused(_present(offer.socket_name, offer.token))
    assert _refused(_present(offer.socket_name, offer.token))  # and it is spent


def test_a_leaked_token_is_useless_to_another_process(shared_node, node_clients):
    client = _raw(node_clients, shared_node.address)
    offer = _offer(client)
    thief = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(5)\n"
        f"s.connect({offer.socket_name!r})\n"
        "try:\n"
        f"    s.sendall({offer.token!r})\n"
        "    m, fds, _, _ = socket.recv_fds(s, 1, 4)\n"
        "    print(m.hex() or 'closed', len(fds))\n"
        "except (ConnectionResetError, BrokenPipeError):\n"
        "    print('closed', 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", thief], capture_output=True, text=True, timeout=30)
    # no region waits for the thief's pid: the node closes its socket at accept, before it can present the token
    assert out.stdout.split() == ["closed", "0"], out
    message, fds = _present(offer.socket_name, offer.token)  # so the token is not even spent: the owner maps it
    assert message == b"\1" and len(fds) == 1
    os.close(fds[0])


def test_a_token_dies_with_its_connection(shared_node, node_clients):
    client = _raw(node_clients, shared_node.address)
    offer = _offer(client)
    client.close()
    time.sleep(3.0)  # the node notices the connection's end
    assert _refused(_present(offer.socket_name, offer.token))


def test_regions_are_per_connection_and_start_zeroed(shared_node, node_clients):
    alpha = node_clients(shared_node.address)
    values = [make_values(1, 300_000, seed=11)[0]]
    assert alpha.put([b"secret"], values, 5.0) == [True]
    a_region = alpha.shm._region
    assert a_region is not None and bytes(a_region.array[:100]) == joined(values[0])[:100]
    beta = node_clients(shared_node.address)
    assert beta.ping(5.0) and beta.put([b"other"], [make_values(1, 10, 1)[0]], 5.0) == [True]
    b_region = beta.shm._region
    assert b_region is not None and b_region.base != a_region.base
    # beta's region holds only what beta wrote: nothing of alpha's, zeros past its own bytes
    assert not b_region.array[wire.PAGE :].any()
    assert bytes(a_region.array[:100]) == joined(values[0])[:100]
    alpha.close()
    gamma = node_clients(shared_node.address)
    out = np.empty(len(joined(values[0])), np.uint8)
    assert gamma.get_into([b"nothing-here"], [out], 5.0) == [False]
    assert gamma.shm._region is not None and not gamma.shm._region.array.any()


def test_a_region_cannot_be_resized_by_its_client(shared_node, node_clients):
    client = _raw(node_clients, shared_node.address)
    offer = _offer(client)
    message, fds = _present(offer.socket_name, offer.token)
    assert message == b"\1" and len(fds) == 1
    try:
        for size in (0, offer.region_bytes // 2, offer.region_bytes * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(fds[0], size)
        assert os.fstat(fds[0]).st_size == offer.region_bytes
    finally:
        os.close(fds[0])
    assert client.ping(5.0)


@pytest.mark.parametrize("op", [protocol.Op.SHM_PUT, protocol.Op.SHM_GET])
@pytest.mark.parametrize("where", ["past-the-end", "no-region"])
def test_ranges_outside_the_region_close_the_connection(shared_node, node_clients, op, where):
    from ems.transport.ucx.client_requests import request

    client = _raw(node_clients, shared_node.address)
    size = 4096
    offset = 0
    if where == "past-the-end":
        offer = _offer(client)
        offset = offer.region_bytes - size + 1
    meta = encode_ranged([b"k"], [offset], [size])

    def run(ex, rid):
        request(ex, rid, op, count=1, meta=meta)

    with pytest.raises(TransportError):
        client._call(run, 5.0)
    other = node_clients(shared_node.address)
    assert other.put([b"still-serving"], [make_values(1, 10, 2)[0]], 5.0) == [True]


@pytest.mark.parametrize("progress", ["unaligned", "past-the-end", "inside-the-value", "on-a-put"])
def test_a_bad_progress_word_closes_the_connection(shared_node, node_clients, progress):
    """A GET's progress word must be a u32 of the region outside every value's range (the node writes it while it
    places the values); a PUT has none. Anything else is malformed: the connection closes, the node serves on."""
    from ems.transport.ucx.client_requests import request

    client = _raw(node_clients, shared_node.address)
    offer = _offer(client)
    op = protocol.Op.SHM_PUT if progress == "on-a-put" else protocol.Op.SHM_GET
    word = {"unaligned": 8194, "past-the-end": offer.region_bytes - 2, "inside-the-value": 4096 + 100, "on-a-put": 0}
    meta = encode_ranged([b"k"], [4096], [4096], word[progress])

    def run(ex, rid):
        request(ex, rid, op, count=1, meta=meta)

    with pytest.raises(TransportError):
        client._call(run, 5.0)
    other = node_clients(shared_node.address)
    assert other.put([b"still-serving"], [make_values(1, 10, 2)[0]], 5.0) == [True]


def test_another_tenant_reads_nothing_through_shared_memory(node_clients):
    node = PoolProcess("64MiB", {"alpha": KEY_A, "beta": KEY_B})
    try:
        alpha = node_clients(node.address, access_id="alpha", access_key=KEY_A)
        beta = node_clients(node.address, access_id="beta", access_key=KEY_B)
        values = [make_values(1, 200_000, seed=3)[0]]
        assert alpha.put([b"k"], values, 5.0) == [True]
        out = np.zeros(len(joined(values[0])), np.uint8)
        assert beta.get_into([b"k"], [out], 5.0) == [False] and not out.any()
        assert beta.exists([b"k"], 5.0) == [False]
        assert alpha.shm._region is not None and beta.shm._region is not None
        assert not beta.shm._region.array.any()
    finally:
        node.cleanup()


def test_reopening_replaces_the_region_and_voids_the_old_token(shared_node, node_clients):
    """A connection asking again and again holds one region at a time: each new one voids the previous token, so
    a client cannot pile up regions (or memory) on one connection."""
    client = _raw(node_clients, shared_node.address)
    offers = [_offer(client) for _ in range(20)]
    assert len({o.token for o in offers}) == 20
    for old in offers[:-1]:
        assert _refused(_present(old.socket_name, old.token))
    message, fds = _present(offers[-1].socket_name, offers[-1].token)
    assert message == b"\1" and len(fds) == 1
    os.close(fds[0])
    other = node_clients(shared_node.address)  # the node's total is not used up by the replaced regions
    assert other.put([b"after-reopen"], [make_values(1, 10, 5)[0]], 5.0) == [True]
    assert other.shm._region is not None

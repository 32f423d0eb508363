"""Attacks on a node's lookup listener (`transport.tcp`) from raw TCP clients, against a real node with access keys:
junk, wrong, replayed and stolen tokens, silent peers past the pending limits, requests other than lookups, and a
flood of lookups whose replies are never read. The node refuses each without a byte, and goes on serving its
tenants' lookups over their channels throughout. Tokens come from a real authenticated UCX connection."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from cluster_testlib import free_port
from pool_testlib import PoolProcess, make_values, scrape_metrics, wait_until

from ems.records import Deadline
from ems.transport import metas, protocol
from ems.transport.shm.client import ShmMode
from ems.transport.tcp import wire
from ems.transport.ucx.client import UcxNode

KEY_A = "A" * 43 + "="
KEY_B = "B" * 43 + "="


@pytest.fixture
def node():
    metrics = f"127.0.0.1:{free_port()}"
    node = PoolProcess("64MiB", {"alpha": KEY_A, "beta": KEY_B}, args=("--metrics", metrics))
    node.metrics = metrics
    yield node
    node.cleanup()


@pytest.fixture
def clients(node):
    made: list[UcxNode] = []

    def make(access_id: str = "alpha", key: str = KEY_A) -> UcxNode:
        client = UcxNode(node.address, access_id=access_id, access_key=key, shm=ShmMode.OFF)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def _token(client: UcxNode) -> tuple[bytes, int]:
    """A fresh token and port, asked for on the client's authenticated connection (as its opening does)."""
    client.connect_now(5.0)
    sent = client.lookups.link.request(protocol.Op.LOOKUP_OPEN, 0, b"", Deadline.within(5.0))
    assert sent is not None
    token, port = wire.decode_open_reply(sent[1])
    assert port != 0
    return token, port


def _present(port: int, token: bytes, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5.0, source_address=(source, 0))
    sock.sendall(token)
    return sock


def _refused(sock: socket.socket) -> bool:
    """Whether the node closed the socket without a byte (within a few seconds)."""
    sock.settimeout(5.0)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    finally:
        sock.close()


def _exists(sock: socket.socket, keys: list[bytes], request_id: int = 1) -> list[bool]:
    meta = metas.encode_keys_meta(keys)
    header = protocol.pack_header(
        protocol.Op.EXISTS, count=len(keys), meta_len=len(meta), request_id=request_id, meta_end=protocol.end_byte(meta)
    )
    sock.sendall(header.tobytes() + meta)
    head = _read(sock, protocol.HEADER_SIZE)
    reply = protocol.unpack_header(head)
    assert reply.op == protocol.Op.EXISTS | protocol.REPLY and reply.request_id == request_id
    return protocol.decode_flags(len(keys), _read(sock, reply.meta_len))


def _read(sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        if not chunk:
            raise ConnectionError("closed")
        got += chunk
    return got


def _serves(client: UcxNode, keys: list[bytes], expected: list[bool]) -> bool:
    """Whether the client's lookups are answered right over its channel (opened again first, should a raw client's
    token have ended it: a connection's channel is its latest)."""
    client.connect_now(5.0)
    if client.exists(keys, 5.0) != expected:  # (it may find its channel ended and ask over UCX)
        return False
    client.connect_now(5.0)
    channel = client.lookups.channel
    return channel is not None and client.exists(keys, 5.0) == expected and client.lookups.channel is channel


def test_a_right_token_opens_a_channel_of_its_tenant_only(node, clients):
    alpha, beta = clients(), clients("beta", KEY_B)
    assert all(alpha.put([b"mine"], make_values(1, 4096), 10.0))
    token, port = _token(beta)
    sock = _present(port, token)
    assert _read(sock, 1) == wire.ACCEPTED
    assert _exists(sock, [b"mine", b"other"]) == [False, False]  # beta's namespace: alpha's key is not there
    sock.close()
    token, port = _token(alpha)
    sock = _present(port, token)
    assert _read(sock, 1) == wire.ACCEPTED
    assert _exists(sock, [b"mine", b"other"], request_id=7) == [True, False]
    sock.close()


def test_junk_unknown_replayed_and_stolen_tokens_are_refused(node, clients):
    alpha = clients()
    assert all(alpha.put([b"k"], make_values(1, 4096), 10.0))
    token, port = _token(alpha)
    junk = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    junk.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 64)
    assert _refused(junk)
    assert _refused(_present(port, bytes(wire.TOKEN_BYTES)))  # no token
    assert _refused(_present(port, token[:-1] + bytes([token[-1] ^ 1])))  # a wrong one, one bit off
    assert _refused(_present(port, token[: wire.TOKEN_BYTES // 2]))  # half of the right one, then silence
    accepted = _present(port, token)  # neither a wrong token nor half a right one spends it
    assert _read(accepted, 1) == wire.ACCEPTED
    accepted.close()
    assert _refused(_present(port, token))  # its presentation did
    stolen, port = _token(alpha)
    assert _refused(_present(port, stolen, source="127.0.0.2"))  # another address than the connection's peer
    assert _refused(_present(port, stolen))  # spent by that attempt
    replayed, port = _token(alpha)
    first = _present(port, replayed)
    assert _read(first, 1) == wire.ACCEPTED
    assert _refused(_present(port, replayed))  # a token opens one channel, once
    first.close()
    assert _serves(alpha, [b"k", b"z"], [True, False])
    metrics = scrape_metrics(node.metrics)
    refused = {
        r: metrics.get(("ems_pool_lookup_refusals_total", (("reason", r),)), 0)
        for r in ("unknown_token", "no_token", "other_peer")
    }
    assert refused == {"unknown_token": 6, "no_token": 1, "other_peer": 1}, refused
    assert metrics[("ems_pool_requests_total", (("op", "lookup_open"), ("status", "ok")))] >= 4
    assert metrics[("ems_pool_lookup_channels", ())] == 1  # alpha's own


def test_requests_other_than_lookups_end_the_channel(node, clients):
    alpha = clients()
    for op, flags, meta in (
        (protocol.Op.PUT, 0, b"\0" * 16),
        (protocol.Op.GET, 0, b"\0" * 8),
        (protocol.Op.SHM_GET, 0, b""),
        (protocol.Op.LOOKUP_OPEN, 0, b""),
        (protocol.Op.EXISTS, int(protocol.Flags.INLINE), b""),
    ):
        token, port = _token(alpha)
        sock = _present(port, token)
        assert _read(sock, 1) == wire.ACCEPTED
        header = protocol.pack_header(op, meta_len=len(meta), request_id=1, flags=flags, meta_end=protocol.end_byte(meta))
        sock.sendall(header.tobytes() + meta)
        assert _refused(sock), op
    token, port = _token(alpha)
    sock = _present(port, token)
    assert _read(sock, 1) == wire.ACCEPTED
    sock.sendall(b"\xff" * protocol.HEADER_SIZE)  # not a header at all
    assert _refused(sock)
    token, port = _token(alpha)
    sock = _present(port, token)
    assert _read(sock, 1) == wire.ACCEPTED
    too_long = protocol.pack_header(protocol.Op.EXISTS, count=1, meta_len=protocol.MAX_META_BYTES + 1, request_id=1)
    sock.sendall(too_long.tobytes())
    assert _refused(sock)
    assert _serves(alpha, [b"k"], [False])


def test_silent_peers_hold_no_more_than_their_places_nor_past_the_timeout(node, clients):
    alpha = clients()
    token, port = _token(alpha)
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5.0) for _ in range(wire.MAX_PENDING_PER_IP)]
    time.sleep(0.3)  # (accepted: each holds a pending place)
    extra = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    started = time.monotonic()
    assert _refused(extra)
    assert time.monotonic() - started < wire.HANDSHAKE_TIMEOUT_S / 2  # no place left for this address: closed at once
    other = _present(port, token, source="127.0.0.2")  # another address has places of its own (and is refused: it
    assert _refused(other)  # is not the connection's peer)
    started = time.monotonic()
    for sock in silent:
        assert _refused(sock)  # closed once the handshake's time is up
    assert time.monotonic() - started < wire.HANDSHAKE_TIMEOUT_S + 3
    assert _serves(alpha, [b"k"], [False])  # the places are free again


def test_a_flood_of_unread_lookups_stalls_only_its_own_channel(node, clients):
    alpha, beta = clients(), clients("beta", KEY_B)
    token, port = _token(alpha)
    flood = _present(port, token)
    assert _read(flood, 1) == wire.ACCEPTED
    meta = metas.encode_keys_meta([b"x"] * 1024)  # a reply a fifth of its request: the node's replies pile up fast
    request = (
        protocol.pack_header(
            protocol.Op.EXISTS, count=1024, meta_len=len(meta), request_id=1, meta_end=protocol.end_byte(meta)
        ).tobytes()
        + meta
    )
    stop = threading.Event()
    last_sent = [time.monotonic()]

    def send() -> None:
        flood.settimeout(0.2)
        while not stop.is_set():
            try:
                flood.sendall(request)  # the same id again and again, its replies never read
                last_sent[0] = time.monotonic()
            except (TimeoutError, OSError):
                continue

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        # the sender is held back for good: the node stops reading once its replies wait unread (its memory bounded)
        assert wait_until(lambda: time.monotonic() - last_sent[0] > 1.5, 60)
        assert all(beta.put([b"b"], make_values(1, 4096), 10.0))
        assert _serves(beta, [b"b", b"c"], [True, False])  # another tenant's lookups go on meanwhile
    finally:
        stop.set()
        sender.join(5)
        flood.close()
    assert _serves(alpha, [b"k"], [False])


def test_a_closed_connection_ends_its_channel(node, clients):
    alpha = clients()
    token, port = _token(alpha)
    sock = _present(port, token)
    assert _read(sock, 1) == wire.ACCEPTED
    alpha.close()
    assert _refused(sock)  # the node ended the channel with its connection

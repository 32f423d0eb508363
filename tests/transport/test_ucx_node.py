"""`UcxNode` against a real pool-node process: round trips, concurrency, and malformed frames from a raw UCX client
that must close only that connection."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from pool_testlib import joined, make_values
from ucx_loop import UcxRuntime

from ems.errors import EmsErrorCode
from ems.transport import protocol
from ems.transport.base import TransportError
from ems.transport.shm.client import ShmMode
from ems.transport.ucx.client import UcxNode
from ems.transport.ucx.remote import connect

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("size", [0, 1000, 70_000, protocol.SEGMENT_BYTES, 3 * protocol.SEGMENT_BYTES + 5])
def test_put_get_exists_round_trip(shared_node, node_clients, size):
    node = node_clients(shared_node.address)
    n = 5 if size < protocol.SEGMENT_BYTES else 3
    values = make_values(n, size, seed=size)
    keys = [f"k{size}-{i}".encode() for i in range(n)]
    assert node.put(keys, values, 5.0) == [True] * n
    got = node.get([b"missing"] + keys, 5.0)
    assert got[0] is None
    assert [bytes(g) for g in got[1:]] == [joined(v) for v in values]
    assert node.exists(keys + [b"nope"], 5.0) == [True] * n + [False]
    assert node.ping(1.0)


def test_mixed_sizes_in_one_batch(shared_node, node_clients):
    node = node_clients(shared_node.address)
    sizes = [10, 2 * protocol.SEGMENT_BYTES, 600_000, 600_000, 5, protocol.SEGMENT_BYTES - 40, 12]
    values = [make_values(1, s, seed=i)[0] for i, s in enumerate(sizes)]
    keys = [f"m{i}".encode() for i in range(len(sizes))]
    assert all(node.put(keys, values, 5.0))
    # ask in another order, with misses between, so the reply's segments differ from the request's
    order = [3, 0, 6, 1, 5, 2, 4]
    ask = [k for i in order for k in (keys[i], b"miss" + keys[i])]
    got = node.get(ask, 5.0)
    for j, i in enumerate(order):
        assert bytes(got[2 * j]) == joined(values[i]) and got[2 * j + 1] is None


def test_node_refuses_damaged_values(shared_node, node_clients):
    node = node_clients(shared_node.address)
    good, bad = make_values(2, 4096)
    torn = [bad[0], bad[1][:-1] + bytes([bad[1][-1] ^ 1])]
    assert node.put([b"good", b"torn", b"short"], [good, torn, [b"xx"]], 5.0) == [True, False, False]
    assert node.exists([b"good", b"torn", b"short"], 5.0) == [True, False, False]


def test_many_clients_at_once(shared_node):
    address = shared_node.address
    clients = [UcxNode(address, connect_timeout_ms=3000) for _ in range(6)]
    errors: list = []

    def work(c: UcxNode, tag: int) -> None:
        try:
            for r in range(4):
                values = make_values(4, 50_000 + tag, seed=tag * 10 + r)
                keys = [f"c{tag}-{r}-{i}".encode() for i in range(4)]
                assert all(c.put(keys, values, 10.0))
                assert [bytes(v) for v in c.get(keys, 10.0)] == [joined(v) for v in values]
        except BaseException as error:  # reported to the test thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(c, t)) for t, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in clients:
        c.close()
    assert not errors, errors


async def _raw_session(port: int, frames: list, expect_reply: bool) -> str:
    """Connect a raw UCX endpoint, send `frames`, and report whether the node answered or closed."""
    import ucxx

    ep = await ucxx.create_endpoint("127.0.0.1", port, endpoint_error_handling=True)
    try:
        for f in frames:
            await ep.send(f)
        reply = np.empty(protocol.HEADER_SIZE, np.uint8)
        try:
            await asyncio.wait_for(ep.recv(reply), 3.0)
        except Exception as error:
            return f"closed: {type(error).__name__}"
        return "answered"
    finally:
        ep.abort()


def _raw(port: int, frames: list) -> str:
    return asyncio.run_coroutine_threadsafe(_raw_session(port, frames, True), UcxRuntime.get().loop).result(15)


def _hello() -> list:
    return [protocol.pack_header(protocol.Op.HELLO)]


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([np.frombuffer(b"garbage-garbage-garbage-garbage!", np.uint8)], id="bad-magic"),
        pytest.param([np.zeros(7, np.uint8)], id="short-frame"),
        pytest.param([np.zeros(4096, np.uint8)], id="long-frame"),
        pytest.param([protocol.pack_header(protocol.Op.HELLO, meta_len=protocol.MAX_META_BYTES + 1)], id="oversized-meta"),
        pytest.param([protocol.pack_header(protocol.Op.PUT, count=1, meta_len=8)], id="put-before-handshake"),
    ],
)
def test_malformed_frames_close_only_that_connection(shared_node, node_clients, frames):
    pool = shared_node
    good = node_clients(pool.address)
    values = make_values(2, 10_000)
    assert all(good.put([b"mal-a", b"mal-b"], values, 5.0))
    outcome = _raw(pool.port, frames)
    assert outcome.startswith("closed"), outcome
    # the node still serves the existing client and new ones
    assert [bytes(v) for v in good.get([b"mal-a", b"mal-b"], 5.0)] == [joined(v) for v in values]
    assert node_clients(pool.address).ping(2.0)
    assert pool.proc.poll() is None


async def _authenticated_then(port: int, frames: list) -> str:
    import ucxx

    ep = await ucxx.create_endpoint("127.0.0.1", port, endpoint_error_handling=True)
    try:
        await ep.send(protocol.pack_header(protocol.Op.HELLO))
        h = np.empty(protocol.HEADER_SIZE, np.uint8)
        await ep.recv(h)
        await ep.recv(np.empty(protocol.NONCE_BYTES, np.uint8))
        await ep.send(protocol.pack_header(protocol.Op.AUTH))
        await ep.recv(h)
        for f in frames:
            await ep.send(f)
        try:
            await asyncio.wait_for(ep.recv(h), 3.0)
        except Exception as error:
            return f"closed: {type(error).__name__}"
        return "answered"
    finally:
        ep.abort()


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([protocol.pack_header(protocol.Op.PING)], id="ping-is-answered"),
        pytest.param(
            [protocol.pack_header(protocol.Op.GET, count=2, meta_len=8), np.array([5, 5], "<u4").view(np.uint8)],
            id="keys-do-not-add-up",
        ),
        pytest.param(
            [
                protocol.pack_header(protocol.Op.PUT, count=1, meta_len=20, data_len=10),
                np.concatenate(
                    [
                        np.array([10], "<u8").view(np.uint8),
                        np.array([0], "<u4").view(np.uint8),
                        np.array([11], "<u8").view(np.uint8),
                    ]
                ),
            ],
            id="data-frames-do-not-add-up",
        ),
        pytest.param([protocol.pack_header(protocol.Op.HELLO)], id="second-hello"),
    ],
)
def test_malformed_requests_after_handshake(shared_node, node_clients, frames):
    pool = shared_node
    outcome = asyncio.run_coroutine_threadsafe(_authenticated_then(pool.port, frames), UcxRuntime.get().loop).result(15)
    if frames[0][6] == protocol.Op.PING:
        assert outcome == "answered"
    else:
        assert outcome.startswith("closed"), outcome
    assert node_clients(pool.address).ping(2.0)


def test_unreachable_node_fails_fast_and_backs_off():
    t0 = time.monotonic()
    node = connect("127.0.0.1:1", connect_timeout_ms=1000)  # nothing listens on port 1
    assert time.monotonic() - t0 < 1.5
    try:
        assert not node.ping(0.5)
        with pytest.raises(TransportError) as info:
            node.get([b"k"], 1.0)
        assert info.value.status_code() in (EmsErrorCode.EMS_IO_ERROR, EmsErrorCode.EMS_IO_TIMEOUT)
    finally:
        node.close()


@pytest.mark.parametrize("cancel", ["abort", "deadline"])
def test_a_cancelled_call_starts_no_backoff(pool_nodes, node_clients, cancel):
    """A cancellation the client chose (`abort()`: another node answered first; a call's own deadline) fails the
    calls in flight on the connection, each at once and cleanly, and says nothing about the node: the very next call
    reconnects and reaches it. (Both used to start the reconnect back-off: for 0.5 s every call failed at once "with
    the last error", although the node was live.) A failure the wire reports still backs off
    (test_pool_node.py::test_backoff_does_not_hammer)."""
    proc = pool_nodes()
    node = node_clients(proc.address, shm=ShmMode.OFF)
    values = make_values(2, 1 << 20)
    assert node.put([b"a", b"b"], values, 5.0) == [True, True]
    proc.pause()  # its connection is up; its answers wait
    errors: list = []
    wrong: list = []

    def read(timeout_s: float) -> None:
        start = time.monotonic()
        try:
            got = node.get([b"a", b"b"], timeout_s)
            if [bytes(g) for g in got] != [joined(v) for v in values]:
                wrong.append(got)
        except TransportError as error:
            errors.append((error, time.monotonic() - start))

    # three calls in flight on the one connection; with "deadline" the first one's timeout drops it
    first_timeout = 0.3 if cancel == "deadline" else 20.0
    threads = [threading.Thread(target=read, args=(t,)) for t in (first_timeout, 20.0, 20.0)]
    try:
        for th in threads:
            th.start()
            time.sleep(0.05)
        time.sleep(0.4)
        if cancel == "abort":
            node.abort()
        for th in threads:
            th.join(5.0)
        assert not any(th.is_alive() for th in threads)  # none waited out its 20 s deadline
    finally:
        proc.resume()
    assert not wrong
    assert len(errors) == 3 and all(seconds < 5.0 for _, seconds in errors), errors
    start = time.monotonic()
    got = node.get([b"a", b"b"], 5.0)  # at once: a reconnect, not "next reconnect attempt in ..."
    assert [bytes(g) for g in got] == [joined(v) for v in values]
    assert node.exists([b"a", b"b"], 5.0) == [True, True]
    assert time.monotonic() - start < 3.0


def test_an_abort_while_connecting_cancels_the_call_and_keeps_the_connection(pool_nodes, node_clients):
    """`abort()` while a call is still connecting (its node stopped: the connect waits): the connect is not cut short
    (under continual hedging a connection must still get made), but the call, once connected, sends nothing and
    fails; the connection it made serves the next call."""
    proc = pool_nodes()
    node = node_clients(proc.address, shm=ShmMode.OFF, connect_timeout_ms=10_000)
    outcome: list = []

    def call() -> None:
        try:
            outcome.append(node.exists([b"k"], 10.0))
        except TransportError as error:
            outcome.append(error)

    proc.pause()
    thread = threading.Thread(target=call)
    try:
        thread.start()
        time.sleep(0.5)  # connecting
        node.abort()
    finally:
        proc.resume()
    thread.join(10.0)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], TransportError), outcome
    assert "while the call was connecting" in outcome[0].message()
    connection = node._link.current
    assert connection is not None  # made, and kept
    assert node.exists([b"k"], 5.0) == [False]
    assert node._link.current is connection

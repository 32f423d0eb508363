"""Protocol version 2 against a real node: several requests in flight on one connection, one-message small calls,
loads into caller buffers, and clean refusals between versions."""

from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
import pytest
from pool_testlib import client_of_scripted_node, joined, make_values
from ucx_loop import UcxRuntime

from ems.errors import EmsErrorCode
from ems.transport import metas, protocol
from ems.transport.base import TransportError
from ems.transport.ucx import frames as ucx_frames

pytestmark = pytest.mark.slow


def test_concurrent_calls_on_one_connection_random_sequence(shared_node, node_clients):
    """8 threads share one UcxNode (one connection) and run random put/get/get_into/exists of mixed sizes; every
    answer matches what that thread stored, so no reply ever reaches the wrong caller."""
    node = node_clients(shared_node.address)
    failures: list = []

    def worker(t: int) -> None:
        rng = random.Random(t)
        mine: dict[bytes, bytes] = {}
        try:
            for step in range(40):
                op = rng.choice(["put", "put", "get", "get_into", "exists"])
                if op == "put" or not mine:
                    size = rng.choice([8, 3000, 9000, 200_000, protocol.SEGMENT_BYTES + 100])
                    n = rng.randint(1, 3)
                    values = make_values(n, size, seed=t * 1000 + step)
                    keys = [f"t{t}-{step}-{i}".encode() for i in range(n)]
                    if node.put(keys, values, 10.0) != [True] * n:
                        failures.append((t, step, "put"))
                    mine.update((k, joined(v)) for k, v in zip(keys, values))
                    continue
                keys = rng.sample(sorted(mine), min(len(mine), rng.randint(1, 4))) + [f"t{t}-none".encode()]
                if op == "get":
                    got = node.get(keys, 10.0)
                    if [None if g is None else bytes(g) for g in got] != [mine.get(k) for k in keys]:
                        failures.append((t, step, "get"))
                elif op == "get_into":
                    outs = [np.full(len(mine.get(k, b"?")), 7, np.uint8) for k in keys]
                    placed = node.get_into(keys, outs, 10.0)
                    if placed != [k in mine for k in keys] or any(
                        p and bytes(o) != mine[k] for p, o, k in zip(placed, outs, keys)
                    ):
                        failures.append((t, step, "get_into"))
                elif node.exists(keys, 10.0) != [k in mine for k in keys]:
                    failures.append((t, step, "exists"))
        except Exception as error:  # reported below with the thread's state
            failures.append((t, repr(error)))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not failures, failures[:5]


def test_get_into_places_values_and_refuses_wrong_lengths(shared_node, node_clients):
    node = node_clients(shared_node.address)
    sizes = [protocol.SEGMENT_BYTES * 2, 5000, 40, protocol.SEGMENT_BYTES - 40]
    values = [make_values(1, s, seed=s)[0] for s in sizes]
    keys = [f"gi{i}".encode() for i in range(len(sizes))]
    assert all(node.put(keys, values, 5.0))
    flat = [joined(v) for v in values]
    outs = [np.zeros(len(f), np.uint8) for f in flat]
    outs[2] = np.zeros(len(flat[2]) + 1, np.uint8)  # wrong length: not placed
    ask = keys + [b"gi-missing"]
    outs.append(np.zeros(10, np.uint8))
    assert node.get_into(ask, outs, 5.0) == [True, True, False, True, False]
    for i in (0, 1, 3):
        assert bytes(outs[i]) == flat[i]
    with pytest.raises(ValueError):
        node.get_into(keys, [bytes(10)] * len(keys), 5.0)  # read-only buffers


def test_small_values_travel_inline(shared_node, node_clients):
    """Values small enough for the head message (request and reply) round-trip, next to ones that are not."""
    node = node_clients(shared_node.address)
    room = ucx_frames.HEAD_BYTES - protocol.HEADER_SIZE
    sizes = [1, 100, room - 200, room + 1]
    for s in sizes:
        values = make_values(1, s, seed=s)
        key = f"inl{s}".encode()
        assert node.put([key], values, 5.0) == [True]
        assert bytes(node.get([key], 5.0)[0]) == joined(values[0])


def _v1_hello(port: int) -> protocol.Header:
    """Send a version-1 HELLO; the node's answer header."""
    from ems.transport.ucx.endpoint import create_endpoint
    from ems.transport.ucx.frames import recv_header_frame, recv_meta

    async def session() -> tuple[protocol.Header, bytes]:
        ep = await create_endpoint("127.0.0.1", port, 5.0)
        try:
            hello = protocol.pack_header(protocol.Op.HELLO)
            hello.view(protocol.HEADER_DTYPE)["version"] = 1
            await ep.send(hello)
            frame = await recv_header_frame(ep)
            header = protocol.unpack_header(frame)
            return header, await recv_meta(ep, header)
        finally:
            ep.abort()

    header, message = asyncio.run_coroutine_threadsafe(session(), UcxRuntime.get().loop).result(15)
    assert b"version 1 " in message and f"speaks {protocol.VERSION}".encode() in message, message  # both versions
    return header


def test_node_refuses_another_protocol_version_at_the_handshake(shared_node, node_clients):
    header = _v1_hello(shared_node.port)
    assert header.status == protocol.Status.BAD_REQUEST and header.op == protocol.Op.HELLO | protocol.REPLY
    assert node_clients(shared_node.address).ping(2.0)


def test_client_refuses_a_node_of_another_version():
    """A node that answers the HELLO with a version-1 header: the client fails cleanly, never reads it."""

    async def old_node(ep) -> None:
        try:
            await ep.recv(np.empty(protocol.HEADER_SIZE, np.uint8))
            challenge = protocol.pack_header(protocol.Op.CHALLENGE, meta_len=protocol.NONCE_BYTES)
            challenge.view(protocol.HEADER_DTYPE)["version"] = 1
            await ep.send(challenge)
            await ep.send(np.zeros(protocol.NONCE_BYTES, np.uint8))
            await asyncio.sleep(1.0)
        except Exception:  # the client hung up
            pass

    with client_of_scripted_node(old_node) as node:
        with pytest.raises(TransportError) as info:
            node.ping(2.0) or node.exists([b"k"], 2.0)
        assert info.value.status_code() == EmsErrorCode.EMS_IO_ERROR
        message = info.value.message()
        assert "version 1," in message and f"speaks {protocol.VERSION}" in message, message  # both versions named


@pytest.mark.parametrize("cut", [8, 16, 100])
def test_short_inline_heads_are_refused(shared_node, node_clients, cut):
    """An inline EXISTS head cut short: the node closes that connection instead of reading the canary as keys."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "security"))
    from raw_ucx import CLOSED, RawSession

    meta = metas.encode_keys_meta([b"k" * 120])
    header = protocol.pack_header(
        protocol.Op.EXISTS,
        count=1,
        meta_len=len(meta),
        meta_end=protocol.end_byte(meta),
        flags=protocol.Flags.INLINE,
        request_id=9,
    )
    head = ucx_frames.pack_head(header, meta)
    with RawSession(shared_node.port) as raw:
        raw.login()
        raw.send(head[: len(head) - cut])
        assert raw.recv(ucx_frames.HEAD_BYTES, timeout_s=2.0) == CLOSED
    assert node_clients(shared_node.address).ping(2.0)

"""The lookup channel (`transport.tcp`) against real pool nodes, through `UcxNode` with shared memory off (a node
on another host is reached so): lookups take the channel once it is open, answer exactly as UCX does (holds
included), fall back to UCX whenever the channel cannot serve, and end with their connection."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time

import pytest
from pool_testlib import make_values, wait_until

from ems.errors import EmsErrorCode
from ems.records import Deadline
from ems.transport import protocol
from ems.transport.base import Failure, TransportError
from ems.transport.exists_holds import Hold
from ems.transport.shm.client import ShmMode
from ems.transport.tcp import client as tcp_client
from ems.transport.tcp import wire

VALUE = 4 << 10


def _client(node_clients, node, **kwargs):
    return node_clients(node.address, shm=ShmMode.OFF, **kwargs)


def _ready(pool_nodes, node_clients):
    """A node holding b"x" and a client connected to it, its lookup channel open (`connect_now` opens it)."""
    node = pool_nodes("64MiB")
    client = _client(node_clients, node)
    assert all(client.put([b"x"], make_values(1, VALUE), 10.0))
    client.connect_now(5.0)
    assert client.lookups.channel is not None
    return node, client


def _over_ucx(client, keys, hold=None):
    """The same lookup over the UCX connection (the channel set aside for it)."""
    lookups, client.lookups = client.lookups, None
    try:
        return client.exists(keys, 5.0, hold)
    finally:
        client.lookups = lookups


def test_lookups_take_the_channel_and_answer_as_ucx(pool_nodes, node_clients):
    node = pool_nodes("64MiB")
    client = _client(node_clients, node)
    stored = [f"k{i}".encode() for i in range(0, 40, 2)]
    assert all(client.put(stored, make_values(len(stored), VALUE), 10.0))
    client.connect_now(5.0)
    channel = client.lookups.channel
    assert channel is not None  # connect_now opened it
    keys = [f"k{i}".encode() for i in range(40)]
    expected = [i % 2 == 0 for i in range(40)]
    assert client.exists(keys, 5.0) == expected
    assert _over_ucx(client, keys) == expected
    assert client.lookups.channel is channel  # (still the same channel: the lookups above took it)
    assert client.exists([b"k0"] * 3 + [b"nope"], 5.0) == [True, True, True, False]
    big = [f"long-key-{i:06d}".encode() * 8 for i in range(5000)]  # a meta of ~600 KB: many receives on the node
    assert client.exists(big, 10.0) == [False] * 5000


def test_a_lease_asked_over_the_channel_holds(pool_nodes, node_clients):
    node = pool_nodes("4MiB")
    reader = _client(node_clients, node)
    writer = node_clients(node.address)
    leased = [f"leased-{i}".encode() for i in range(4)]
    assert all(writer.put(leased, make_values(4, 64 << 10), 10.0))
    reader.connect_now(5.0)
    assert reader.lookups.channel is not None
    assert reader.exists(leased, 5.0, Hold.lease(30_000)) == [True] * 4
    for start in range(0, 200, 8):  # three times the node's capacity of fresh values
        keys = [f"flood-{start + i}".encode() for i in range(8)]
        writer.put(keys, make_values(8, 64 << 10, seed=start), 10.0)
    assert reader.exists(leased, 5.0) == [True] * 4  # the lease kept them


def test_the_first_lookup_opens_the_channel_in_the_background(pool_nodes, node_clients):
    node = pool_nodes("64MiB")
    client = _client(node_clients, node)
    assert client.lookups.channel is None
    assert client.exists([b"a"], 5.0) == [False]  # connects and asks over UCX (no connection to open it on yet)
    assert client.lookups.channel is None
    assert client.exists([b"a"], 5.0) == [False]  # over UCX again; the opening starts
    assert wait_until(lambda: client.lookups.channel is not None, 10)


def test_a_node_without_the_channel_is_asked_over_ucx(pool_nodes, node_clients):
    node = pool_nodes("64MiB", args=("--lookup-port", "off"))
    client = _client(node_clients, node)
    assert all(client.put([b"x"], make_values(1, VALUE), 10.0))
    client.connect_now(5.0)
    assert client.lookups.channel is None
    assert client.exists([b"x", b"y"], 5.0) == [True, False]
    assert client.lookups._retry_at > time.monotonic() + tcp_client.RETRY_MAX_S / 2  # not asked again soon


def test_the_channel_ends_with_its_connection(pool_nodes, node_clients):
    _, client = _ready(pool_nodes, node_clients)
    first = client.lookups.channel
    assert first is not None
    client.abort()  # the connection dropped: the node ends its channel; the client's belongs to the old connection
    assert client.exists([b"x"], 5.0) == [True]  # reconnects over UCX
    assert client.lookups.channel is not first
    assert client.exists([b"x"], 5.0) == [True]  # over UCX; the new connection's channel opens
    assert wait_until(lambda: client.lookups.channel is not None, 10)
    assert client.exists([b"x"], 5.0) == [True]
    assert first.spent or wait_until(lambda: _closed_by_node(first), 5)


def _closed_by_node(channel) -> bool:
    try:
        channel.request(protocol.Op.EXISTS, 0, b"", time.monotonic() + 1.0)
    except Exception:
        return True
    return False


def test_a_hung_node_times_a_lookup_out_and_the_channel_serves_on(pool_nodes, node_clients):
    node, client = _ready(pool_nodes, node_clients)
    channel = client.lookups.channel
    assert channel is not None
    os.kill(node.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(TransportError) as failed:
            client.exists([b"x"], 0.3)
        assert failed.value.status_code() == EmsErrorCode.EMS_IO_TIMEOUT
        assert time.monotonic() - started < 2.0
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)
    assert client.exists([b"x"], 5.0) == [True]  # the late reply dropped, the next one this lookup's
    assert client.lookups.channel is channel


def test_a_dead_node_fails_a_lookup_by_its_deadline(pool_nodes, node_clients):
    node = pool_nodes("64MiB")
    client = _client(node_clients, node)
    client.connect_now(5.0)
    assert client.lookups.channel is not None
    node.proc.kill()
    node.proc.wait()
    started = time.monotonic()
    with pytest.raises(TransportError):
        client.exists([b"x"], 2.0)
    assert time.monotonic() - started < 3.0


def test_a_lost_channel_falls_back_to_ucx_within_the_call(pool_nodes, node_clients):
    _, client = _ready(pool_nodes, node_clients)
    channel = client.lookups.channel
    channel._sock.shutdown(2)  # the socket lost under the channel (as a reset would)
    assert client.exists([b"x"], 5.0) == [True]  # over UCX, this call
    assert client.lookups.channel is None
    client.lookups._retry_at = 0.0
    assert client.exists([b"x"], 5.0) == [True]  # over UCX; the opening starts
    assert wait_until(lambda: client.lookups.channel is not None, 10)


@pytest.mark.parametrize("seed", [1, 2])
def test_random_calls_agree_with_a_model(pool_nodes, node_clients, seed):
    """A long random sequence of puts, lookups (alone and several keys, holds), aborts and lost channels: every
    lookup answers what was stored, over whichever path served it."""
    rng = random.Random(seed)
    node = pool_nodes("64MiB")
    client = _client(node_clients, node)
    stored: set[bytes] = set()
    universe = [f"key-{i}".encode() for i in range(60)]
    for step in range(300):
        action = rng.random()
        if action < 0.25:
            keys = rng.sample(universe, rng.randint(1, 6))
            assert all(client.put(keys, make_values(len(keys), VALUE, seed=step), 10.0))
            stored.update(keys)
        elif action < 0.85:
            keys = [rng.choice(universe) for _ in range(rng.randint(1, 12))]
            hold = Hold.lease(5_000) if rng.random() < 0.1 else None
            assert client.exists(keys, 5.0, hold) == [k in stored for k in keys], f"step {step}"
        elif action < 0.92:
            client.abort()
        elif action < 0.97:
            channel = client.lookups.channel
            if channel is not None:
                with contextlib.suppress(OSError):  # (shut already, by an earlier step no lookup has seen since)
                    channel._sock.shutdown(2)
            client.lookups._retry_at = 0.0
        else:
            client.connect_now(5.0)
    client.lookups._retry_at = 0.0
    assert client.exists([b"key-0"], 5.0) == [b"key-0" in stored]
    assert wait_until(lambda: client.lookups.channel is not None, 15)  # the channel comes back after it all
    assert client.exists(universe, 5.0) == [k in stored for k in universe]


def test_open_reply_codec() -> None:
    token = bytes(range(wire.TOKEN_BYTES))
    assert wire.decode_open_reply(wire.encode_open_reply(token, 7000)) == (token, 7000)
    assert wire.decode_open_reply(wire.encode_open_reply(wire.NO_CHANNEL, 0)) == (wire.NO_CHANNEL, 0)
    for bad in (wire.encode_open_reply(token, 0), wire.encode_open_reply(wire.NO_CHANNEL, 7000), b"short"):
        with pytest.raises(protocol.ProtocolError):
            wire.decode_open_reply(bad)
    assert wire.same_address("::ffff:10.0.0.1", "10.0.0.1")
    assert not wire.same_address("10.0.0.2", "10.0.0.1")
    assert not wire.same_address("?", "?")
    with pytest.raises(ValueError):
        wire.LookupSettings(port=70000)


def test_a_closed_client_opens_no_channel(pool_nodes, node_clients):
    node = pool_nodes("64MiB")
    client = _client(node_clients, node)
    client.connect_now(5.0)
    client.lookups.close()
    assert client.lookups.channel is None
    assert not client.lookups.open_now(Deadline.within(5.0))
    assert client.exists([b"x"], 5.0) == [False]  # over UCX
    time.sleep(0.2)
    assert client.lookups.channel is None


def test_an_abort_fails_a_lookup_in_flight_at_once(pool_nodes, node_clients):
    """A caller that stops waiting for a slow node (a fan-out giving up on it) aborts its client: a lookup waiting on
    the channel fails now, as cancelled (no back-off), not at its deadline; the next lookup is answered."""
    node, client = _ready(pool_nodes, node_clients)
    assert client.lookups.channel is not None
    failed: list[BaseException] = []

    def lookup() -> None:
        try:
            client.exists([b"x"], 30.0)
        except BaseException as error:  # (kept for the assertions below)
            failed.append(error)

    os.kill(node.proc.pid, signal.SIGSTOP)
    try:
        waiter = threading.Thread(target=lookup)
        waiter.start()
        time.sleep(0.3)  # (in flight on the channel)
        started = time.monotonic()
        client.abort()
        waiter.join(10.0)
        assert not waiter.is_alive() and time.monotonic() - started < 5.0
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)
    assert len(failed) == 1 and isinstance(failed[0], TransportError)
    assert client.last_failure is Failure.CANCELLED
    assert client.exists([b"x"], 5.0) == [True]  # reconnects at once: no back-off

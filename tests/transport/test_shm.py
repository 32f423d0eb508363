"""Same-host shared memory between `UcxNode` and a real pool-node process: byte-exact round trips (copied and zero
copy), fallback to UCX whenever the region cannot serve, and failures of either side mid-transfer."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pool_testlib import joined, make_values

from ems.errors import EmsErrorCode
from ems.transport.base import TransportError
from ems.transport.shm.client import ShmMode

pytestmark = pytest.mark.slow


def _region(node):
    region = node.shm._region
    assert region is not None and not region.allocator.poisoned, "the call did not go through shared memory"
    return region


def _value(size: int, seed: int) -> list[bytes]:
    return make_values(1, size, seed=seed)[0]


@pytest.mark.parametrize("size", [0, 1, 4056, 4057, 70_000, (1 << 20) - 40, 3 * (1 << 20) + 5])
def test_round_trip_is_byte_exact_over_shm(shared_node, node_clients, size):
    node = node_clients(shared_node.address)
    values = [_value(size, seed=size + i) for i in range(3)]
    keys = [f"shm-{size}-{i}".encode() for i in range(3)]
    assert node.put(keys, values, 5.0) == [True] * 3
    region = _region(node)
    # the values went through the region: the first put's bytes are there, back to back from offset 0
    assert bytes(region.array[: len(joined(values[0]))]) == joined(values[0])
    outs = [np.full(len(joined(v)), 0xAB, np.uint8) for v in values]
    assert node.get_into(keys, outs, 5.0) == [True] * 3
    assert [o.tobytes() for o in outs] == [joined(v) for v in values]
    assert node.shm._region is region and region.allocator.used == 0  # every range given back


@pytest.fixture(scope="module")
def module_client(shared_node):
    """One client for every example of a property test (a client per example would take a region each)."""
    from ems.transport.ucx.client import UcxNode

    node = UcxNode(shared_node.address, connect_timeout_ms=2000)
    yield node
    node.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 300_000), st.sampled_from(["hit", "miss", "short", "long"])), min_size=1, max_size=12))
def test_random_batches_match_a_model(module_client, batch):
    """Random batches of sizes with misses and buffers of the wrong length: placed exactly where the model says."""
    node = module_client
    tag = os.urandom(6).hex()
    keys, values, outs = [], [], []
    for i, (size, kind) in enumerate(batch):
        value = _value(size, seed=size + i)
        key = f"r-{tag}-{i}".encode()
        keys.append(key)
        if kind != "miss":
            values.append((key, value))
        n = len(joined(value)) + {"hit": 0, "miss": 0, "short": -1, "long": 1}[kind]
        outs.append(np.zeros(max(n, 0), np.uint8))
    if values:
        assert node.put([k for k, _ in values], [v for _, v in values], 5.0) == [True] * len(values)
    placed = node.get_into(keys, outs, 5.0)
    model = dict(values)
    for key, out, ok, (size, kind) in zip(keys, outs, placed, batch):
        assert ok == (kind == "hit"), (kind, size)
        if ok:
            assert out.tobytes() == joined(model[key])
    _region(node)


def test_zero_copy_from_and_into_the_region(shared_node, node_clients):
    node = node_clients(shared_node.address)
    assert node.ping(5.0) and node.put([b"warm"], [_value(10, 1)], 5.0) == [True]
    values = [joined(_value(200_000 + i, seed=i)) for i in range(4)]
    staging = node.shm_buffer(sum(len(v) for v in values))
    assert staging is not None
    at, views = 0, []
    for v in values:
        staging.array[at : at + len(v)] = np.frombuffer(v, np.uint8)
        views.append(staging.array[at : at + len(v)])
        at += len(v)
    keys = [b"zc-%d" % i for i in range(4)]
    assert node.put(keys, [[v] for v in views], 5.0) == [True] * 4
    staging.array[:] = 0
    assert node.get_into(keys, views, 5.0) == [True] * 4
    assert [v.tobytes() for v in views] == values
    staging.release()
    assert _region(node).allocator.used == 0


def test_concurrent_calls_share_one_region(shared_node, node_clients):
    node = node_clients(shared_node.address)
    errors: list = []

    def worker(t: int) -> None:
        try:
            for r in range(6):
                values = [_value(100_000 * (t + 1) + r, seed=t * 100 + r) for _ in range(3)]
                keys = [f"c{t}-{r}-{i}".encode() for i in range(3)]
                assert node.put(keys, values, 10.0) == [True] * 3
                outs = [np.empty(len(joined(v)), np.uint8) for v in values]
                assert node.get_into(keys, outs, 10.0) == [True] * 3
                assert [o.tobytes() for o in outs] == [joined(v) for v in values]
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert _region(node).allocator.used == 0


def test_falls_back_to_ucx_when_the_node_offers_no_region(pool_nodes, node_clients):
    off = pool_nodes(args=("--shm-bytes", "0"))
    node = node_clients(off.address)
    values = [_value(500_000, seed=3)]
    assert node.put([b"k"], values, 5.0) == [True]
    out = np.empty(len(joined(values[0])), np.uint8)
    assert node.get_into([b"k"], [out], 5.0) == [True] and out.tobytes() == joined(values[0])
    assert node.shm._region is None and node.shm._no_region_on is not None


def test_falls_back_when_the_client_turns_it_off(shared_node, node_clients):
    assert node_clients(shared_node.address, shm=ShmMode.OFF).shm is None
    assert node_clients(shared_node.address).shm is not None  # auto by default


def test_falls_back_when_the_region_is_too_small_or_taken(pool_nodes, node_clients):
    small = pool_nodes(args=("--shm-bytes", "1MiB", "--shm-total", "1MiB"))
    first, second = node_clients(small.address), node_clients(small.address)
    big = [_value(3 << 20, seed=5)]
    assert first.put([b"big"], big, 5.0) == [True]  # larger than the region: over UCX
    region = _region(first)
    assert region.array.nbytes == 1 << 20
    assert first.put([b"small"], [_value(1000, 6)], 5.0) == [True]  # fits: shared memory
    assert bytes(region.array[:1040]) == joined(_value(1000, 6))
    out = np.empty(len(joined(big[0])), np.uint8)
    assert second.get_into([b"big"], [out], 5.0) == [True] and out.tobytes() == joined(big[0])
    assert second.shm._region is None  # the node's total was taken by the first connection


def test_node_killed_mid_transfer_fails_the_call_within_its_timeout(pool_nodes, node_clients):
    node_proc = pool_nodes("512MiB")
    node = node_clients(node_proc.address)
    values = [_value((4 << 20) - 40, seed=i) for i in range(16)]
    keys = [b"big-%d" % i for i in range(16)]
    assert node.put(keys, values, 10.0) == [True] * 16
    _region(node)
    outs = [np.zeros(4 << 20, np.uint8) for _ in keys]
    node_proc.pause()  # the request is posted and waits: then the node dies under it
    outcome: list = []

    def load() -> None:
        started = time.monotonic()
        try:
            outcome.append(node.get_into(keys, outs, 3.0))
        except TransportError as error:
            outcome.append(error)
        outcome.append(time.monotonic() - started)

    thread = threading.Thread(target=load)
    thread.start()
    time.sleep(0.3)
    node_proc.kill()
    thread.join(10)
    assert isinstance(outcome[0], TransportError), outcome
    assert outcome[0].status_code() in (EmsErrorCode.EMS_IO_ERROR, EmsErrorCode.EMS_IO_TIMEOUT)
    assert outcome[1] < 3.0 + 1.0
    assert all(not o.any() for o in outs)  # nothing was placed from a failed request


def test_a_timed_out_call_poisons_the_region_and_the_next_connection_gets_a_fresh_one(pool_nodes, node_clients):
    node_proc = pool_nodes()
    node = node_clients(node_proc.address)
    assert node.put([b"a"], [_value(5000, 1)], 5.0) == [True]
    old = _region(node)
    node_proc.pause()
    try:
        with pytest.raises(TransportError) as raised:
            node.put([b"b"], [_value(5000, 2)], 0.5)
        assert raised.value.status_code() == EmsErrorCode.EMS_IO_TIMEOUT
        assert old.allocator.poisoned and old.allocator.alloc(1) is None
    finally:
        node_proc.resume()
    time.sleep(0.6)  # past the reconnect back-off
    out = np.empty(len(joined(_value(5000, 1))), np.uint8)
    assert node.get_into([b"a"], [out], 5.0) == [True] and out.tobytes() == joined(_value(5000, 1))
    new = _region(node)
    assert new is not old and new.ep is not old.ep


_DYING_CLIENT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {pool_dir!r})
    import ems.transport.ucx.config
    from pool_testlib import make_values
    from ems.transport.ucx.client import UcxNode
    node = UcxNode({address!r})
    values = make_values(24, (1 << 20) - 40, seed=7)
    keys = [b"dying-%d" % i for i in range(24)]
    node.put(keys[:1], values[:1], 10.0)
    assert node.shm._region is not None
    print("ready", flush=True)
    while True:
        node.put(keys, values, 10.0)
""")


def test_client_killed_mid_transfer_leaves_the_node_serving(pool_nodes, node_clients):
    node_proc = pool_nodes("512MiB")
    pool_dir = os.path.join(os.path.dirname(__file__), "..", "pool")
    script = _DYING_CLIENT.format(pool_dir=os.path.abspath(pool_dir), address=node_proc.address)
    for _ in range(2):
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            time.sleep(0.4)  # puts in flight
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            if child.stdout is not None:
                child.stdout.close()
    node = node_clients(node_proc.address)
    values = [_value(1 << 20, seed=9)]
    assert node.put([b"after"], values, 5.0) == [True]
    out = np.empty(len(joined(values[0])), np.uint8)
    assert node.get_into([b"after"], [out], 5.0) == [True] and out.tobytes() == joined(values[0])
    _region(node)
    assert node_proc.proc is not None and node_proc.proc.poll() is None


E2E_CLIENT = os.path.join(os.path.dirname(__file__), "..", "pool", "e2e_client.py")


def _api_client(env_shm: str, **args) -> dict:
    env = {**os.environ, "EMS_POOL_SHM": env_shm}
    proc = subprocess.run([sys.executable, E2E_CLIENT, json.dumps(args)], capture_output=True, text=True, timeout=90, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, (proc.stdout, proc.stderr[-3000:])
    return json.loads(lines[-1])


@pytest.mark.parametrize("shm", ["auto", "off"])
def test_api_save_and_load_across_processes(pool_nodes, shm):
    """Through `import ems`: one process saves, another loads, byte-exact, with staging in the region (auto) or over
    UCX alone (off)."""
    node = pool_nodes().address
    saved = _api_client(shm, nodes=[node], steps=["save", "shm"])
    assert saved == {"save": [12, 12], "shm": [shm == "auto"]}
    loaded = _api_client(shm, nodes=[node], steps=["load", "shm"])
    assert loaded == {"load": [12, 12], "load_exact": True, "shm": [shm == "auto"]}


def test_the_local_pool_node_shares_memory_by_default(tmp_path, node_clients):
    from ems.integrations.local_pool import ensure_local_pool, stop_local_pool

    try:
        pool = ensure_local_pool(str(tmp_path), "64MiB")
        node = node_clients(pool.address, access_id=pool.access_id, access_key=pool.access_key)  # the node is keyed
        values = [_value(300_000, seed=4)]
        assert node.put([b"local"], values, 10.0) == [True]
        out = np.empty(len(joined(values[0])), np.uint8)
        assert node.get_into([b"local"], [out], 10.0) == [True] and out.tobytes() == joined(values[0])
        _region(node)
    finally:
        stop_local_pool(str(tmp_path))


def _resident_pages(array: np.ndarray, nbytes: int) -> int:
    """How many of the first `nbytes` of `array`'s mapping are resident (mincore(2))."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    pages = nbytes // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(int(array.ctypes.data)), ctypes.c_size_t(nbytes), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec)


def test_connect_opens_the_region_and_populates_it_before_the_first_call(shared_node):
    """The package's connect (what `Ems.init` calls) opens the region at once, and its first PREFAULT_BYTES are
    faulted in in the background: a first load then neither opens it nor faults it page by page. A reconnect
    populates only what the region before it used."""
    from ems.transport.shm.client import first_populate_bytes
    from ems.transport.ucx.remote import connect

    node = connect(shared_node.address, connect_timeout_ms=5000)
    try:
        region = _region(node)  # opened without any call
        want = min(first_populate_bytes(), region.array.nbytes)  # (all of PREFAULT_BYTES with no other client open)
        deadline = time.monotonic() + 30
        while _resident_pages(region.array, want) < want // 4096 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _resident_pages(region.array, want) == want // 4096
        staged = node.shm_buffer(1 << 20)
        assert staged is not None  # a load's staging comes from the region from the first call on
        staged.release()
        assert node.put([b"prefault-1"], [_value(1000, seed=5)], 5.0) == [True]
        assert node.shm._region is region
        # a reconnect's region is populated only as far as the last one was used (one page here: 1 MiB, the unit)
        node.close()
        node.connect_now(5.0)
        fresh = _region(node)
        assert fresh is not region
        time.sleep(1.0)  # both sides' background populate, had they been given more to do
        assert _resident_pages(fresh.array, want) <= (1 << 20) // 4096
    finally:
        node.close()


def test_the_clients_of_a_process_share_one_populate(shared_node):
    """A process's open shared-memory clients split PREFAULT_BYTES: with four open, each first region populates
    about a quarter of it ahead of use (both sides), not a whole region each (a first call to a pool of many
    same-host nodes would otherwise wait for all their populates)."""
    from ems.transport.shm import wire
    from ems.transport.shm.client import first_populate_bytes
    from ems.transport.ucx.client import UcxNode

    alone = first_populate_bytes()
    nodes = [UcxNode(shared_node.address, connect_timeout_ms=5000) for _ in range(4)]
    try:
        share = first_populate_bytes()
        assert share <= -(-wire.PREFAULT_BYTES // 4 // (1 << 20)) * (1 << 20) and share < alone
        for node in nodes:
            node.connect_now(5.0)
        regions = [_region(node) for node in nodes]
        assert all(region.array.nbytes > share for region in regions)  # (else the test would show nothing)
        deadline = time.monotonic() + 30
        while any(_resident_pages(r.array, share) < share // 4096 for r in regions) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # a populate past the share would show by now
        for region in regions:
            assert _resident_pages(region.array, share) == share // 4096
            assert _resident_pages(region.array, region.array.nbytes) == share // 4096
    finally:
        for node in nodes:
            node.close()
    assert first_populate_bytes() == alone  # closed clients no longer count
    dropped = [UcxNode(shared_node.address, connect_timeout_ms=5000) for _ in range(2)]
    assert first_populate_bytes() < alone
    del dropped
    gc.collect()
    assert first_populate_bytes() == alone  # nor do clients collected without a close


class _ChannelSpy:
    """Counts the requests a client sends over its region's channel and over UCX (the real paths run)."""

    def __init__(self, node, monkeypatch) -> None:
        from ems.transport.shm import client_region as shm_channel

        self.channel = 0
        self.ucx = 0
        real_request, real_call = shm_channel.ClientChannel.request, node._call

        def request(channel, *args, **kwargs):
            self.channel += 1
            return real_request(channel, *args, **kwargs)

        def call(*args, **kwargs):
            self.ucx += 1
            return real_call(*args, **kwargs)

        monkeypatch.setattr(shm_channel.ClientChannel, "request", request)
        monkeypatch.setattr(node, "_call", call)


def test_requests_travel_on_the_region_channel_not_on_ucx(shared_node, node_clients, monkeypatch):
    """Once the region is open, a same-host put and get are one request each on the region's socket: no UCX post."""
    node = node_clients(shared_node.address)
    assert node.put([b"warm"], [_value(100, 1)], 5.0) == [True]
    assert _region(node).channel is not None
    spy = _ChannelSpy(node, monkeypatch)
    values = [_value(300_000, seed=i) for i in range(5)]
    keys = [b"chan-%d" % i for i in range(5)]
    assert node.put(keys, values, 5.0) == [True] * 5
    outs = [np.empty(len(joined(v)), np.uint8) for v in values]
    assert node.get_into(keys + [b"chan-missing"], outs + [np.empty(10, np.uint8)], 5.0) == [True] * 5 + [False]
    assert [o.tobytes() for o in outs] == [joined(v) for v in values]
    assert (spy.channel, spy.ucx) == (2, 0)


def test_a_lookup_travels_on_the_region_channel_with_its_hold(shared_node, node_clients, monkeypatch):
    """Once the region is open, a same-host EXISTS is one request on the region's socket (no UCX post), answers as
    over UCX, and keeps what it asks to keep: a lease holds the key found, a pin too; a key not found is not held.
    Before a region exists a lookup goes over UCX and does not open one."""
    from ems.transport.exists_holds import Hold

    fresh = node_clients(shared_node.address)
    assert fresh.exists([b"nothing-yet"], 5.0) == [False]
    assert fresh.shm is not None and fresh.shm._region is None  # a lookup opens no region
    node = node_clients(shared_node.address)
    assert node.put([b"look-1", b"look-2"], [_value(100, 1), _value(200, 2)], 5.0) == [True, True]
    spy = _ChannelSpy(node, monkeypatch)
    assert node.exists([b"look-1", b"look-missing", b"look-2"], 5.0) == [True, False, True]
    assert node.exists([b"look-2"], 5.0, Hold.lease(1000)) == [True]
    assert node.exists([b"look-1", b"look-missing"], 5.0, Hold.pin()) == [True, False]
    assert (spy.channel, spy.ucx) == (3, 0)
    out = np.empty(len(joined(_value(200, 2))), np.uint8)
    assert node.get_into([b"look-2"], [out], 5.0) == [True] and out.tobytes() == joined(_value(200, 2))


def test_calls_in_flight_at_once_all_travel_on_the_channel(shared_node, node_clients, monkeypatch):
    """Up to CHANNEL_IN_FLIGHT calls at once share the region's channel (replies told apart by request id, in any
    order): none of them posts on UCX, and every value comes back byte-exact to the call that asked for it."""
    from ems.transport.shm import client_region as shm_channel
    from ems.transport.shm.wire import CHANNEL_IN_FLIGHT

    node = node_clients(shared_node.address)
    assert node.put([b"warm3"], [_value(100, 5)], 5.0) == [True]
    spy = _ChannelSpy(node, monkeypatch)
    in_flight_at_send: list[int] = []
    real_send = shm_channel.ClientChannel._send_all

    def send_all(channel, *args):
        in_flight_at_send.append(len(channel._waiting))  # this request included
        return real_send(channel, *args)

    monkeypatch.setattr(shm_channel.ClientChannel, "_send_all", send_all)
    threads = CHANNEL_IN_FLIGHT
    rounds = 6
    start = threading.Barrier(threads)
    failures: list[str] = []

    def work(t: int) -> None:
        start.wait()
        for r in range(rounds):
            size = 40_000 + 300_000 * ((t + r) % 4)  # replies of different sizes finish out of order
            keys = [b"fly-%d-%d-%d" % (t, r, i) for i in range(3)]
            values = [_value(size, seed=1000 * t + 10 * r + i) for i in range(3)]
            if node.put(keys, values, 10.0) != [True] * 3:
                failures.append(f"put {t}/{r}")
                return
            outs = [np.empty(len(joined(v)), np.uint8) for v in values]
            if node.get_into(keys, outs, 10.0) != [True] * 3 or [o.tobytes() for o in outs] != [joined(v) for v in values]:
                failures.append(f"get {t}/{r}")
                return

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not failures and not any(w.is_alive() for w in workers)
    assert (spy.channel, spy.ucx) == (2 * threads * rounds, 0)
    assert max(in_flight_at_send) > 1, "the calls never overlapped: nothing was in flight at once"
    assert not _region(node).channel.closed


def test_random_calls_from_threads_match_a_model_on_the_channel(shared_node, node_clients, monkeypatch):
    """Four threads, each a random sequence of puts, reads and lookups (some keys missing, values of random sizes)
    over one region's channel: lookups answered between the node's reads and data requests served as tasks share
    the socket, and every answer matches each thread's model of what it stored; nothing goes over UCX and the
    channel stays open."""
    import random

    node = node_clients(shared_node.address)
    assert node.put([b"warm-model"], [_value(100, 9)], 5.0) == [True]
    spy = _ChannelSpy(node, monkeypatch)
    failures: list[str] = []

    def work(t: int) -> None:
        rng = random.Random(4242 + t)
        stored: dict[bytes, bytes] = {}
        for step in range(60):
            keys = [b"model-%d-%d" % (t, rng.randrange(12)) for _ in range(rng.randint(1, 3))]
            keys = list(dict.fromkeys(keys))
            op = rng.choice(("put", "get", "exists", "exists"))
            if op == "put":
                values = [
                    _value(rng.choice((0, 10, 4000, 70_000, 200_000)), seed=10_000 * t + step + i) for i in range(len(keys))
                ]
                if node.put(keys, values, 10.0) != [True] * len(keys):
                    failures.append(f"put {t}/{step}")
                    return
                stored.update(zip(keys, (joined(v) for v in values)))
            elif op == "get":
                outs = [np.empty(len(stored[k]) if k in stored else 16, np.uint8) for k in keys]
                found = node.get_into(keys, outs, 10.0)
                if found != [k in stored for k in keys] or any(
                    o.tobytes() != stored[k] for k, o in zip(keys, outs) if k in stored
                ):
                    failures.append(f"get {t}/{step}")
                    return
            elif node.exists(keys, 10.0) != [k in stored for k in keys]:
                failures.append(f"exists {t}/{step}")
                return

    workers = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert not failures and not any(w.is_alive() for w in workers)
    assert spy.ucx == 0 and spy.channel == 4 * 60
    assert not _region(node).channel.closed


def test_a_busy_channel_sends_the_next_call_over_ucx(shared_node, node_clients, monkeypatch):
    """Calls in flight at once share the region: one that finds every slot of the channel taken posts its request on
    UCX."""
    from ems.transport.shm.wire import CHANNEL_IN_FLIGHT

    node = node_clients(shared_node.address)
    assert node.put([b"warm2"], [_value(100, 2)], 5.0) == [True]
    channel = _region(node).channel
    spy = _ChannelSpy(node, monkeypatch)
    for _ in range(CHANNEL_IN_FLIGHT):
        assert channel.slots.acquire(blocking=False)
    try:
        assert node.put([b"side"], [_value(70_000, 3)], 5.0) == [True]
        out = np.empty(len(joined(_value(70_000, 3))), np.uint8)
        assert node.get_into([b"side"], [out], 5.0) == [True] and out.tobytes() == joined(_value(70_000, 3))
    finally:
        for _ in range(CHANNEL_IN_FLIGHT):
            channel.slots.release()
    assert (spy.channel, spy.ucx) == (0, 2)
    assert _region(node).channel is channel  # still the region's channel, used again once free
    assert node.get_into([b"side"], [out], 5.0) == [True] and spy.channel == 1


def _raw_get(request_id: int, key: bytes, capacity: int = 1 << 16) -> bytes:
    """An SHM_GET of one key into the region's first `capacity` bytes, as bytes for the channel."""
    from ems.transport import protocol
    from ems.transport.shm.client import encode_ranged

    meta = encode_ranged([key], [0], [capacity])
    return (
        protocol.pack_header(
            protocol.Op.SHM_GET, count=1, meta_len=len(meta), meta_end=protocol.end_byte(meta), request_id=request_id
        ).tobytes()
        + meta
    )


def _raw_reply(sock) -> tuple:
    from ems.transport import protocol

    head = b""
    while len(head) < protocol.HEADER_SIZE:
        chunk = sock.recv(protocol.HEADER_SIZE - len(head))
        if not chunk:
            return None, b""
        head += chunk
    header = protocol.unpack_header(head)
    body = b""
    while len(body) < header.meta_len:
        body += sock.recv(header.meta_len - len(body))
    return header, body


def test_the_node_answers_requests_in_flight_by_their_ids_and_ends_the_channel_on_a_reused_one(shared_node, node_clients):
    """From a raw client on the region's socket: two requests sent back to back are both answered, each under its
    own id; a request whose id is still in flight is malformed and ends the channel (the client then recovers)."""
    from ems.transport import protocol

    node = node_clients(shared_node.address)
    assert node.put([b"ids"], [_value(5000, 6)], 5.0) == [True]
    big = _value(6 << 20, 7)
    assert node.put([b"ids-big"], [big], 10.0) == [True]
    region = _region(node)
    sock = region.channel._sock
    sock.setblocking(True)
    sock.settimeout(5.0)
    try:
        sock.sendall(_raw_get(7, b"ids") + _raw_get(9, b"absent"))
        replies = {}
        for _ in range(2):
            header, body = _raw_reply(sock)
            assert header is not None and header.op == protocol.Op.SHM_GET | protocol.REPLY
            replies[header.request_id] = np.frombuffer(body, "<i8").tolist()
        assert replies == {7: [len(joined(_value(5000, 6)))], 9: [-1]}
        # the same id twice, the first still in flight: its 6 MiB copy runs on the node's worker thread (over
        # OFFLOAD_BYTES) while the node reads the second request
        sock.sendall(_raw_get(11, b"ids-big", len(joined(big))) + _raw_get(11, b"ids"))
        seen = []
        while True:
            header, _ = _raw_reply(sock)
            if header is None:
                break  # the node closed the channel
            seen.append(header.request_id)
        assert seen in ([], [11])  # at most the first one answered, then the channel ended
    finally:
        sock.setblocking(False)
    with pytest.raises(TransportError):
        node.get_into([b"ids"], [np.empty(len(joined(_value(5000, 6))), np.uint8)], 2.0)
    time.sleep(0.6)  # past the reconnect back-off
    out = np.empty(len(joined(_value(5000, 6))), np.uint8)
    assert node.get_into([b"ids"], [out], 5.0) == [True] and out.tobytes() == joined(_value(5000, 6))


def _raw_exists(request_id: int, keys: list[bytes]) -> bytes:
    """An EXISTS of `keys` as bytes for the channel (the client's framing there: header, then the keys' meta)."""
    from ems.transport import metas, protocol

    meta = metas.encode_keys_meta(keys)
    head = protocol.pack_header(
        protocol.Op.EXISTS, count=len(keys), meta_len=len(meta), request_id=request_id, meta_end=protocol.end_byte(meta)
    )
    return head.tobytes() + meta


def test_requests_sent_back_to_back_are_each_answered_under_their_ids(shared_node, node_clients):
    """From a raw client on the region's socket: 40 lookups and a GET written in one send (the node reads several
    requests per receive, and answers a lookup between two reads) are each answered once, under their own ids, with
    the flags of their own keys; the channel then keeps serving."""
    from ems.transport import protocol

    node = node_clients(shared_node.address)
    assert node.put([b"b2b-0", b"b2b-2"], [_value(3000, 1), _value(3000, 2)], 5.0) == [True, True]
    sock = _region(node).channel._sock
    sock.setblocking(True)
    sock.settimeout(5.0)
    asked = {rid: [b"b2b-%d" % (rid % 4), b"b2b-%d" % ((rid + 2) % 4)] for rid in range(100, 140)}
    try:
        sock.sendall(b"".join(_raw_exists(rid, keys) for rid, keys in asked.items()) + _raw_get(7, b"b2b-2"))
        answers = {}
        for _ in range(len(asked) + 1):
            header, body = _raw_reply(sock)
            assert header is not None and header.request_id not in answers
            answers[header.request_id] = (header.op, body)
    finally:
        sock.setblocking(False)
    op, body = answers.pop(7)
    assert op == protocol.Op.SHM_GET | protocol.REPLY
    assert np.frombuffer(body, "<i8").tolist() == [len(joined(_value(3000, 2)))]
    for rid, keys in asked.items():
        op, body = answers[rid]
        assert op == protocol.Op.EXISTS | protocol.REPLY
        assert protocol.decode_flags(len(keys), body) == [key in (b"b2b-0", b"b2b-2") for key in keys]
    assert node.exists([b"b2b-0", b"b2b-1"], 5.0) == [True, False]


def test_a_refused_request_ends_the_channel_at_once(node_clients):
    """A request the node refuses on the channel (an SHM_PUT larger than its whole in-flight budget) is answered
    BAD_REQUEST and the node closes the channel at once, while it was waiting for the next request: a raw client
    that sends nothing more reads the refusal, then the end, within a second."""
    from pool_testlib import PoolProcess

    from ems.transport import protocol
    from ems.transport.shm.client import encode_ranged

    pool_node = PoolProcess("256MiB", args=("--max-inflight", "1MiB"))
    try:
        node = node_clients(pool_node.address)
        assert node.put([b"small"], [_value(1000, 3)], 5.0) == [True]
        sock = _region(node).channel._sock
        sock.setblocking(True)
        sock.settimeout(5.0)
        meta = encode_ranged([b"too-big"], [0], [2 << 20])
        head = protocol.pack_header(
            protocol.Op.SHM_PUT, count=1, meta_len=len(meta), meta_end=protocol.end_byte(meta), request_id=5
        )
        started = time.monotonic()
        try:
            sock.sendall(head.tobytes() + meta)
            header, body = _raw_reply(sock)
            assert header is not None and header.status == protocol.Status.BAD_REQUEST and b"in-flight" in body
            assert _raw_reply(sock)[0] is None  # the end of the channel, not a timeout
        finally:
            sock.setblocking(False)
        assert time.monotonic() - started < 1.0
    finally:
        pool_node.cleanup()


@pytest.mark.parametrize(
    "junk",
    [
        b"\x00" * 32,  # not a header
        "open",  # a well-formed header of an op the channel does not carry
        "ping",  # another op the channel does not carry
        "inline-exists",  # an op it carries, in UCX's inline framing
        "pin-get",  # a flag the op does not define
        "huge",  # a header announcing a meta past the protocol's limit
    ],
    ids=["zeros", "open", "ping", "inline-exists", "pin-get", "huge"],
)
def test_junk_on_the_channel_closes_it_and_the_client_recovers(shared_node, node_clients, junk):
    """A client that writes anything but an SHM_GET, SHM_PUT or EXISTS on its channel loses the channel (and its connection,
    at its next call); the node keeps serving, and the client's next connection has a working region."""
    from ems.transport import metas, protocol

    node = node_clients(shared_node.address)
    assert node.put([b"j"], [_value(5000, 4)], 5.0) == [True]
    old = _region(node)
    if junk == "open":
        junk = protocol.pack_header(protocol.Op.SHM_OPEN, request_id=1).tobytes()
    elif junk == "ping":
        junk = protocol.pack_header(protocol.Op.PING, request_id=1).tobytes()
    elif junk == "inline-exists":
        meta = metas.encode_keys_meta([b"j"])
        head = protocol.pack_header(
            protocol.Op.EXISTS,
            count=1,
            meta_len=len(meta),
            request_id=1,
            flags=protocol.Flags.INLINE,
            meta_end=protocol.end_byte(meta),
        )
        junk = head.tobytes() + meta
    elif junk == "pin-get":
        junk = protocol.pack_header(protocol.Op.SHM_GET, request_id=1, flags=protocol.Flags.PIN).tobytes()
    elif junk == "huge":
        junk = protocol.pack_header(protocol.Op.SHM_GET, count=1, meta_len=protocol.MAX_META_BYTES + 1, request_id=1).tobytes()
    old.channel._sock.setblocking(True)
    old.channel._sock.sendall(junk)
    old.channel._sock.setblocking(False)
    time.sleep(0.2)
    with pytest.raises(TransportError):
        node.get_into([b"j"], [np.empty(len(joined(_value(5000, 4))), np.uint8)], 2.0)
    assert old.allocator.poisoned and old.channel.closed
    time.sleep(0.6)  # past the reconnect back-off
    out = np.empty(len(joined(_value(5000, 4))), np.uint8)
    assert node.get_into([b"j"], [out], 5.0) == [True] and out.tobytes() == joined(_value(5000, 4))
    new = _region(node)
    assert new is not old and new.channel is not None and not new.channel.closed

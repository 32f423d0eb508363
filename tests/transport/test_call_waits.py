"""Calls from many threads on one connection while the node stalls or dies: every call ends in time with its own
answer or a TransportError, never another call's answer; UCX progressed on the loop thread never spins while idle."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from pool_testlib import joined, make_values, wait_until
from proc_cpu import process_cpu_seconds

from ems.transport import protocol
from ems.transport.base import TransportError
from ems.transport.ucx import frames as ucx_frames

pytestmark = pytest.mark.slow

SLACK_S = 2.0  # how far past its timeout a call may end on this shared machine (bounded, not a speed claim)


def _hammer(
    node, stop: threading.Event, thread: int, timeout_s: float, stored: dict, wrong: list, late: list, outcomes: list
) -> None:
    """Random 1-key exists / get_into / put of small and segment-sized values until `stop`; records any answer
    that is not this call's own and any call that ran past its timeout."""
    rng = random.Random(thread)
    step = 0
    while not stop.is_set():
        step += 1
        key = rng.choice(sorted(stored))
        op = rng.choice(["exists", "exists", "get_into", "put"])
        started = time.monotonic()
        try:
            if op == "exists":
                missing = f"none-{thread}-{step}".encode()
                if node.exists([key, missing], timeout_s) != [True, False]:
                    wrong.append((thread, step, op))
            elif op == "get_into":
                out = np.full(len(stored[key]), 7, np.uint8)
                if node.get_into([key], [out], timeout_s) != [True] or bytes(out) != stored[key]:
                    wrong.append((thread, step, op))
            else:
                size = rng.choice([100, 5000, protocol.SEGMENT_BYTES + 64])
                value = make_values(1, size, seed=thread * 100_000 + step)
                if node.put([f"p-{thread}-{step}".encode()], value, timeout_s) != [True]:
                    wrong.append((thread, step, op))
            outcomes.append("ok")
        except TransportError as error:
            outcomes.append(error.status_code().name)
        elapsed = time.monotonic() - started
        if elapsed > timeout_s + SLACK_S:
            late.append((thread, step, op, elapsed))


def _stored(node, count: int) -> dict:
    values = make_values(count, 3000, seed=5) + make_values(2, protocol.SEGMENT_BYTES + 8, seed=6)
    keys = [f"k{i}".encode() for i in range(len(values))]
    assert node.put(keys, values, 20.0) == [True] * len(keys)
    return {k: joined(v) for k, v in zip(keys, values)}


def test_calls_from_many_threads_with_interleaved_timeouts(pool_nodes, node_clients):
    """6 threads call one connection with a short timeout while the node is paused now and then (each pause longer
    than the timeout): calls time out, the connection is dropped and re-made, and through all of it every call that
    returns has its own answer and none runs past its timeout by more than SLACK_S."""
    proc = pool_nodes("256MiB")
    node = node_clients(proc.address)
    stored = _stored(node, 6)
    stop = threading.Event()
    wrong: list = []
    late: list = []
    outcomes: list = []
    threads = [threading.Thread(target=_hammer, args=(node, stop, t, 0.25, stored, wrong, late, outcomes)) for t in range(6)]
    for th in threads:
        th.start()
    try:
        for _ in range(4):
            time.sleep(0.6)
            proc.pause()
            time.sleep(0.4)
            proc.resume()
        time.sleep(0.8)
    finally:
        proc.resume()
        stop.set()
        for th in threads:
            th.join(30)
    assert not any(th.is_alive() for th in threads)
    assert not wrong, wrong[:5]
    assert not late, late[:5]
    assert "ok" in outcomes and "EMS_IO_TIMEOUT" in outcomes, sorted(set(outcomes))
    # the connection recovers: after the backoff, calls succeed again with their own answers
    assert wait_until(lambda: _exists_ok(node, stored), 10.0)


def _exists_ok(node, stored: dict) -> bool:
    try:
        return node.exists(sorted(stored), 2.0) == [True] * len(stored)
    except TransportError:
        return False


def test_node_killed_mid_call_fails_bounded(pool_nodes, node_clients):
    """The node dies (SIGKILL) while 6 threads have calls in flight with a long timeout: every call ends well before
    its timeout (UCX reports the lost peer) with its own answer or a TransportError."""
    proc = pool_nodes("256MiB")
    node = node_clients(proc.address)
    stored = _stored(node, 6)
    stop = threading.Event()
    wrong: list = []
    late: list = []
    outcomes: list = []
    timeout_s = 20.0
    threads = [threading.Thread(target=_hammer, args=(node, stop, t, timeout_s, stored, wrong, late, outcomes)) for t in range(6)]
    for th in threads:
        th.start()
    time.sleep(0.8)
    killed_at = time.monotonic()
    proc.kill()
    stop.set()
    for th in threads:
        th.join(timeout_s + SLACK_S)
    ended_after = time.monotonic() - killed_at
    assert not any(th.is_alive() for th in threads)
    assert not wrong, wrong[:5]
    assert ended_after < timeout_s / 2, f"calls on a dead node took {ended_after:.1f} s to fail"
    assert "ok" in outcomes
    with pytest.raises(TransportError):
        node.exists([b"k0"], 2.0)


_IDLE_CLIENT = """
import sys, time
from ems.transport.ucx.client import UcxNode
node = UcxNode(sys.argv[1], connect_timeout_ms=2000)
assert node.ping(5.0)
print("connected", flush=True)
start = time.process_time()
time.sleep(2.0)
print(time.process_time() - start)
node.close()
"""


def test_idle_connection_does_not_spin(pool_nodes):
    """A connected, idle client and its node (a receive always posted on both) sleep: neither uses a sizeable share
    of a core (ucxx's own non-thread progress modes poll and burn a whole core here). The node populates no arena
    ahead: that one-time work runs on spare CPU (`ems.buffers.SpareCpuPacer`), so after a busy start it may fall in
    the idle window, and a fresh VM page costs up to ~12 ms per MiB to fault in. The client is a process of its own,
    so that what it measures is its connection, not threads other tests left in this one."""
    proc = pool_nodes("64MiB", args=("--prefault-ahead", "0"))
    client = subprocess.Popen([sys.executable, "-c", _IDLE_CLIENT, proc.address], stdout=subprocess.PIPE, text=True)
    assert client.stdout is not None and client.stdout.readline().strip() == "connected"
    node_cpu = process_cpu_seconds(proc.proc.pid)  # both sides measured from the client's ping on, over its 2 s of sleep
    out, _ = client.communicate(timeout=60)
    assert client.returncode == 0, out
    assert process_cpu_seconds(proc.proc.pid) - node_cpu < 0.6
    assert float(out.strip().splitlines()[-1]) < 0.6


@pytest.mark.parametrize(
    "size",
    [
        8,
        5000,
        ucx_frames.HEAD_BYTES - 100,
        ucx_frames.HEAD_BYTES + 8,
        protocol.SEGMENT_BYTES - 40,
        protocol.SEGMENT_BYTES,
        protocol.SEGMENT_BYTES + 5,
    ],
)
def test_one_key_loads_every_size(shared_node, node_clients, size):
    """1-key get / get_into (the node's and the client's 1-key paths) around the inline and segment limits: the
    value itself, a miss for a missing key, and a miss (never a partial value) for a buffer of another length."""
    node = node_clients(shared_node.address)
    value = make_values(1, size, seed=size)
    key = f"one-{size}".encode()
    assert node.put([key], value, 10.0) == [True]
    stored = joined(value[0])
    got = node.get([key], 10.0)
    assert got[0] is not None and bytes(got[0]) == stored
    assert node.get([b"one-missing"], 10.0) == [None]
    out = np.full(len(stored), 3, np.uint8)
    assert node.get_into([key], [out], 10.0) == [True] and bytes(out) == stored
    for other in (len(stored) - 1, len(stored) + 8):
        assert node.get_into([key], [np.zeros(other, np.uint8)], 10.0) == [False]
    assert node.get_into([b"one-missing"], [out], 10.0) == [False]
    # the connection is still in step: a later call gets its own answer
    assert node.exists([key, b"one-missing"], 10.0) == [True, False]

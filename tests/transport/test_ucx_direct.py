"""transport/ucx/direct.py: waits that the calling threads take turns on (one leads, the others sleep), against a
real pool node.

Every wait ends by its own deadline or when its own requests are complete, whichever thread leads, whatever the
others' deadlines; requests given up on are kept until UCX completes them (the endpoint aborted) and then dropped."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
from pool_testlib import joined, make_values

from ems.transport import protocol
from ems.transport.base import Ending
from ems.transport.ucx.client import UcxNode
from ems.transport.ucx.client_requests import ping
from ems.transport.ucx.direct import DirectRuntime, Exchange, WaitTimeout, futures_context

SLACK_S = 1.5  # how late past its deadline a wait may end on this shared machine (bounded, not a speed claim)
SILENT_TAG = 0xFFFF_FFF0  # a request id no node ever answers on


def _connection(node: UcxNode):
    node.connect_now(5.0)
    conn = node._link.current
    assert conn is not None
    return conn


def _silent_wait(conn, seconds: float) -> tuple[str, float]:
    """Wait `seconds` for a receive nothing will ever match; (outcome, how late past the deadline it ended)."""
    deadline = time.monotonic() + seconds
    with futures_context():
        ex = Exchange(conn, deadline)
        try:
            ex.wait([ex.recv(np.zeros(64, np.uint8), SILENT_TAG)])
            outcome = "completed"
        except WaitTimeout:
            outcome = "timeout"
        except Exception as error:  # the endpoint was aborted
            outcome = type(error).__name__
        finally:
            ex.release()
    return outcome, time.monotonic() - deadline


def test_waits_with_random_deadlines_end_on_time_beside_live_calls(shared_node):
    """8 threads wait on receives that never complete, each with its own random deadline (so the leader times out
    and hands over again and again), while 2 threads run pings on the same connection: every silent wait times out
    within SLACK_S of its deadline, and every ping gets its answer."""
    node = UcxNode(shared_node.address, connect_timeout_ms=5000)
    try:
        conn = _connection(node)
        rng = random.Random(16)
        results: list[tuple[str, float]] = []
        pings: list[bool] = []
        stop = threading.Event()

        def silent(seed: int) -> None:
            local = random.Random(seed)
            for _ in range(4):
                results.append(_silent_wait(conn, local.uniform(0.05, 0.6)))

        def pinger() -> None:
            while not stop.is_set():
                pings.append(node.ping(5.0))

        waiters = [threading.Thread(target=silent, args=(rng.random(),)) for _ in range(8)]
        pingers = [threading.Thread(target=pinger) for _ in range(2)]
        for th in waiters + pingers:
            th.start()
        for th in waiters:
            th.join(30)
        stop.set()
        for th in pingers:
            th.join(30)
        assert not any(th.is_alive() for th in waiters + pingers)
        assert len(results) == 32 and {outcome for outcome, _ in results} == {"timeout"}, results
        assert max(late for _, late in results) < SLACK_S, results
        assert pings and all(pings), pings.count(False)
    finally:
        node.close()


def test_an_aborted_connection_ends_its_waits_and_frees_what_was_given_up(shared_node):
    """Receives given up on stay referenced until UCX completes them; aborting the endpoint completes them (with an
    error) and the next wait forgets them. A wait on an aborted endpoint ends at once with an error, not a hang."""
    node = UcxNode(shared_node.address, connect_timeout_ms=5000)
    runtime = DirectRuntime.get()
    try:
        conn = _connection(node)
        before = {id(p) for p in runtime._graveyard}
        for _ in range(3):
            assert _silent_wait(conn, 0.05)[0] == "timeout"
        buried = [p for p in runtime._graveyard if id(p) not in before]
        assert len(buried) == 3 and not any(p.request.completed for p in buried)
        started = time.monotonic()
        done = threading.Event()
        outcome: list = []

        def blocked() -> None:
            outcome.append(_silent_wait(conn, 20.0)[0])
            done.set()

        thread = threading.Thread(target=blocked)
        thread.start()
        time.sleep(0.2)
        node._link.drop(conn, Ending.FAILED)  # aborts the endpoint: every request on it fails
        assert done.wait(10.0), "a wait on an aborted endpoint did not end"
        thread.join()
        assert outcome and outcome[0] != "timeout" and time.monotonic() - started < 10.0
        deadline = time.monotonic() + 5.0
        while any(not p.request.completed for p in buried) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(p.request.completed for p in buried)
        assert node.ping(5.0)  # a new connection, and its wait prunes the graveyard
        assert not any(any(q is p for q in runtime._graveyard) for p in buried)
    finally:
        node.close()


def test_a_call_from_a_thread_running_an_event_loop(shared_node):
    """A caller inside a running asyncio loop (its own) is served and its loop is left as it was."""
    import asyncio

    node = UcxNode(shared_node.address, connect_timeout_ms=5000)
    try:

        async def call() -> tuple[bool, asyncio.AbstractEventLoop]:
            node.connect_now(5.0)
            result = node._call(ping, 5.0)
            return result is None, asyncio.get_running_loop()

        loop = asyncio.new_event_loop()
        try:
            ok, running = loop.run_until_complete(call())
        finally:
            loop.close()
        assert ok and running is loop
        assert asyncio._get_running_loop() is None
    finally:
        node.close()


@pytest.mark.parametrize("threads", [1, 8])
def test_many_in_flight_get_their_own_answers(shared_node, threads):
    """`threads` callers on one connection, each checking a distinct stored value: every answer is the caller's own
    (request ids and tags never cross, whichever thread leads)."""
    node = UcxNode(shared_node.address, connect_timeout_ms=5000)
    try:
        made = [make_values(1, 100 + 99_997 * i, seed=i)[0] for i in range(threads)]
        values = {f"own-{threads}-{i}".encode(): joined(v) for i, v in enumerate(made)}
        assert node.put(list(values), made, 10.0) == [True] * threads
        wrong: list = []

        def check(key: bytes) -> None:
            out = np.empty(len(values[key]), np.uint8)
            for _ in range(30):
                if node.get_into([key], [out], 10.0) != [True] or bytes(out) != values[key]:
                    wrong.append(key)

        workers = [threading.Thread(target=check, args=(k,)) for k in values]
        for th in workers:
            th.start()
        for th in workers:
            th.join(60)
        assert not wrong, wrong[:3]
        assert protocol.MAX_REQUEST_ID > node._next_id > 0
    finally:
        node.close()

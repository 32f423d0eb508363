"""Slow nodes through `PoolClient` over in-process stores behind fault injection (`FaultyNode.delay_s`, `.abort`):
reads are hedged to the next owner, a write does not wait for a slow owner once every value has a copy, a hedged
read into the caller's buffers never has the slow node's late bytes land there, and slow nodes are asked last.

Timing bounds: the slow node sleeps SLOW_S (many times what a call here takes); a call that is not held up by it
must return in well under half of that, a margin no busy host comes near.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from ems_testlib import keyed
from fault_injection import FaultyNode

from ems.backends.pool_client import PoolClient
from ems.cluster.rendezvous import node_seeds, ranked_owners
from ems.store.kv_store import KvStore
from ems.store.value_format import ExpectedValues, ValueKind, build_headers, checksum
from ems.transport.inprocess import InProcessNode
from ems.types import CcKvOption

SLOW_S = 3.0
OPTION = CcKvOption(timeout=20_000, write_rcache=False)


def _values(n: int, size: int, seed: int) -> tuple[list[bytes], ExpectedValues]:
    rng = np.random.default_rng(seed)
    payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]
    expected = ExpectedValues(ValueKind.RAW_V0, 0, np.zeros(n, np.uint64), np.full(n, size, np.int64))
    headers = build_headers(expected, [checksum([p]) for p in payloads])
    return [h + p for h, p in zip(headers, payloads)], expected


def route_order(pool: PoolClient, route_key: bytes) -> list[str]:
    """Every live node, in the key's rendezvous order (its owners first)."""
    addresses = list(pool.members.view.addresses)
    return [addresses[j] for j in ranked_owners([route_key], node_seeds(addresses), len(addresses))[0].tolist()]


@pytest.fixture
def cluster():
    nodes = {f"n{i}:1": FaultyNode(InProcessNode(KvStore(64 << 20)), address=f"n{i}:1") for i in range(3)}
    pool = PoolClient(list(nodes.values()), replicas=2, connect=lambda a: nodes[a])
    yield nodes, pool
    for node in nodes.values():
        node.delay_s = 0.0
        node.release()
    pool.close()


def _keys(n: int, tag: str) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def test_a_read_is_hedged_to_the_next_owner_and_the_slow_bytes_never_land(cluster):
    nodes, pool = cluster
    keys = _keys(24, "hedge")
    values, expected = _values(len(keys), 4096, 1)
    assert all(pool.put(keyed(keys, OPTION), [[v] for v in values]).results)
    for _ in range(3):  # the latency model learns what a normal read costs
        assert all(pool.get_into(keyed(keys, OPTION, expected=expected), [np.empty(len(v), np.uint8) for v in values]).results)
    slow = route_order(pool, keys[0])[0]  # first owner of key 0: slow, and holding damaged copies
    for k in keys:
        if k in nodes[slow].store._entries:
            nodes[slow].corrupt_stored(k, "flip")
    nodes[slow].delay_s = SLOW_S
    outs = [np.zeros(len(v), np.uint8) for v in values]
    start = time.monotonic()
    outcome = pool.get_into(keyed(keys, OPTION, expected=expected), outs)
    elapsed = time.monotonic() - start
    assert all(outcome.results) and elapsed < SLOW_S / 2, (elapsed, outcome.errors)
    assert any("slow" in e.message() for e in outcome.errors)  # reported: the caller retires its buffers
    assert nodes[slow].aborted >= 1
    time.sleep(SLOW_S + 0.5)  # had the slow request not been stopped, its (damaged) bytes would land now
    for out, v in zip(outs, values):
        assert out.tobytes() == v


@pytest.mark.parametrize("op", ["get", "exists"])
def test_get_and_exists_are_hedged(cluster, op):
    nodes, pool = cluster
    keys = _keys(16, op)
    values, expected = _values(len(keys), 1024, 2)
    assert all(pool.put(keyed(keys, OPTION), [[v] for v in values]).results)
    slow = route_order(pool, keys[0])[0]
    nodes[slow].delay_s = SLOW_S
    start = time.monotonic()
    if op == "get":
        got = pool.get(keyed(keys, OPTION, expected=expected)).results
        assert [bytes(g) for g in got] == values
    else:
        assert all(pool.exists(keyed(keys, OPTION)).results)
    assert time.monotonic() - start < SLOW_S / 2


def test_a_write_does_not_wait_for_a_slow_owner(cluster):
    nodes, pool = cluster
    keys = _keys(12, "write")
    values, _ = _values(len(keys), 2048, 3)
    slow = route_order(pool, keys[0])[0]
    nodes[slow].delay_s = SLOW_S
    start = time.monotonic()
    outcome = pool.put(keyed(keys, OPTION), [[v] for v in values])
    assert all(outcome.results) and time.monotonic() - start < SLOW_S / 2, outcome.errors
    assert any(slow in e.message() and "slow" in e.message() for e in outcome.errors)
    nodes[slow].delay_s = 0.0
    for k, v in zip(keys, values):  # every value has a copy on an owner that is not the slow one
        held = [a for a in route_order(pool, k)[:2] if a != slow and k in nodes[a].store._entries]
        assert held and bytes(nodes[held[0]].store.get(k)) == v


def test_with_one_replica_there_is_no_hedge_and_the_slow_node_sets_the_time(cluster):
    nodes, _ = cluster
    pool = PoolClient(list(nodes.values()), replicas=1)
    try:
        keys = _keys(4, "single")
        values, expected = _values(len(keys), 512, 4)
        assert all(pool.put(keyed(keys, OPTION), [[v] for v in values]).results)
        slow = route_order(pool, keys[0])[0]
        nodes[slow].delay_s = 0.5
        start = time.monotonic()
        assert pool.get_into(keyed(keys, OPTION, expected=expected), [np.empty(len(v), np.uint8) for v in values]).results[0]
        assert time.monotonic() - start >= 0.5  # nothing else holds it: the read waits for its one owner
        assert nodes[slow].aborted == 0
    finally:
        pool.close()


def test_a_slow_node_is_asked_last(cluster):
    nodes, pool = cluster
    keys = _keys(32, "last")
    values, expected = _values(len(keys), 256, 5)
    assert all(pool.put(keyed(keys, OPTION), [[v] for v in values]).results)
    for _ in range(3):
        pool.get(keyed(keys, OPTION, expected=expected))
    slow = route_order(pool, keys[0])[0]
    nodes[slow].delay_s = 0.3
    pool.get(keyed(keys, OPTION, expected=expected))  # hedged: the slow node's answers mark it slow
    deadline = time.monotonic() + 10
    while not pool.router.latency.slow(slow) and time.monotonic() < deadline:
        pool.get(keyed(keys, OPTION, expected=expected))
    assert pool.router.latency.slow(slow)
    before = nodes[slow].calls["get"]
    got = pool.get(keyed(keys, OPTION, expected=expected)).results
    assert [bytes(g) for g in got] == values
    assert nodes[slow].calls["get"] == before  # every key had another owner: the slow one was not asked


@pytest.mark.parametrize("op", ["get", "get_into", "exists"])
def test_a_partitioned_first_owner_does_not_take_the_call_from_the_live_copy(cluster, op):
    """One block per call whose first owner is cut off (its calls wait out their deadline: a transport that bounds its
    calls itself, run on the calling thread): the block is read from its other owner within the call's timeout
    (it used to wait out the whole timeout on the cut node and miss)."""
    nodes, pool = cluster
    for node in nodes.values():
        node.self_timed = True  # as UcxNode: the read runs small calls on the calling thread
    keys = _keys(12, f"cut-{op}")
    values, expected = _values(len(keys), 1024, 6)
    assert all(pool.put(keyed(keys, OPTION), [[v] for v in values]).results)
    cut = route_order(pool, keys[0])[0]
    nodes[cut].partitioned = True
    option = CcKvOption(timeout=2_000, write_rcache=False)
    theirs = [i for i, k in enumerate(keys) if route_order(pool, k)[0] == cut]
    assert theirs
    for i in theirs:  # the first call after the cut, and the ones after it
        if op == "get":
            got = pool.get(keyed([keys[i]], option, expected=expected.range(i, i + 1))).results[0]
            assert got is not None and bytes(got) == values[i]
        elif op == "get_into":
            out = np.empty(len(values[i]), np.uint8)
            assert pool.get_into(keyed([keys[i]], option, expected=expected.range(i, i + 1)), [out]).results[0]
            assert out.tobytes() == values[i]
        else:
            assert pool.exists(keyed([keys[i]], option)).results[0]
    nodes[cut].partitioned = False


def _read_one(pool: PoolClient, op: str, key: bytes, value: bytes, expected: ExpectedValues, option: CcKvOption) -> bool:
    """One key by `op`: True when it came back (byte-exact for get and get_into)."""
    if op == "get":
        got = pool.get(keyed([key], option, expected=expected)).results[0]
        return got is not None and bytes(got) == value
    if op == "get_into":
        out = np.empty(len(value), np.uint8)
        return bool(pool.get_into(keyed([key], option, expected=expected), [out]).results[0]) and out.tobytes() == value
    return bool(pool.exists(keyed([key], option)).results[0])


@pytest.mark.parametrize("op", ["get", "get_into", "exists"])
def test_a_slow_owner_holding_the_only_copy_is_still_a_hit(cluster, op):
    """A first owner that answers late (a busy host: later than any abort delay, well within the call's timeout),
    holding the only copy (the other owner lost it): waited for, a hit. (A small read used to get only the abort
    delay from it, then count it failed: the key missed although its node answered.)"""
    nodes, pool = cluster
    for node in nodes.values():
        node.self_timed = True  # as UcxNode: small reads may run on the calling thread
    keys = _keys(8, f"late-{op}")
    values, expected = _values(len(keys), 1024, 7)
    for i, key in enumerate(keys):
        first, second = route_order(pool, key)[:2]
        nodes[first].put([key], [[values[i]]], 5.0)  # the first owner only
        assert nodes[second].get([key], 5.0) == [None]
    slow = route_order(pool, keys[0])[0]
    theirs = [i for i, k in enumerate(keys) if route_order(pool, k)[0] == slow]
    nodes[slow].delay_s = 0.4  # many abort delays (>= 50 ms), a fifth of the timeout
    option = CcKvOption(timeout=2_000, write_rcache=False)
    for i in theirs:
        assert _read_one(pool, op, keys[i], values[i], expected.range(i, i + 1), option), i


@pytest.mark.parametrize("op", ["get", "get_into", "exists"])
def test_a_hedge_whose_node_fails_goes_on_to_the_next_node(cluster, op):
    """First owner cut off, second owner failing at once, the copy on the node after them (where repair or a
    membership change left it): the hedge that failed is followed by one to that node, within the timeout."""
    nodes, pool = cluster
    for node in nodes.values():
        node.self_timed = True
    keys = _keys(12, f"onward-{op}")
    values, expected = _values(len(keys), 1024, 8)
    cut, failing, holder = route_order(pool, keys[0])
    theirs = [i for i, k in enumerate(keys) if route_order(pool, k) == [cut, failing, holder]]
    for i in theirs:
        nodes[cut].put([keys[i]], [[values[i]]], 5.0)
        nodes[holder].put([keys[i]], [[values[i]]], 5.0)
    nodes[cut].partitioned = True
    nodes[failing].fail = True
    option = CcKvOption(timeout=2_000, write_rcache=False)
    try:
        for i in theirs:
            start = time.monotonic()
            assert _read_one(pool, op, keys[i], values[i], expected.range(i, i + 1), option), i
            assert time.monotonic() - start < 1.5  # not the whole timeout on the cut node
    finally:
        nodes[cut].partitioned = False
        nodes[failing].fail = False

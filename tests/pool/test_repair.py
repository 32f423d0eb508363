"""A node's repair (`ems.pool.repair.Repairer`) over in-process stores, one per node, reached as each key's tenant
(what a node's store holds: `tenant_prefix(tenant) + key`): after a leave, a join and a node back empty, every key is
held by all its live owners as clients place it; only the highest-ranked holder copies; a damaged value is never
stored; tenants stay apart; a pass stops when membership changes under it; a random sequence of changes ends with
the model's placement. (Across real hosts: tests/pool/test_hosts_cluster.py.)
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest
from pool_testlib import make_values, wait_until

from ems.cluster.rendezvous import node_seeds, ranked_by_hash, ranked_owners, route_hashes
from ems.datapath.keys import FORM_TOKENS, chain_keys, route_key_of, v0_keys, v1_keys
from ems.errors import EmsErrorCode
from ems.pool.node_store import split_tenant, tenant_prefix
from ems.pool.repair import Repairer
from ems.pool.repair_plan import RepairSettings, asked, copy_plan
from ems.store.kv_store import KvStore
from ems.transport.base import NodeClient, TransportError
from ems.types import PrimaryKey

NS = bytes(range(16))


class TenantClient(NodeClient):
    """A node's store as one tenant sees it over the wire (keys namespaced as the server does), with faults."""

    def __init__(self, net: Net, address: str, tenant: str) -> None:
        self.net, self.address, self.prefix = net, address, tenant_prefix(tenant)

    def _store(self) -> KvStore:
        if self.address in self.net.down:
            raise TransportError(EmsErrorCode.EMS_IO_ERROR, f"{self.address}: down")
        return self.net.stores[self.address]

    def put(self, keys, values, deadline):
        self.net.puts[self.address] += len(keys)
        return self._store().put_many([self.prefix + k for k in keys], values)

    def get(self, keys, deadline):
        return self._store().get_many([self.prefix + k for k in keys])

    def exists(self, keys, deadline):
        self.net.exists[self.address] += len(keys)
        return self._store().contains_many([self.prefix + k for k in keys])

    def ping(self, deadline):
        return self.address not in self.net.down


class Net:
    def __init__(self, addresses: Sequence[str]) -> None:
        self.stores = {a: KvStore(64 << 20) for a in addresses}
        self.down: set[str] = set()
        self.puts = dict.fromkeys(addresses, 0)
        self.exists = dict.fromkeys(addresses, 0)

    def connect(self, address: str, tenant: str) -> NodeClient:
        return TenantClient(self, address, tenant)

    def repairer(self, address: str, replicas: int, keys: dict | None = None) -> Repairer:
        return Repairer(self.stores[address], address, RepairSettings(replicas, rate=0), self.connect, keys)

    def add(self, address: str) -> None:
        self.stores[address] = KvStore(64 << 20)
        self.puts[address] = self.exists[address] = 0


def owners(route_key: bytes, live: Sequence[str], k: int) -> list[str]:
    addresses = sorted(live)
    return [addresses[j] for j in ranked_owners([route_key], node_seeds(addresses), min(k, len(addresses)))[0].tolist()]


def save(net: Net, live: Sequence[str], k: int, tenant: str, keys: Sequence[bytes], values: Sequence) -> None:
    """Store each value at its k owners, as a client does."""
    for key, value in zip(keys, values):
        for address in owners(route_key_of(key), live, k):
            assert net.stores[address].put(tenant_prefix(tenant) + key, value)


def run_passes(net: Net, live: Sequence[str], k: int, holders: Sequence[str] | None = None, keys: dict | None = None) -> None:
    members = {a: "same" for a in live}
    for address in holders if holders is not None else sorted(net.stores):
        if address in net.down:
            continue
        repairer = net.repairer(address, k, keys)
        repairer._pass(members, repairer._generation)
        repairer.close()


def held_by(net: Net, tenant: str, key: bytes) -> set[str]:
    return {a for a, s in net.stores.items() if a not in net.down and s.contains_many([tenant_prefix(tenant) + key])[0]}


def hold(net: Net, node: str, tenant: str, keys: Sequence[bytes], values: Sequence) -> None:
    """`node` holds the tenant's values directly (as if saved there alone)."""
    for key, value in zip(keys, values):
        net.stores[node].put(tenant_prefix(tenant) + key, value)


def block_keys(n: int, base: int = 0) -> list[bytes]:
    return v1_keys(NS, list(range(base, base + n)))[0]


def test_route_key_of_inverts_every_key_form():
    hashes = [0, 1, -5, 2**255, 2**256 - 1, -(2**255)]
    keys, routes = v1_keys(NS, hashes)
    assert [route_key_of(k) for k in keys] == routes
    keys, routes = v1_keys(NS, hashes, FORM_TOKENS)  # the token form's blocks route as block hashes do
    assert [route_key_of(k) for k in keys] == routes
    v0 = [PrimaryKey("dk", "ak"), PrimaryKey("d", "x"), PrimaryKey("d" * 100, "a"), "plain-str"]
    keys, routes = v0_keys(NS, v0)
    assert [route_key_of(k) for k in keys] == routes
    for odd in (b"", b"short", NS + b"\x07rest", NS + b"\x00\xff\xffab"):  # unknown: routes by itself
        assert route_key_of(odd) == odd


def test_split_tenant_inverts_the_prefix():
    for tenant in ("", "a", "cc_kvstore@_@ns_001", "x" * 512):
        assert split_tenant(tenant_prefix(tenant) + b"key") == (tenant, b"key")
    assert split_tenant(b"\x05\x00ab") is None and split_tenant(b"") is None


def test_plan_only_the_highest_ranked_holder_copies_to_owners_lacking_it():
    ranks = np.array([[0, 1, 2, 3], [2, 0, 1, 3], [3, 1, 0, 2]])
    me = 0
    assert asked(ranks, me, 2).tolist() == [
        [False, True, False, False],  # owner itself: asks the other owner
        [True, False, False, False],  # second owner: asks the one above
        [True, True, False, False],  # not an owner: asks both above it (the owners)
    ]
    held = ranks == me
    held[1, 0] = True  # node 2 (ranked above) holds key 1: it copies, not us
    mine, targets = copy_plan(ranks, me, 2, held)
    assert mine.tolist() == [True, False, True]
    assert targets.tolist() == [[False, True, False, False], [False] * 4, [True, True, False, False]]
    mine, targets = copy_plan(ranks, -1, 2, np.zeros_like(held))  # not a member: copies all to the owners
    assert mine.all() and targets[:, :2].all() and not targets[:, 2:].any()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_leave_join_and_a_node_back_empty(k):
    nodes = ["10.0.0.1:7700", "10.0.0.2:7700", "10.0.0.3:7700", "10.0.0.4:7700"]
    net = Net(nodes)
    keys = block_keys(200)
    values = make_values(len(keys), 512, seed=k)
    save(net, nodes, k, "t", keys, values)
    # a node leaves (killed: its store is gone)
    gone = nodes[1]
    net.down.add(gone)
    live = [a for a in nodes if a != gone]
    run_passes(net, live, k)
    lost = [key for key in keys if not held_by(net, "t", key)]
    assert (len(lost) > 0) == (k == 1)  # one copy: what only it held is lost; more: nothing is
    for key in keys:
        if key not in lost:
            assert set(owners(route_key_of(key), live, k)) <= held_by(net, "t", key), key
    # a node joins: it receives the keys it now owns
    net.add("10.0.0.5:7700")
    live.append("10.0.0.5:7700")
    run_passes(net, live, k)
    moved = [key for key in keys if key not in lost and "10.0.0.5:7700" in owners(route_key_of(key), live, k)]
    assert moved and all("10.0.0.5:7700" in held_by(net, "t", key) for key in moved)
    # a node comes back empty (same address)
    back = live[0]
    net.stores[back].clear()
    lost = [key for key in keys if not held_by(net, "t", key)]  # with one copy, what it alone held
    run_passes(net, live, k)
    for key in keys:
        if key not in lost:
            assert set(owners(route_key_of(key), live, k)) <= held_by(net, "t", key)
    # every stored copy is the value that was saved, never anything else
    for store in net.stores.values():
        for stored in store.keys():  # noqa: SIM118 - KvStore.keys(), a snapshot
            _, key = split_tenant(stored)
            assert bytes(store.get(stored)) == b"".join(values[keys.index(key)])


def test_only_the_first_holder_copies():
    nodes = [f"10.0.0.{i}:7700" for i in range(1, 6)]
    net = Net(nodes)
    keys = block_keys(100)
    values = make_values(len(keys), 256, seed=1)
    for key, value in zip(keys, values):  # every node holds every key
        for a in nodes:
            net.stores[a].put(tenant_prefix("t") + key, value)
    net.stores[nodes[0]].clear()  # node 0 lost everything: one copy of each key it owns is missing
    run_passes(net, nodes, 3)
    wanted = sum(nodes[0] in owners(route_key_of(k), nodes, 3) for k in keys)
    assert net.puts[nodes[0]] == wanted  # each missing copy sent once, by one holder
    assert sum(net.puts.values()) == wanted


def test_a_damaged_value_is_refused_by_its_new_owner():
    nodes = ["a:1", "b:1", "c:1"]
    net = Net(nodes)
    keys = block_keys(30)
    values = make_values(len(keys), 256, seed=2)
    save(net, nodes, 2, "t", keys, values)
    victim = keys[0]
    holders = sorted(held_by(net, "t", victim))
    survivor = holders[0]
    net.down.add(holders[1])
    store = net.stores[survivor]
    with store._lock:  # damage the survivor's copy behind the store's back (a bad DIMM)
        entry = bytearray(store._entries[tenant_prefix("t") + victim])
        entry[-1] ^= 0xFF
        store._entries[tenant_prefix("t") + victim] = bytes(entry)
    live = [a for a in nodes if a != holders[1]]
    repairer = net.repairer(survivor, 2)
    repairer._pass({a: 1 for a in live}, repairer._generation)
    new_owner = next(a for a in owners(route_key_of(victim), live, 2) if a != survivor)
    assert not net.stores[new_owner].contains_many([tenant_prefix("t") + victim])[0]
    assert repairer.progress().failed_copies >= 1


def test_tenants_stay_apart_and_a_tenant_without_a_key_is_not_copied():
    nodes = ["a:1", "b:1"]
    net = Net(nodes)
    keys = block_keys(20)
    values = make_values(len(keys), 128, seed=3)
    for tenant in ("alice", "bob"):
        hold(net, "a:1", tenant, keys, values)
    run_passes(net, nodes, 2, holders=["a:1"], keys={"alice": "A" * 40})  # the node's keys know alice only
    for key in keys:
        assert held_by(net, "alice", key) == {"a:1", "b:1"}
        assert held_by(net, "bob", key) == {"a:1"}


def test_the_thread_repairs_after_a_change_and_reports_progress():
    nodes = ["a:1", "b:1", "c:1"]
    net = Net(nodes)
    keys = block_keys(64)
    values = make_values(len(keys), 1024, seed=4)
    save(net, ["a:1", "b:1"], 2, "t", keys, values)  # c joins later
    repairers = {
        a: Repairer(net.stores[a], a, RepairSettings(2, rate=1 << 30, interval_s=3600, settle_s=0.05), net.connect) for a in nodes
    }
    try:
        for r in repairers.values():
            r.start()
            r.on_members({"a:1": 1, "b:1": 1})
        for r in repairers.values():
            r.on_members({"a:1": 1, "b:1": 1, "c:1": 1})
        deadline = time.monotonic() + 20
        due = [k for k in keys if "c:1" in owners(route_key_of(k), nodes, 2)]
        while time.monotonic() < deadline and not all("c:1" in held_by(net, "t", k) for k in due):
            time.sleep(0.05)
        assert due and all("c:1" in held_by(net, "t", k) for k in due)
        progress = [r.progress() for r in repairers.values()]
        assert sum(p.copied_values for p in progress) == len(due)
        assert sum(p.copied_bytes for p in progress) == sum(len(b"".join(values[keys.index(k)])) for k in due)
        assert all(p.passes >= 1 and not p.running and p.pending_keys == 0 for p in progress)
    finally:
        for r in repairers.values():
            r.close()


def test_a_pass_stops_when_membership_changes_under_it():
    nodes = ["a:1", "b:1"]
    net = Net(nodes)
    keys = block_keys(3000)
    values = make_values(len(keys), 64, seed=5)
    hold(net, "a:1", "t", keys, values)
    repairer = net.repairer("a:1", 2)
    changed = threading.Event()
    original = TenantClient.put

    def put_then_change(self, keys, values, deadline):
        if not changed.is_set():
            changed.set()
            repairer.on_members({"a:1": 1})  # b leaves while the first copies are on their way
        return original(self, keys, values, deadline)

    TenantClient.put = put_then_change  # type: ignore[method-assign]
    try:
        with pytest.raises(Exception) as info:
            repairer._pass({"a:1": 1, "b:1": 1}, repairer._generation)
        assert type(info.value).__name__ == "_Changed"
        assert net.puts["b:1"] < len(keys)  # it stopped before copying everything
    finally:
        TenantClient.put = original  # type: ignore[method-assign]
        repairer.close()


@pytest.mark.parametrize("seed", range(4))
def test_random_membership_changes_end_in_the_model_placement(seed):
    rng = random.Random(seed)
    pool = [f"n{i}:1" for i in range(7)]
    net = Net(pool)
    live = sorted(rng.sample(pool, 4))
    k = rng.randint(1, 3)
    keys = block_keys(150, base=seed * 1000)
    values = make_values(len(keys), 200, seed=seed)
    save(net, live, k, "t", keys, values)
    for _ in range(6):
        action = rng.choice(["leave", "join", "wipe", "kill"])
        if action == "leave" and len(live) > 2:
            live.remove(rng.choice(live))  # drained: its store stays, it is no member (it still copies out)
        elif action == "join":
            out = [a for a in pool if a not in live]
            if out:
                live.append(rng.choice(out))
                net.down.discard(live[-1])
        elif action == "wipe":
            net.stores[rng.choice(live)].clear()
        elif action == "kill" and len(live) > 2:
            victim = rng.choice(live)
            live.remove(victim)
            net.down.add(victim)
            net.stores[victim].clear()
        live.sort()
        before = {key: held_by(net, "t", key) for key in keys}
        run_passes(net, live, k)
        for key in keys:
            if before[key]:  # someone still held it: every live owner does now
                assert set(owners(route_key_of(key), live, k)) <= held_by(net, "t", key), (action, key)


def test_a_peer_that_fails_fails_only_its_copies():
    nodes = ["a:1", "b:1", "c:1"]
    net = Net(nodes)
    keys = block_keys(60)
    values = make_values(len(keys), 128, seed=6)
    hold(net, "a:1", "t", keys, values)
    net.down.add("b:1")
    repairer = net.repairer("a:1", 3)
    repairer._pass({a: 1 for a in nodes}, repairer._generation)
    assert all(held_by(net, "t", k) == {"a:1", "c:1"} for k in keys)


def test_an_incomplete_pass_is_retried_within_seconds_not_at_the_interval():
    """A pass that cannot reach an owner (its connection not back yet after a restart or a partition) reports itself
    incomplete and runs again RETRY_S later, doubling, without waiting for a membership change or the interval."""
    from ems.pool.repair import RETRY_S

    nodes = ["a:1", "b:1"]
    net = Net(nodes)
    keys = block_keys(40)
    values = make_values(len(keys), 256, seed=8)
    hold(net, "a:1", "t", keys, values)
    net.down.add("b:1")
    repairer = Repairer(net.stores["a:1"], "a:1", RepairSettings(2, rate=1 << 30, interval_s=3600, settle_s=0.01), net.connect)
    try:
        repairer.start()
        repairer.on_members({a: 1 for a in nodes})
        assert wait_until(lambda: repairer.progress().passes >= 2, 5 * RETRY_S, step_s=0.02)  # retried, the interval is an hour
        p = repairer.progress()
        assert p.incomplete and not p.running and p.copied_values == 0
        net.down.discard("b:1")  # b answers again; membership never changed
        assert wait_until(lambda: all(held_by(net, "t", k) == {"a:1", "b:1"} for k in keys), 10 * RETRY_S, step_s=0.02)
        assert wait_until(lambda: not repairer.progress().incomplete, 5, step_s=0.02)
        assert repairer.progress().copied_values == len(keys)
    finally:
        repairer.close()


def test_metrics_and_status_show_repair_progress():
    pytest.importorskip("prometheus_client")
    from ems.pool.metrics import NodeMetrics
    from ems.pool.repair_plan import RepairProgress
    from ems.pool.status import NodeStatus, parse_metrics, render

    progress = RepairProgress(running=True, pending_keys=120, copied_values=64, copied_bytes=64 << 20, passes=2)
    metrics = NodeMetrics(KvStore(1 << 20))
    metrics.watch_repair(lambda: progress)
    sample = parse_metrics(metrics.exposition().decode())
    assert (sample.repair_running, sample.repair_pending, sample.repair_copied) == (1.0, 120.0, 64.0)
    idle = parse_metrics(NodeMetrics(KvStore(1 << 20)).exposition().decode())
    assert idle.repair_running is None  # a node that does not repair
    table = render([NodeStatus("a:1", "m:1", "up", sample), NodeStatus("b:1", "m:2", "up", idle)]).splitlines()
    assert table[0].split()[-2:] == ["REPAIR", "COPIED"]
    assert table[1].split()[-2:] == ["120-left", "64"] and table[2].split()[-2:] == ["-", "-"]
    progress.running, progress.pending_keys = False, 0
    again = parse_metrics(metrics.exposition().decode())
    assert render([NodeStatus("a:1", "m:1", "up", again)]).splitlines()[1].split()[-2:] == ["idle", "64"]
    progress.incomplete = True  # the last pass could not reach a peer: another follows
    behind = parse_metrics(metrics.exposition().decode())
    assert render([NodeStatus("a:1", "m:1", "up", behind)]).splitlines()[1].split()[-2:] == ["retry", "64"]


def test_repair_pacing_bounds_a_burst_to_100_ms_of_its_rate():
    """The bucket lets at most 100 ms of the rate (at least 64 KiB, at most a batch) through at once, so a slow
    --repair-rate is a bound from the first byte: 2 MiB at 8 MiB/s takes at least (2 MiB - burst) / rate."""
    from ems.pool.repair_plan import BATCH_BYTES, TokenBucket, burst_bytes

    assert burst_bytes(256 << 10) == 64 << 10 and burst_bytes(64 << 20) == (64 << 20) // 10
    assert burst_bytes(1 << 40) == BATCH_BYTES
    rate = 8 << 20
    bucket = TokenBucket(rate, burst_bytes(rate))
    start = time.monotonic()
    for _ in range(32):
        assert bucket.spend(64 << 10, lambda: False, time.sleep)
    took = time.monotonic() - start
    assert took >= ((2 << 20) - burst_bytes(rate)) / rate * 0.95, took


def test_a_hot_units_read_copies_are_left_alone_and_refill_an_owner_that_lost_them():
    """A hot unit's read copies (`ems.backends.hot_reads`) sit on nodes of a copy group, not its owners: repair on a
    copy node keeps them (never deletes), copies nothing while the owners hold the values, and re-places a value to
    an owner that lost it (a cache value put back where clients place it)."""
    nodes = [f"10.0.1.{i}:7700" for i in range(16)]
    net = Net(nodes)
    hashes = [(7 << 90) + 3 * b for b in range(48)]
    keys, routes, units = chain_keys(NS, hashes, [])
    values = make_values(len(keys), 256, seed=6)
    seeds = node_seeds(sorted(nodes))
    owner = ranked_owners(routes, seeds, 1, units)[:, 0]
    copy = ranked_by_hash(route_hashes(routes), seeds, 1, units, copy=np.ones(len(keys), dtype=np.int64))[:, 0]
    assert not (owner == copy).any()
    for i, key in enumerate(keys):
        hold(net, sorted(nodes)[owner[i]], "t", [key], [values[i]])
        hold(net, sorted(nodes)[copy[i]], "t", [key], [values[i]])
    run_passes(net, nodes, 1)
    assert sum(net.puts.values()) == 0  # the owners hold every value: nothing to copy
    assert all(held_by(net, "t", key) == {sorted(nodes)[owner[i]], sorted(nodes)[copy[i]]} for i, key in enumerate(keys))
    lost = sorted(nodes)[owner[0]]
    net.stores[lost].clear()  # an owner restarted empty: its values are left only on the copy nodes
    run_passes(net, nodes, 1)
    for i, key in enumerate(keys):
        assert held_by(net, "t", key) == {sorted(nodes)[owner[i]], sorted(nodes)[copy[i]]}
    refilled = [i for i in range(len(keys)) if owner[i] == owner[0]]
    assert net.puts[lost] == len(refilled) == sum(net.puts.values())  # one copy each, from the copy node
    for i in refilled:
        assert bytes(net.stores[lost].get(tenant_prefix("t") + keys[i])) == b"".join(values[i])

"""Replication (`pool_replicas`) and a changing node set, through `ContextCaching` over real in-process stores.

A long random sequence of saves, loads, node failures, damaged copies, wiped nodes and membership changes is checked
against a model of where good copies are: a load is a hit exactly when one of the first k live owners (rank order,
failed nodes skipped) holds a good copy, k being the replicas plus the nodes that joined in the rebalancing window
(`Members.fallback`; a run with the window at 0 checks the replicas alone), and a loaded block is always
byte-exact; nothing else is ever written.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from ems_testlib import make_cache, poison, slots_of_blocks, snapshot, tensors
from fault_injection import FaultyNode

from ems import CcConfig, CcKvOption, ContextCaching, EmsConfig
from ems.backends.base import ReadCheck
from ems.backends.pool_client import PoolClient
from ems.cluster import placement
from ems.cluster.rendezvous import node_seeds, ranked_owners
from ems.datapath.keys import v1_keys
from ems.settings import resolve_settings
from ems.store.kv_store import KvStore
from ems.transport.inprocess import InProcessNode

BS = 4


def _cluster(n_nodes: int, replicas: int):
    nodes = {f"n{i}:1": FaultyNode(InProcessNode(KvStore(64 << 20)), address=f"n{i}:1") for i in range(n_nodes)}
    pool = PoolClient(list(nodes.values()), replicas=replicas, connect=lambda address: nodes[address])
    settings = resolve_settings(EmsConfig(pool_replicas=replicas))
    cc = ContextCaching(CcConfig(rank_id=0, device_id=0, model_id="repl"), None, pool, settings)
    return nodes, pool, cc


def _ranks(cc: ContextCaching, pool: PoolClient, block_hash: int) -> list[str]:
    """Every live node, in the block's rendezvous order."""
    _, routes = v1_keys(cc._v1_namespace, [block_hash])
    addresses = list(pool.members.view.addresses)
    order = ranked_owners(routes, node_seeds(addresses), len(addresses))[0]
    return [addresses[j] for j in order.tolist()]


def _load_one(cc, cache, original, block: int, block_hash: int) -> bool:
    """Load one block into a poisoned cache; assert it is exact (hit) or untouched (miss); return hit."""
    poisoned = poison(cache)
    r = cc.load(slots_of_blocks([block], BS), [block_hash], [BS], CcKvOption(timeout=2000))
    rows = torch.arange(BS)
    for t, o, p in zip(tensors(cache), original, poisoned):
        want = o if r.success else p
        assert torch.equal(t[block, rows].view(torch.uint8), want[block, rows].view(torch.uint8)), (block, r)
        others = torch.ones(t.shape[0], dtype=torch.bool)
        others[block] = False
        assert torch.equal(t[others].view(torch.uint8), p[others].view(torch.uint8))
    return bool(r.success)


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("rebalance_s", [0.0, placement.REBALANCE_S])
def test_random_sequence_matches_the_copy_model(replicas, seed, rebalance_s, monkeypatch):
    monkeypatch.setattr(placement, "REBALANCE_S", rebalance_s)
    rng = random.Random(seed * 10 + replicas)
    nodes, pool, cc = _cluster(5, replicas)
    try:
        torch.manual_seed(seed)
        cache = make_cache(layers=2, blocks=12, block_size=BS, heads=2, head_size=8)
        cc.register_kvcache(cache)
        good: dict[int, set[str]] = {}  # block → nodes holding a good copy (a hash's content never changes)
        original = snapshot(cache)
        loads = 0
        for _ in range(160):
            action = rng.choice(["save", "save", "load", "load", "fail", "heal", "damage", "wipe", "members"])
            block = rng.randrange(12)
            h = 7000 + block
            if action == "save":
                owners = _ranks(cc, pool, h)[:replicas]
                up = [a for a in owners if not nodes[a].fail]
                r = cc.save(slots_of_blocks([block], BS), [h], [BS], CcKvOption(timeout=2000)) if up else None
                if r is None:
                    continue
                assert r.success == 1, (owners, up)
                good[block] = good.get(block, set()) | set(up)
            elif action == "load":
                ranks = [a for a in _ranks(cc, pool, h) if not nodes[a].fail]
                tries = replicas + pool.members.fallback()  # joins in the window: their keys' old owners too
                expect_hit = bool(set(ranks[:tries]) & good.get(block, set()))
                if not ranks:
                    continue
                assert _load_one(cc, cache, original, block, h) == expect_hit, (block, ranks, good.get(block))
                loads += 1
                for t, s in zip(tensors(cache), original):  # the engine's blocks again, for later saves
                    t.copy_(s)
            elif action == "fail":
                failing = [a for a in nodes if nodes[a].fail]
                if len(failing) < 2:
                    nodes[rng.choice(list(nodes))].fail = True
            elif action == "heal":
                for node in nodes.values():
                    node.fail = False
            elif action == "damage":
                holders = sorted(good.get(block, set()))
                if holders:
                    victim = rng.choice(holders)
                    key = v1_keys(cc._v1_namespace, [h])[0][0]
                    if key in nodes[victim].store._entries:
                        nodes[victim].corrupt_stored(key, rng.choice(["flip", "header", "truncate"]))
                        good[block].discard(victim)
            elif action == "wipe":
                victim = rng.choice(list(nodes))
                nodes[victim].store.clear()
                for holders in good.values():
                    holders.discard(victim)
            elif action == "members":
                members = rng.sample(sorted(nodes), rng.randint(2, 5))
                pool.set_members(members)
        assert loads > 20
    finally:
        cc.close()
        pool.close()


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_sequence_with_slow_nodes_never_serves_a_wrong_block(replicas, seed):
    """The copy model with slow nodes (`delay_s`): a slow node's requests may be hedged around and stopped, so what
    it holds and whether it is asked are uncertain; a load must hit when a fast node it certainly asks holds a good
    copy, must miss when no node it may ask holds one, and is byte-exact (or untouched) either way."""
    rng = random.Random(100 + seed * 10 + replicas)
    nodes, pool, cc = _cluster(5, replicas)
    try:
        torch.manual_seed(seed)
        cache = make_cache(layers=2, blocks=12, block_size=BS, heads=2, head_size=8)
        cc.register_kvcache(cache)
        original = snapshot(cache)
        good: dict[int, set[str]] = {}  # certainly holding a good copy
        maybe: dict[int, set[str]] = {}  # a slow owner a save may or may not have reached
        loads = 0
        for _ in range(100):
            action = rng.choice(["save", "save", "load", "load", "load", "slow", "fast", "fail", "heal", "damage"])
            block = rng.randrange(12)
            h = 9000 + block
            slow = {a for a, n in nodes.items() if n.delay_s}
            if action == "save":
                owners = _ranks(cc, pool, h)[:replicas]
                up = [a for a in owners if not nodes[a].fail]
                if not up:
                    continue
                r = cc.save(slots_of_blocks([block], BS), [h], [BS], CcKvOption(timeout=5000))
                if set(up) <= slow:
                    assert r.success in (0, 1)
                else:
                    assert r.success == 1, (owners, up)
                good[block] = good.get(block, set()) | (set(up) - slow)
                maybe[block] = maybe.get(block, set()) | (set(up) & slow)
            elif action == "load":
                ranks = [a for a in _ranks(cc, pool, h) if not nodes[a].fail]
                if not ranks:
                    continue
                fast_ranks = [a for a in ranks if a not in slow]
                certain = set(ranks[:replicas]) - slow  # asked whatever the slow nodes do
                possible = set(ranks[:replicas]) | set(fast_ranks[:replicas])
                held = good.get(block, set())
                hit = _load_one(cc, cache, original, block, h)  # exact or untouched, checked inside
                if certain & held:
                    assert hit, (block, ranks, held, slow)
                if not possible & (held | maybe.get(block, set())):
                    assert not hit, (block, ranks, held, slow)
                loads += 1
                for t, o in zip(tensors(cache), original):
                    t.copy_(o)
            elif action == "slow" and len(slow) < 2:
                nodes[rng.choice(list(nodes))].delay_s = 0.15
            elif action == "fast":
                for node in nodes.values():
                    node.delay_s = 0.0
            elif action == "fail":
                if sum(n.fail for n in nodes.values()) < 1:
                    nodes[rng.choice(list(nodes))].fail = True
            elif action == "heal":
                for node in nodes.values():
                    node.fail = False
            elif action == "damage":
                holders = sorted(good.get(block, set()) | maybe.get(block, set()))
                if holders:
                    victim = rng.choice(holders)
                    key = v1_keys(cc._v1_namespace, [h])[0][0]
                    if key in nodes[victim].store._entries:
                        nodes[victim].corrupt_stored(key, rng.choice(["flip", "header", "truncate"]))
                    good.get(block, set()).discard(victim)
                    maybe.get(block, set()).discard(victim)
        assert loads > 15
    finally:
        for node in nodes.values():
            node.delay_s = 0.0
        cc.close()
        pool.close()


def test_save_with_a_failed_owner_counts_the_block_stored_and_load_falls_back():
    nodes, pool, cc = _cluster(3, 2)
    try:
        cache = make_cache(layers=1, blocks=8, block_size=BS, heads=1, head_size=8)
        original = snapshot(cache)
        cc.register_kvcache(cache)
        hashes = [100 + b for b in range(8)]
        first = {h: _ranks(cc, pool, h)[0] for h in hashes}
        victim = max(set(first.values()), key=list(first.values()).count)
        nodes[victim].fail = True
        r = cc.save(slots_of_blocks(range(8), BS), hashes, [BS] * 8, CcKvOption(timeout=2000))
        assert r.success == 8  # every block reached its other owner
        for b, h in enumerate(hashes):
            assert _load_one(cc, cache, original, b, h)
        nodes[victim].fail = False
        # the victim holds nothing: blocks it ranks first are read from the next owner
        for b, h in enumerate(hashes):
            assert _load_one(cc, cache, original, b, h)
        assert nodes[victim].calls["get"] > 0
    finally:
        cc.close()
        pool.close()


def test_a_refusing_owner_makes_the_block_not_stored():
    nodes, pool, cc = _cluster(3, 3)
    try:
        cache = make_cache(layers=1, blocks=4, block_size=BS, heads=1, head_size=8)
        cc.register_kvcache(cache)
        list(nodes.values())[1].drop_puts_for(lambda key: True)
        r = cc.save(slots_of_blocks(range(4), BS), [1, 2, 3, 4], [BS] * 4, CcKvOption(timeout=2000))
        assert r.success == 0
    finally:
        cc.close()
        pool.close()


def test_empty_member_set_fails_calls_cleanly():
    nodes, pool, cc = _cluster(2, 2)
    try:
        cache = make_cache(layers=1, blocks=2, block_size=BS, heads=1, head_size=8)
        cc.register_kvcache(cache)
        pool.set_members([])
        assert not pool.healthy(0.2)
        from ems import EmsException

        with pytest.raises(EmsException):
            cc.save(slots_of_blocks([0], BS), [1], [BS], CcKvOption(timeout=500))
        assert cc.exists([1]).success == 0
        pool.set_members(list(nodes))
        assert cc.save(slots_of_blocks([0], BS), [1], [BS], CcKvOption(timeout=500)).success == 1
    finally:
        cc.close()
        pool.close()


def test_metrics_count_calls_blocks_and_bytes():
    _, pool, cc = _cluster(2, 1)
    try:
        cache = make_cache(layers=2, blocks=4, block_size=BS, heads=2, head_size=8)
        cc.register_kvcache(cache)
        cc.save(slots_of_blocks(range(3), BS), [1, 2, 3], [BS] * 3)
        cc.load(slots_of_blocks(range(4), BS), [1, 2, 3, 9], [BS] * 4)
        cc.exists([1, 2, 9, 3])
        m = cc.metrics()
        block_bytes = 2 * 2 * BS * 2 * 8 * 2  # layers * K/V * tokens * heads * head_size * fp16
        assert (m["save_calls"], m["save_blocks"], m["save_blocks_ok"]) == (1, 3, 3)
        assert m["save_bytes"] == 3 * block_bytes
        assert (m["load_calls"], m["load_blocks"], m["load_blocks_ok"], m["load_misses"]) == (1, 4, 3, 1)
        assert m["load_bytes"] == 3 * block_bytes
        assert (m["exists_calls"], m["exists_hits"], m["exists_misses"]) == (1, 2, 2)
        assert m["save_seconds"] > 0 and m["save_gbps"] > 0
        assert m["save_stage_send_seconds"] > 0 and m["load_stage_receive_seconds"] > 0
        prometheus = pytest.importorskip("prometheus_client")
        text = prometheus.generate_latest().decode()
        assert 'ems_cc_blocks_total{op="load",rank="0",result="miss"} 1.0' in text
    finally:
        cc.close()
        pool.close()
    if "prometheus_client" in __import__("sys").modules:
        assert "ems_cc_blocks_total" not in __import__("prometheus_client").generate_latest().decode()


def test_ranked_owners_first_column_is_owners_and_rows_are_distinct():
    from ems.cluster.rendezvous import owners

    keys = [f"k{i}".encode() for i in range(2000)]
    seeds = node_seeds([f"h{i}:1" for i in range(6)])
    ranks = ranked_owners(keys, seeds, 3)
    assert ranks.shape == (2000, 3)
    assert (ranks[:, 0] == owners(keys, seeds)).all()
    assert all(len(set(row)) == 3 for row in ranks.tolist())
    # removing a node: each key keeps its other owners, in order, and gains the next one of its own ranking
    full = ranked_owners(keys, seeds, 6)
    rest = np.delete(np.arange(6), 2)
    after = rest[ranked_owners(keys, seeds[rest], 3)]
    expect = np.array([[j for j in row if j != 2][:3] for row in full.tolist()])
    assert (after == expect).all()
    assert ranked_owners(keys, seeds, 10).shape == (2000, 6)
    with pytest.raises(ValueError):
        ranked_owners(keys, seeds, 0)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_replicated_pool_states_that_it_checks_each_value_it_reads(replicas):
    """With replicas a read checks every value against the expected one (a damaged copy sends it to the next owner),
    so the pool says so once (`ReadCheck.EXPECTED`) and the load jobs skip their own check; with one owner the load
    checks. Either way a block whose every copy comes back damaged is a miss, never a wrong block."""
    nodes, pool, cc = _cluster(3, replicas)
    try:
        assert pool.read_check is (ReadCheck.EXPECTED if replicas > 1 else ReadCheck.NONE)
        cache = make_cache(layers=2, blocks=4, block_size=BS, heads=2, head_size=8)
        cc.register_kvcache(cache)
        original = snapshot(cache)
        assert cc.save(slots_of_blocks([1], BS), [8101], [BS]).success == 1
        for node in nodes.values():  # every copy damaged on its way back
            node.corrupt_gets = "flip"
        assert not _load_one(cc, cache, original, 1, 8101)
        for node in nodes.values():
            node.corrupt_gets = None
        assert _load_one(cc, cache, original, 1, 8101)
    finally:
        cc.close()
        pool.close()

"""Hot units' read copies through the public API (`ems.backends.hot_reads`, `ems.cluster.hot`): a unit loaded again
and again gets copies on other nodes and its reads spread over them, byte-exact; a copy node that fails or holds a
damaged copy is a miss that falls back to the owners, never a wrong block; a cold unit is read from its owners only;
a copy write that fails or does not fit the bound never fails a call."""

from __future__ import annotations

import numpy as np
import pytest
from ems_testlib import assert_cache_equals, expected_after_load, make_cache, poison, slots_of_blocks, snapshot
from fault_injection import FaultyNode

from ems import CcConfig, CcKvOption, ContextCaching, EmsConfig
from ems.backends.pool_client import PoolClient
from ems.cluster.rendezvous import UNIT_WIDTH, ranked_owners
from ems.datapath.keys import UNIT_BLOCKS, chain_keys
from ems.settings import resolve_settings
from ems.store.kv_store import KvStore
from ems.transport.inprocess import InProcessNode

BS = 2
BLOCKS = 32  # one chain: its first unit (UNIT_BLOCKS blocks a unit); hot after MIN_READS / BLOCKS loads
NODES = 16  # 4 groups of UNIT_WIDTH: a hot unit gets up to 3 copies besides its own group
LOADS = 24
OPTION = CcKvOption(timeout=5000)
HOT = [(3 << 100) + 11 * b for b in range(BLOCKS)]
COLD = [(9 << 100) + 13 * b for b in range(BLOCKS)]


class Setup:
    def __init__(self, replicas: int, hedge: bool = True) -> None:
        self.nodes = [FaultyNode(InProcessNode(KvStore(16 << 20)), address=f"n{i:02d}:1") for i in range(NODES)]
        self.pool = PoolClient(self.nodes, replicas=replicas, hedge=hedge)
        self.cc = ContextCaching(
            CcConfig(rank_id=0, device_id=0, model_id="hot"), None, self.pool, resolve_settings(EmsConfig(pool_replicas=replicas))
        )
        # blocks 0..15 hold the hot chain, 16..31 the cold one
        self.cache = make_cache(layers=1, blocks=2 * BLOCKS, block_size=BS, heads=1, head_size=4)
        self.cc.register_kvcache(self.cache)
        self.original = snapshot(self.cache)
        self.replicas = replicas

    def slots(self, chain: list[int]) -> list[int]:
        base = 0 if chain is HOT else BLOCKS
        return slots_of_blocks(range(base, base + BLOCKS), BS)

    def save(self, chain: list[int]) -> None:
        assert self.cc.save(self.slots(chain), chain, [BS] * BLOCKS, OPTION, chain_prefix=[]).success == BLOCKS

    def load(self, chain: list[int], blocks: int = BLOCKS) -> None:
        """Load the chain's first `blocks` into a poisoned cache: every one found, byte-exact."""
        slots = self.slots(chain)[: blocks * BS]
        poisoned = poison(self.cache)
        assert self.cc.load(slots, chain[:blocks], [BS] * blocks, OPTION, chain_prefix=[]).success == blocks
        assert_cache_equals(self.cache, expected_after_load(self.original, poisoned, slots))
        assert self.pool.router.hot.idle(5.0)  # (the copy writes this load started)

    def owners(self, chain: list[int]) -> set[str]:
        """The nodes holding the chain's blocks (its unit's group)."""
        _, routes, units = chain_keys(self.cc._v1_namespace, chain, [])
        view = self.pool.members.view
        return {view.addresses[j] for j in np.unique(ranked_owners(routes, view.seeds, self.replicas, units)).tolist()}

    def gets(self) -> dict[str, int]:
        return {n.address: n.calls["get"] for n in self.nodes}

    def reset(self) -> None:
        for n in self.nodes:
            n.calls = dict.fromkeys(n.calls, 0)

    def close(self) -> None:
        self.cc.close()
        self.pool.close()


@pytest.fixture(params=[1, 2], ids=["replicas1", "replicas2"])
def setup(request):
    s = Setup(request.param)
    s.save(HOT)
    s.save(COLD)
    s.reset()
    yield s
    s.close()


@pytest.fixture(params=[1, 2], ids=["replicas1", "replicas2"])
def unhedged(request):
    """As `setup`, without hedging: a copy node slowed by a busy host would have its reads hedged to an owner, and
    the test counting which nodes the reads reach would count those too (hedging has tests of its own)."""
    s = Setup(request.param, hedge=False)
    s.save(HOT)
    s.save(COLD)
    s.reset()
    yield s
    s.close()


def _warm(s: Setup, loads: int = LOADS) -> None:
    for _ in range(loads):
        s.load(HOT)


def test_a_hot_unit_gets_copies_and_its_reads_spread_over_more_nodes(unhedged):
    s = unhedged
    owners = s.owners(HOT)
    assert len(owners) <= UNIT_WIDTH and BLOCKS < UNIT_BLOCKS
    _warm(s)
    gets = s.gets()
    served = {a for a, g in gets.items() if g}
    stats = s.pool.router.hot.stats
    # copies were written and read: the unit is served by its own group and by copy groups
    assert stats.written > 0 and stats.hits > 0 and stats.failed == 0
    assert len(served - owners) >= UNIT_WIDTH
    # no node is asked by every load any more (without copies each owner would be: LOADS gets each)
    assert max(gets.values()) <= LOADS * 3 // 4
    # the copies sit on other nodes, under the same keys
    keys, _, _ = chain_keys(s.cc._v1_namespace, HOT, [])
    holders = {n.address for n in s.nodes if any(n.store.contains_many(keys))}
    assert len(holders - owners) >= UNIT_WIDTH


def test_a_cold_unit_is_read_from_its_owners_only(setup):
    s = setup
    _warm(s)
    asked = s.pool.router.hot.stats.asked
    s.reset()
    s.load(COLD, blocks=2)  # a small share of the reads
    assert {a for a, g in s.gets().items() if g} <= s.owners(COLD)
    assert s.pool.router.hot.stats.asked == asked


def test_failed_and_damaged_copies_fall_back_to_the_owners(setup):
    s = setup
    _warm(s)
    owners = s.owners(HOT)
    keys, _, _ = chain_keys(s.cc._v1_namespace, HOT, [])
    copy_nodes = [n for n in s.nodes if n.address not in owners and any(n.store.contains_many(keys))]
    assert copy_nodes
    # every copy damaged in place: each read there is refused by the check and read from the owners instead
    for node in copy_nodes:
        for key, held in zip(keys, node.store.contains_many(keys)):
            if held:
                node.corrupt_stored(key, "flip")
    before = s.pool.router.hot.stats.hits
    for _ in range(8):
        s.load(HOT)
    # the damaged copies were written again from the owners' values, and are read again
    _warm(s, 8)
    assert s.pool.router.hot.stats.hits > before
    # the copy nodes fail: every load still finds every block
    for node in copy_nodes:
        node.fail = True
    _warm(s, 8)


def test_a_hot_units_exists_asks_where_the_reads_go(setup):
    s = setup
    _warm(s)
    owners = s.owners(HOT)
    s.reset()
    for _ in range(8):
        assert s.cc.exists(HOT, OPTION, chain_prefix=[]).success == BLOCKS
    asked = {n.address for n in s.nodes if n.calls["exists"]}
    assert asked - owners  # some exists went to copy nodes


def test_copy_writes_that_fail_or_do_not_fit_never_fail_a_call(setup):
    s = setup
    owners = s.owners(HOT)
    for node in s.nodes:
        if node.address not in owners:
            node.drop_puts_for(lambda key: True)  # every copy write refused
    _warm(s, 12)
    stats = s.pool.router.hot.stats
    assert stats.failed > 0 and stats.written == 0 and stats.hits == 0
    s.pool.router.hot.max_calls = 0  # nothing may be in flight: every copy dropped
    failed = stats.failed
    _warm(s, 8)
    assert stats.dropped > 0 and stats.failed == failed


def test_a_partitioned_copy_node_is_hedged_to_the_owners_within_the_deadline(setup):
    s = setup
    _warm(s)
    owners = s.owners(HOT)
    for node in s.nodes:
        if node.address not in owners:
            node.partitioned = True  # a copy node's request waits out the deadline: only a hedge finds the value
    slots = s.slots(HOT)
    short = CcKvOption(timeout=2000)
    for _ in range(6):
        poisoned = poison(s.cache)
        assert s.cc.load(slots, HOT, [BS] * BLOCKS, short, chain_prefix=[]).success == BLOCKS
        assert_cache_equals(s.cache, expected_after_load(s.original, poisoned, slots))

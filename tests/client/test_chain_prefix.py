"""`chain_prefix` (this package's addition to the V1 hash forms and `exists`): checked like every argument, and the
blocks a call gives it are stored under their placement unit, so they are found by any call that gives their chain
position (however the chain is split between prefix and hashes), and missed by one that does not.

Over real in-process stores: sixteen nodes (more than a unit's group), two replicas."""

from __future__ import annotations

import pytest
from ems_testlib import make_cache, slots_of_blocks
from fault_injection import FaultyNode

from ems import CcConfig, CcKvOption, ContextCaching, EmsConfig, EmsErrorCode, EmsException, PrimaryKey
from ems.backends.pool_client import PoolClient
from ems.cluster.rendezvous import UNIT_WIDTH
from ems.datapath.keys import UNIT_BLOCKS
from ems.settings import resolve_settings
from ems.store.kv_store import KvStore
from ems.transport.inprocess import InProcessNode

BS = 2
BLOCKS = UNIT_BLOCKS + 100  # a chain spanning two units
CHAIN = [(7 << 200) + 31 * b for b in range(BLOCKS)]
OPTION = CcKvOption(timeout=5000)


@pytest.fixture(scope="module")
def pool_and_cc():
    stores = [KvStore(16 << 20) for _ in range(16)]
    nodes = [FaultyNode(InProcessNode(store), address=f"n{i}:1") for i, store in enumerate(stores)]
    pool = PoolClient(nodes, replicas=2)
    cc = ContextCaching(CcConfig(rank_id=0, device_id=0, model_id="chain"), None, pool, resolve_settings(EmsConfig()))
    cc.register_kvcache(make_cache(layers=1, blocks=BLOCKS, block_size=BS, heads=1, head_size=4))
    yield stores, cc
    cc.close()
    pool.close()


def _slots(first: int, n: int) -> list[int]:
    return slots_of_blocks(range(first, first + n), BS)


def _raises_naming_chain_prefix(call) -> str:
    with pytest.raises(EmsException) as info:
        call()
    assert info.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    assert "chain_prefix" in info.value.message(), info.value.message()
    return info.value.message()


@pytest.mark.parametrize(
    "bad",
    ["abc", 5, [1, "x"], [1, 2.5], [2**256], [-(2**255) - 1], [[1]], {"a": 1}],
    ids=["str", "int", "str-item", "float-item", "too-wide", "too-negative", "nested", "dict"],
)
def test_a_bad_chain_prefix_is_refused_naming_it(pool_and_cc, bad):
    stores, cc = pool_and_cc
    before = sum(len(s.keys()) for s in stores)
    hashes = CHAIN[:2]
    _raises_naming_chain_prefix(lambda: cc.save(_slots(0, 2), hashes, [BS] * 2, OPTION, chain_prefix=bad))
    _raises_naming_chain_prefix(lambda: cc.load(_slots(0, 2), hashes, [BS] * 2, OPTION, chain_prefix=bad))
    descs = [[(0, BS), (BS, BS)]]
    _raises_naming_chain_prefix(lambda: cc.save(hashes=hashes, chunk_descs=descs, option=OPTION, chain_prefix=bad))
    _raises_naming_chain_prefix(lambda: cc.async_save(_slots(0, 2), hashes, [BS] * 2, OPTION, chain_prefix=bad))
    _raises_naming_chain_prefix(lambda: cc.exists(hashes, OPTION, chain_prefix=bad))
    assert sum(len(s.keys()) for s in stores) == before  # nothing written


def test_chain_prefix_is_refused_where_positions_are_not_hashes(pool_and_cc):
    _, cc = pool_and_cc
    message = _raises_naming_chain_prefix(
        lambda: cc.save(_slots(0, 1), option=OPTION, token_ids=[1, 2], mask=[1, 1], chain_prefix=[])
    )
    assert "token form" in message
    _raises_naming_chain_prefix(lambda: cc.exists([PrimaryKey("d", "a")], OPTION, chain_prefix=[1]))
    _raises_naming_chain_prefix(lambda: cc.save(OPTION, [PrimaryKey("d", "a")], [[]], chain_prefix=[1]))


def test_saved_with_a_chain_prefix_found_by_its_position_missed_without(pool_and_cc):
    _, cc = pool_and_cc
    chain = [h + 1 for h in CHAIN]  # a chain of this test's own
    assert cc.save(_slots(0, BLOCKS), chain, [BS] * BLOCKS, OPTION, chain_prefix=[]).success == BLOCKS
    # the same blocks, the chain split anywhere between the prefix and the call's hashes: every block found
    for split in (0, 1, UNIT_BLOCKS - 1, UNIT_BLOCKS, BLOCKS - 1):
        n = BLOCKS - split
        assert cc.exists(chain[split:], OPTION, chain_prefix=chain[:split]).success == n, split
        assert cc.load(_slots(split, n), chain[split:], [BS] * n, OPTION, chain_prefix=chain[:split]).success == n
    # without a chain position (per-block placement, another key form): misses, never another form's value
    assert cc.exists(chain, OPTION).success == 0
    assert cc.load(_slots(0, BLOCKS), chain, [BS] * BLOCKS, OPTION).success == 0
    # a wrong position (the blocks shifted by one) is another unit's keys: misses
    assert cc.exists(chain[1:], OPTION, chain_prefix=[]).success == 0
    # and the reverse: saved without a position, found only without one
    loose = [h + 2 for h in CHAIN[:8]]
    assert cc.save(_slots(0, 8), loose, [BS] * 8, OPTION).success == 8
    assert cc.exists(loose, OPTION).success == 8
    assert cc.exists(loose, OPTION, chain_prefix=[]).success == 0


def test_a_chain_lands_on_few_nodes(pool_and_cc):
    """Two units, two replicas: at most 2 * UNIT_WIDTH of the 16 nodes hold any of the chain's blocks."""
    stores, cc = pool_and_cc
    chain = [h + 3 for h in CHAIN]
    before = [set(s.keys()) for s in stores]
    assert cc.save(_slots(0, BLOCKS), chain, [BS] * BLOCKS, OPTION, chain_prefix=[]).success == BLOCKS
    holding = [len(set(s.keys()) - b) for s, b in zip(stores, before)]
    assert sum(holding) == 2 * BLOCKS  # two copies of each block, on distinct nodes
    assert 2 <= sum(1 for h in holding if h) <= 2 * UNIT_WIDTH, holding

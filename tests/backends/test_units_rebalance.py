"""Placement units while the pool rebalances: right after nodes join, before repair has moved anything, a read of
blocks saved under their units still finds every one (`ems.cluster.rendezvous.read_order`: the group's first members,
then the members the joined nodes displaced), with one replica, the hardest case."""

from __future__ import annotations

import numpy as np
import pytest
from ems_testlib import make_cache, slots_of_blocks
from fault_injection import FaultyNode

from ems import CcConfig, CcKvOption, ContextCaching, EmsConfig
from ems.backends.pool_client import PoolClient
from ems.cluster.rendezvous import ranked_owners
from ems.datapath.keys import UNIT_BLOCKS, chain_keys
from ems.settings import resolve_settings
from ems.store.kv_store import KvStore
from ems.transport.inprocess import InProcessNode

BS = 2
BLOCKS = 4 * UNIT_BLOCKS
OPTION = CcKvOption(timeout=5000)


@pytest.mark.parametrize("replicas, joins", [(1, 1), (1, 3), (2, 2)])
def test_blocks_saved_before_joins_are_found_after_them(replicas, joins):
    nodes = {f"n{i}:1": FaultyNode(InProcessNode(KvStore(16 << 20)), address=f"n{i}:1") for i in range(12 + joins)}
    first = sorted(nodes)[:12]
    pool = PoolClient([nodes[a] for a in first], replicas=replicas, connect=lambda address: nodes[address])
    cc = ContextCaching(
        CcConfig(rank_id=0, device_id=0, model_id="rebalance"), None, pool, resolve_settings(EmsConfig(pool_replicas=replicas))
    )
    try:
        cc.register_kvcache(make_cache(layers=1, blocks=BLOCKS, block_size=BS, heads=1, head_size=4))
        chain = [(5 << 100) + 7 * b for b in range(BLOCKS)]
        slots = slots_of_blocks(range(BLOCKS), BS)
        assert cc.save(slots, chain, [BS] * BLOCKS, OPTION, chain_prefix=[]).success == BLOCKS
        pool.set_members(sorted(nodes))  # the joins: placement changes, nothing has moved yet
        assert pool.members.fallback() == joins
        # (the test means something: the joined nodes now own blocks they do not hold)
        _, routes, units = chain_keys(cc._v1_namespace, chain, [])
        view = pool.members.view
        owners = ranked_owners(routes, view.seeds, replicas, units)
        joined = [view.addresses.index(a) for a in sorted(nodes)[12:]]
        assert np.isin(owners, joined).any()
        assert cc.exists(chain, OPTION, chain_prefix=[]).success == BLOCKS
        assert cc.load(slots, chain, [BS] * BLOCKS, OPTION, chain_prefix=[]).success == BLOCKS
    finally:
        cc.close()
        pool.close()

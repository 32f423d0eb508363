"""The connector's keys get the pool's locality placement (issue 46): its lookups, loads and saves name where their
blocks sit in the request's prefix chain (`BlockTransfer.chain_prefix`, `block_transfer`'s `chain_prefix`), so a
request's blocks land on a unit group's few nodes of a larger pool, and a producer's blocks are found by a consumer
however their calls split the chain. Over real pool nodes (`python -m ems.pool`), the worker halves fed metadata
directly."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from fake_vllm import LAYERS, kv_caches, make_context

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "pool"))
from pool_testlib import node_clients, pool_nodes  # noqa: F401

from ems.cluster.rendezvous import UNIT_WIDTH
from ems.datapath.keys import UNIT_BLOCKS, chain_keys
from ems.integrations.block_transfer import lookup
from ems.integrations.engine_keys import block_keys
from ems.integrations.vllm.metadata import BlockTransfer, EmsConnectorMetadata
from ems.integrations.vllm.worker import EmsWorker

NODES = 12
BLOCKS = UNIT_BLOCKS + 44  # a prompt spanning two placement units
HASHES = [i.to_bytes(4, "little") * 8 for i in range(1, BLOCKS + 1)]  # (vLLM's block hashes: bytes)


def test_a_requests_blocks_land_on_its_units_groups_and_a_consumer_finds_them(pool_nodes, node_clients):  # noqa: F811
    nodes = [pool_nodes("64MiB") for _ in range(NODES)]
    ctx = make_context(
        model_id="units",
        num_blocks=2 * BLOCKS,
        pool_nodes=[n.address for n in nodes],
        pool_replicas=2,
        in_step_ms=20_000,
        timeout_ms=20_000,
    )
    source = kv_caches(2 * BLOCKS, seed=11)
    producer = EmsWorker(ctx)
    producer.register_kv_caches(source, 0, set())
    half = 150  # saved in two steps, as a chunked prefill does: the second names the first's blocks as its prefix
    meta = EmsConnectorMetadata(
        saves=[
            BlockTransfer("p", list(range(half)), HASHES[:half], chain_prefix=[]),
            BlockTransfer("p", list(range(half, BLOCKS)), HASHES[half:], chain_prefix=HASHES[:half]),
        ]
    )
    producer.wait_for_save(meta)
    assert producer.wait_saves(30)
    assert ctx.stats.totals().save_blocks == BLOCKS and ctx.stats.totals().save_failed_blocks == 0

    # where the values are: each node asked for the request's storage keys (unit keys, `ems.datapath.keys`)
    keys = block_keys(HASHES, 0, 1, False)
    storage, _, units = chain_keys(ctx.cc._v1_namespace, keys, [])
    held = [node_clients(n.address).exists(storage, 5.0) for n in nodes]
    copies = [sum(node[k] for node in held) for k in range(BLOCKS)]
    assert copies == [2] * BLOCKS  # every block on its two replicas
    unit_nodes = [{i for i, node in enumerate(held) if any(node[k] for k in range(BLOCKS) if units[k] == u)} for u in set(units)]
    assert len(unit_nodes) == 2 and all(len(u) <= UNIT_WIDTH for u in unit_nodes), unit_nodes
    assert len(set().union(*unit_nodes)) < NODES  # per-key placement would spread 300 blocks over all 12

    # the scheduler's lookup finds them from any chain position; a lookup that does not give the position misses
    assert lookup(ctx.cc, HASHES[100:], 1, False, chain_prefix=HASHES[:100]) == BLOCKS - 100
    assert lookup(ctx.cc, HASHES, 1, False, chain_prefix=[]) == BLOCKS
    assert lookup(ctx.cc, HASHES[100:], 1, False) == 0
    producer.shutdown()

    # a consumer loads them in the step, split otherwise than they were saved, with a second request in the same step
    caches = kv_caches(2 * BLOCKS, seed=12)
    consumer = EmsWorker(ctx)
    consumer.register_kv_caches(caches, 0, set())
    dst = list(range(BLOCKS, 2 * BLOCKS))
    loads = [
        BlockTransfer("c", dst[:200], HASHES[:200], in_step=True, chain_prefix=[]),
        BlockTransfer("d", dst[200:], HASHES[200:], in_step=True, chain_prefix=HASHES[:200]),
    ]
    consumer.start_load_kv(EmsConnectorMetadata(loads=loads))
    assert consumer.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        assert torch.equal(caches[name][BLOCKS:], source[name][:BLOCKS]), name
    consumer.shutdown()

"""Layer-wise transfers (`transfer_granularity: "layer"`) of the connector's worker half on the embedded pool, fed
metadata directly: a layer-wise worker and a step-wise one read each other's blocks (the same keys and values),
each layer of an in-step load is in the cache once `wait_for_layer_load` of it returns, blocks the pool does not
have go to the load errors (never wrong bytes), asynchronous loads pass through the mirror too, and the mirror's
runs are given back. (The real vLLM engine: test_connector.py's layer-wise test.)"""

from __future__ import annotations

import time

import pytest
import torch
from fake_vllm import BLOCK, LAYERS, block_hashes, kv_caches, make_context

from ems.integrations.connector_config import TransferGranularity
from ems.integrations.vllm.layer_transfers import HostMirror
from ems.integrations.vllm.metadata import BlockTransfer, EmsConnectorMetadata
from ems.integrations.vllm.worker import EmsWorker


def worker_of(ctx, granularity: str, caches) -> EmsWorker:
    config = ctx.config.__class__.from_extra({"local_pool": "off", "read_cache_capacity": 0, "transfer_granularity": granularity})
    ctx = ctx.__class__(**{**ctx.__dict__, "config": config})
    assert ctx.config.transfer_granularity is TransferGranularity(granularity)
    worker = EmsWorker(ctx)
    worker.register_kv_caches(caches, 0, set())
    return worker


def save(worker: EmsWorker, transfers: list[BlockTransfer], layer_wise: bool) -> None:
    meta = EmsConnectorMetadata(saves=transfers)
    if layer_wise:
        for name in LAYERS:  # as the forward writes each layer
            worker.save_kv_layer(name, meta)
    worker.wait_for_save(meta)
    assert worker.wait_saves(10)


@pytest.fixture
def ctx():
    return make_context(model_id="layers")


PROMPTS = {rid: list(range(i * 1000, i * 1000 + BLOCK * 6)) for i, rid in enumerate(("a", "b"))}


def test_a_layer_wise_save_is_read_step_wise_and_a_step_wise_save_layer_by_layer(ctx):
    source = kv_caches(ctx.num_blocks, seed=1)
    layered = worker_of(ctx, "layer", source)
    hashes_a = block_hashes(PROMPTS["a"])
    save(layered, [BlockTransfer("a", [0, 1, 2], hashes_a[:3]), BlockTransfer("a2", [3, 4, 5], hashes_a[3:6])], True)
    steps = layered.steps.records()
    layered.get_finished(set(), None)
    assert sum(r["layer_copies"] for r in layered.steps.records()) == len(LAYERS), steps
    assert sum(r["late_layer_copies"] for r in layered.steps.records()) == 0, steps
    assert layered._stage is not None and layered._stage.mirror.free_blocks() == layered._stage.mirror.capacity
    layered.shutdown()

    # a step-wise worker (the cache registered itself) loads what the layer-wise one saved, and saves b
    step_caches = kv_caches(ctx.num_blocks, seed=2)
    stepped = worker_of(ctx, "step", step_caches)
    stepped.start_load_kv(EmsConnectorMetadata(loads=[BlockTransfer("a", [10, 11, 12, 13, 14, 15], hashes_a, in_step=True)]))
    assert stepped.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        assert torch.equal(step_caches[name][10:16], source[name][0:6]), name
    hashes_b = block_hashes(PROMPTS["b"])
    save(stepped, [BlockTransfer("b", [20, 21, 22, 23], hashes_b[:4])], False)
    stepped.shutdown()

    # a layer-wise worker loads b in the step: each layer is in place once its wait returns
    caches = kv_caches(ctx.num_blocks, seed=3)
    loader = worker_of(ctx, "layer", caches)
    meta = EmsConnectorMetadata(loads=[BlockTransfer("b", [5, 6, 7, 8], hashes_b[:4], in_step=True)])
    loader.start_load_kv(meta)
    for name in LAYERS:
        loader.wait_for_layer_load(name)
        assert torch.equal(caches[name][5:9], step_caches[name][20:24]), name
    loader.wait_for_save(meta)
    assert loader.get_block_ids_with_load_errors() == set()
    loader.get_finished(set(), meta)
    record = loader.steps.records()[-1]
    assert record["in_step_loads"] == 1 and record["layer_copies"] == len(LAYERS), record
    assert loader._stage is not None and loader._stage.mirror.free_blocks() == loader._stage.mirror.capacity
    loader.shutdown()


def test_blocks_the_pool_lacks_are_load_errors_and_requests_sharing_a_prefix_each_get_it(ctx):
    source = kv_caches(ctx.num_blocks, seed=4)
    hashes = block_hashes(PROMPTS["a"])
    layered = worker_of(ctx, "layer", source)
    save(layered, [BlockTransfer("a", [0, 1, 2], hashes[:3])], True)  # blocks 3-5 never saved
    caches = kv_caches(ctx.num_blocks, seed=5)
    before = {name: t.clone() for name, t in caches.items()}
    loader = worker_of(ctx, "layer", caches)
    loads = [
        BlockTransfer("x", [8, 9, 10, 11, 12], hashes[:5], in_step=True),  # 3 of 5 in the pool
        BlockTransfer("y", [16, 17], hashes[:2], in_step=True),  # the same prefix, read once
    ]
    meta = EmsConnectorMetadata(loads=loads)
    loader.start_load_kv(meta)
    for name in LAYERS:
        loader.wait_for_layer_load(name)
    loader.wait_for_save(meta)
    assert loader.get_block_ids_with_load_errors() == {11, 12}
    for name in LAYERS:
        assert torch.equal(caches[name][8:11], source[name][0:3])
        assert torch.equal(caches[name][16:18], source[name][0:2])
        assert torch.equal(caches[name][11:13], before[name][11:13])  # never written: recomputed by vLLM
    loader.shutdown()


def test_asynchronous_loads_pass_through_the_mirror(ctx):
    source = kv_caches(ctx.num_blocks, seed=6)
    hashes = block_hashes(PROMPTS["b"])
    layered = worker_of(ctx, "layer", source)
    save(layered, [BlockTransfer("b", [4, 5, 6, 7, 8, 9], hashes)], True)
    caches = kv_caches(ctx.num_blocks, seed=7)
    loader = worker_of(ctx, "layer", caches)
    loader.start_load_kv(EmsConnectorMetadata(loads=[BlockTransfer("b", [20, 21, 22, 23, 24, 25], hashes)]))
    done: set[str] = set()
    deadline = time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        done |= loader.get_finished(set(), EmsConnectorMetadata(idle=True))[1] or set()
    assert done == {"b"} and loader.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        assert torch.equal(caches[name][20:26], source[name][4:10])
    assert loader._stage is not None and loader._stage.mirror.free_blocks() == loader._stage.mirror.capacity
    loader.shutdown()


def test_the_mirror_gives_runs_and_merges_what_comes_back(ctx):
    mirror = HostMirror.build(ctx.shapes, 10, torch.device("cpu"))
    assert mirror.planes[0][0].shape == (10, 1, 1, ctx.shapes[0].elems)
    a, b, c = mirror.take(4), mirror.take(4), mirror.take(2)
    assert (a, b, c) == (0, 4, 8) and mirror.take(1) is None
    mirror.give(4, 4)
    assert mirror.take(5) is None and mirror.take(4) == 4
    mirror.give(0, 4)
    mirror.give(4, 4)
    mirror.give(8, 2)
    assert mirror.free_blocks() == 10 and mirror.take(10) == 0
    with pytest.raises(ValueError):
        mirror.take(0)

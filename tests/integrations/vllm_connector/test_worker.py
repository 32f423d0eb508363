"""The connector's worker half (`EmsWorker`) on the embedded pool, fed metadata directly: it refuses a cache the
scheduler could not address, loads beyond the in-flight budget start on later steps (every one finishes, every
block arrives), and a preempted request's copy-outs end before the forward that may reuse its blocks."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from fake_vllm import LAYERS, block_hashes, kv_caches, make_context

from ems.integrations.vllm.metadata import BlockTransfer, EmsConnectorMetadata
from ems.integrations.vllm.worker import EmsWorker


@pytest.fixture
def ctx():
    return make_context(max_inflight=1)


def test_registration_refuses_a_cache_the_scheduler_could_not_address(ctx):
    worker = EmsWorker(ctx)
    caches = kv_caches(ctx.num_blocks)
    with pytest.raises(ValueError, match="no tensor for layers"):
        worker.register_kv_caches({LAYERS[0]: caches[LAYERS[0]]}, 0, set())
    with pytest.raises(ValueError, match="do not match vLLM's KV cache spec"):
        worker.register_kv_caches({n: t.float() for n, t in caches.items()}, 0, set())
    with pytest.raises(ValueError, match=r"set attention_config\.backend"):
        worker.register_kv_caches(caches, 0, {"FLASH_ATTN"})
    worker.register_kv_caches(caches, 0, {"CPU_ATTN"})
    worker.shutdown()


def test_loads_beyond_the_in_flight_budget_start_on_later_steps(ctx):
    worker = EmsWorker(ctx)
    caches = kv_caches(ctx.num_blocks, seed=1)
    worker.register_kv_caches(caches, 0, set())
    prompts = {rid: list(range(i * 100, i * 100 + 8)) for i, rid in enumerate(("a", "b", "c"))}
    saves = [BlockTransfer(rid, [2 * i, 2 * i + 1], block_hashes(p)) for i, (rid, p) in enumerate(prompts.items())]
    for save in saves:  # one at a time: a save beyond the budget (1) would be dropped
        worker.wait_for_save(EmsConnectorMetadata(saves=[save]))
        assert worker.wait_saves(10)
    assert ctx.stats.totals().save_blocks == 6
    loads = [BlockTransfer(rid, [10 + 2 * i, 11 + 2 * i], block_hashes(p)) for i, (rid, p) in enumerate(prompts.items())]
    worker.start_load_kv(EmsConnectorMetadata(loads=loads[:1]))  # a's call takes the budget (1) until polled
    worker.start_load_kv(EmsConnectorMetadata(loads=loads[1:]))  # b and c: one call, on a later step
    assert [(r.req_id) for r in worker.loads._queued_loads] == ["b", "c"]
    done: set[str] = set()
    deadline = time.monotonic() + 10
    while done != set(prompts) and time.monotonic() < deadline:
        done |= worker.get_finished(set(), EmsConnectorMetadata(idle=True))[1] or set()
    assert done == set(prompts) and worker.get_block_ids_with_load_errors() == set()
    for layer in caches.values():
        assert torch.equal(layer[10:16], layer[0:6])
    assert sum(r["load_calls"] for r in worker.steps.records()) == 2
    worker.shutdown()


def test_a_preempted_requests_copy_outs_end_before_the_forward(ctx):
    worker = EmsWorker(ctx)
    worker.register_kv_caches(kv_caches(ctx.num_blocks), 0, set())
    released = threading.Event()

    def ready():  # the copy-out of this step's saves waits until released (an accelerator's kernels still running)
        return lambda: released.wait(10)

    worker.saves._ready_event = ready
    save = BlockTransfer("a", [0, 1], block_hashes(list(range(8))))
    worker.wait_for_save(EmsConnectorMetadata(saves=[save]))
    threading.Timer(0.3, released.set).start()
    started = time.monotonic()
    worker.handle_preemptions(EmsConnectorMetadata(preempted={"a"}))  # "a" gives its blocks back now
    assert released.is_set() and time.monotonic() - started > 0.2
    assert not worker.saves.copying("a")
    worker.shutdown()


def saved_worker(ctx, prompts: dict[str, list[int]], skip: dict[str, int] | None = None):
    """A worker whose pool holds each prompt's two blocks (saved from blocks 2i, 2i+1), but for `skip`'s
    (request -> block index never saved)."""
    worker = EmsWorker(ctx)
    caches = kv_caches(ctx.num_blocks, seed=2)
    worker.register_kv_caches(caches, 0, set())
    for i, (rid, prompt) in enumerate(prompts.items()):
        hashes = block_hashes(prompt)
        keep = [b for b in range(2) if (skip or {}).get(rid) != b]
        save = BlockTransfer(rid, [2 * i + b for b in keep], [hashes[b] for b in keep])
        worker.wait_for_save(EmsConnectorMetadata(saves=[save]))
        assert worker.wait_saves(10)
    return worker, caches


def finish_all(worker: EmsWorker, rids: set[str]) -> set[str]:
    done: set[str] = set()
    deadline = time.monotonic() + 10
    while done != rids and time.monotonic() < deadline:
        done |= worker.get_finished(set(), EmsConnectorMetadata(idle=True))[1] or set()
    return done


def test_a_steps_loads_are_one_call_and_a_short_one_asks_again_for_the_requests_it_did_not_read(ctx):
    """Request b's second block is not in the pool: the step's one call stops there. a's blocks arrive, b keeps its
    first block (the second is recomputed), and c, after b in the call and never read, is asked for again on the
    next step and arrives whole (not recomputed)."""
    prompts = {rid: list(range(i * 100, i * 100 + 8)) for i, rid in enumerate(("a", "b", "c"))}
    worker, caches = saved_worker(ctx, prompts, skip={"b": 1})
    loads = [BlockTransfer(rid, [10 + 2 * i, 11 + 2 * i], block_hashes(p)) for i, (rid, p) in enumerate(prompts.items())]
    worker.start_load_kv(EmsConnectorMetadata(loads=loads))
    assert finish_all(worker, set(prompts)) == set(prompts)
    assert worker.get_block_ids_with_load_errors() == {13}  # b's second block only
    for layer in caches.values():
        assert torch.equal(layer[10:13], layer[0:3]) and torch.equal(layer[14:16], layer[4:6])
    records = worker.steps.records()
    assert [(r["load_calls"], r["loads_started"]) for r in records if r["load_calls"]] == [(1, 3), (1, 1)]
    worker.shutdown()


def test_a_call_that_loads_nothing_fails_every_request_in_it(ctx):
    """The first block of the first request is missing: the pool served nothing, so nothing is asked again; every
    promised block is reported failed (vLLM recomputes them)."""
    prompts = {rid: list(range(i * 100, i * 100 + 8)) for i, rid in enumerate(("a", "b"))}
    worker, _ = saved_worker(ctx, prompts, skip={"a": 0})
    loads = [BlockTransfer(rid, [10 + 2 * i, 11 + 2 * i], block_hashes(p)) for i, (rid, p) in enumerate(prompts.items())]
    worker.start_load_kv(EmsConnectorMetadata(loads=loads))
    assert finish_all(worker, set(prompts)) == set(prompts)
    assert worker.get_block_ids_with_load_errors() == {10, 11, 12, 13}
    assert sum(r["load_calls"] for r in worker.steps.records()) == 1
    worker.shutdown()


def test_requests_sharing_a_prefix_in_one_step_read_it_once_and_each_gets_it(ctx):
    """b and c (admitted together) load the same two blocks into their own blocks, and d loads a's first block only:
    one call reads each key once (a key may appear once in a call), and the blocks are copied into the others'."""
    prompts = {"a": list(range(0, 8))}
    worker, caches = saved_worker(ctx, prompts)
    hashes = block_hashes(prompts["a"])
    loads = [BlockTransfer("b", [10, 11], hashes), BlockTransfer("c", [12, 13], hashes), BlockTransfer("d", [14], hashes[:1])]
    worker.start_load_kv(EmsConnectorMetadata(loads=loads))
    assert finish_all(worker, {"b", "c", "d"}) == {"b", "c", "d"}
    assert worker.get_block_ids_with_load_errors() == set()
    for layer in caches.values():
        for first in (10, 12):
            assert torch.equal(layer[first : first + 2], layer[0:2])
        assert torch.equal(layer[14], layer[0])
    records = worker.steps.records()
    assert sum(r["load_calls"] for r in records) == 1 and sum(r["copied_blocks"] for r in records) == 3
    assert ctx.stats.totals().load_blocks == 2  # each key read once
    worker.shutdown()

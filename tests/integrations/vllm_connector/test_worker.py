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
    worker.start_load_kv(EmsConnectorMetadata(loads=loads))
    done: set[str] = set()
    deadline = time.monotonic() + 10
    while done != set(prompts) and time.monotonic() < deadline:
        done |= worker.get_finished(set(), EmsConnectorMetadata(idle=True))[1] or set()
    assert done == set(prompts) and worker.get_block_ids_with_load_errors() == set()
    for layer in caches.values():
        assert torch.equal(layer[10:16], layer[0:6])
    assert sum(r["load_calls"] for r in worker.steps.records()) == 3
    worker.shutdown()


def test_a_preempted_requests_copy_outs_end_before_the_forward(ctx):
    worker = EmsWorker(ctx)
    worker.register_kv_caches(kv_caches(ctx.num_blocks), 0, set())
    released = threading.Event()

    def ready():  # the copy-out of this step's saves waits until released (an accelerator's kernels still running)
        return lambda: released.wait(10)

    worker._ready_event = ready
    save = BlockTransfer("a", [0, 1], block_hashes(list(range(8))))
    worker.wait_for_save(EmsConnectorMetadata(saves=[save]))
    threading.Timer(0.3, released.set).start()
    started = time.monotonic()
    worker.handle_preemptions(EmsConnectorMetadata(preempted={"a"}))  # "a" gives its blocks back now
    assert released.is_set() and time.monotonic() - started > 0.2
    assert worker._copier is not None and not worker._copier.copying("a")
    worker.shutdown()

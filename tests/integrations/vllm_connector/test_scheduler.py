"""The connector's scheduler half (`EmsScheduler`, `PoolLookups`) driving its worker half (`EmsWorker`) on the embedded
pool, with stand-ins for vLLM's objects (fake_vllm.py), as vLLM's single-process mode runs them: lookups answered off
the step, saves sent once per block, a second request loading what the first saved, leases held from the lookup to
the load, a reset cancelling promised loads, and a load keyed in the epoch its lookup found the blocks in."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from fake_vllm import BLOCK, Blocks, Events, Request, Schedule, kv_caches, make_context

from ems.integrations.connector_config import ConnectorConfig, KvRole
from ems.integrations.epoch import EpochRecord
from ems.integrations.vllm.lookups import LookupAnswer
from ems.integrations.vllm.lookups.step_policy import StepMode
from ems.integrations.vllm.metadata import IDLE_WAIT_S, EmsConnectorMetadata
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
    ctx = make_context(epoch_refresh_s=0.05, step_policy="async")  # the asynchronous path (test_step_policy.py: in the step)
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
    # vLLM keeps the blocks for the copy-outs; the response names the blocks on their way to the pool (P/D)
    assert sched.request_finished(a, [0, 1, 2, 3]) == (True, {"ems_blocks": 3, "ems_model_id": ctx.model_id})
    deadline = time.monotonic() + 10
    while not (sent := worker.get_finished({"a"}, None)[0]) and time.monotonic() < deadline:
        pass
    assert sent == {"a"}

    b = Request("b", PROMPT)
    assert answer(sched, b) == 3 * BLOCK
    store = ctx.cc._pool.store
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


def test_a_producer_saves_and_never_loads_and_a_consumer_loads_and_never_saves(halves):
    ctx, sched, worker, _, events = halves
    producer = EmsScheduler(dataclasses.replace(ctx, role=KvRole.PRODUCER), events)
    consumer = EmsScheduler(dataclasses.replace(ctx, role=KvRole.CONSUMER), events)
    try:
        a = Request("a", PROMPT)
        meta = save(producer, worker, a, [0, 1, 2, 3])
        assert [(s.req_id, s.block_ids) for s in meta.saves] == [("a", [0, 1, 2])]
        assert producer.request_finished(a, [0, 1, 2, 3]) == (True, {"ems_blocks": 3, "ems_model_id": ctx.model_id})
        # the pool holds a's blocks, but a producer never asks for them (answered at once, nothing leased)
        store = ctx.cc._pool.store
        assert store is not None
        assert producer.get_num_new_matched_tokens(Request("p2", PROMPT), 0) == (0, False)
        assert store.stats().leased_bytes == 0
        # a consumer loads them ...
        b = Request("b", PROMPT)
        assert answer(consumer, b) == 3 * BLOCK
        consumer.update_state_after_alloc(b, Blocks([8, 9, 10, 11]), 3 * BLOCK)
        meta = step(consumer, worker, Schedule())
        assert [(x.req_id, x.block_ids) for x in meta.loads] == [("b", [8, 9, 10])]
        assert finish_load(worker, "b") == set()
        # ... and never saves what it computes: nothing of c reaches the pool, and its response announces nothing
        saved = ctx.stats.totals().save_blocks
        c = Request("c", list(range(900, 900 + 3 * BLOCK + 1)))
        assert save(consumer, worker, c, [12, 13, 14, 15]).saves == []
        assert consumer.request_finished(c, [12, 13, 14, 15]) == (False, None)
        assert ctx.stats.totals().save_blocks == saved
        assert answer(sched, Request("c2", c.prompt)) == 0
    finally:
        producer.shutdown()
        consumer.shutdown()


def waits_for(sched: EmsScheduler, request: Request, seconds: float) -> bool:
    """The lookup stays unanswered ("ask again next step") for `seconds` of idle steps."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if sched.get_num_new_matched_tokens(request, 0)[0] is not None:
            return False
        sched.build_connector_meta(Schedule())
    return True


def test_a_consumer_waits_for_the_blocks_a_producer_is_still_saving(halves):
    """The producer's response names 3 blocks whose copy-outs have not run yet: the consumer's lookup, short of them,
    asks again each step instead of recomputing, and loads them once they are in the pool."""
    ctx, _, worker, _, events = halves
    producer = EmsScheduler(dataclasses.replace(ctx, role=KvRole.PRODUCER), events)
    consumer = EmsScheduler(dataclasses.replace(ctx, role=KvRole.CONSUMER), events)
    try:
        a = Request("a", PROMPT)
        assert answer(producer, a) == 0
        producer.update_state_after_alloc(a, Blocks([0, 1, 2, 3]), 0)
        meta = producer.build_connector_meta(Schedule.prefill(a, [0, 1, 2, 3]))  # the forward ran; no copy-out yet
        _, params = producer.request_finished(a, [0, 1, 2, 3])
        b = Request("b", PROMPT, kv_transfer_params=params)
        assert waits_for(consumer, b, 0.3)
        worker.wait_for_save(meta)  # the copy-outs run now
        assert worker.wait_saves(10)
        assert answer(consumer, b) == 3 * BLOCK
        assert ctx.stats.totals().lookup_save_waits > 0
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_a_producer_that_responds_after_its_saves_leaves_its_consumer_nothing_to_wait_for(halves):
    """`producer_response` "after_save" (the default): the producer's step ends (vLLM sends its response) once the
    pool holds its blocks, so the consumer's lookup finds them all at its first answer, never asking again."""
    ctx, _, _, caches, events = halves
    producer_ctx = dataclasses.replace(ctx, role=KvRole.PRODUCER)
    producer, worker = EmsScheduler(producer_ctx, events), EmsWorker(producer_ctx)
    consumer = EmsScheduler(dataclasses.replace(ctx, role=KvRole.CONSUMER), events)
    try:
        worker.register_kv_caches(caches, 0, {"CPU_ATTN"})
        a = Request("a", PROMPT)
        assert answer(producer, a) == 0
        producer.update_state_after_alloc(a, Blocks([0, 1, 2, 3]), 0)
        worker.wait_for_save(producer.build_connector_meta(Schedule.prefill(a, [0, 1, 2, 3])))  # the step ends
        _, params = producer.request_finished(a, [0, 1, 2, 3])
        b = Request("b", PROMPT, kv_transfer_params=params)
        assert answer(consumer, b) == 3 * BLOCK
        assert ctx.stats.totals().lookup_save_waits == 0
    finally:
        producer.shutdown()
        consumer.shutdown()
        worker.shutdown()


@pytest.mark.parametrize("policy", ["async", "in_step"])
def test_a_request_waiting_for_blocks_on_their_way_sleeps_between_its_asks(halves, policy):
    """While a consumer's request waits for announced blocks that have not landed, it asks the pool at most once per
    IDLE_WAIT_S and the idle steps in between sleep (vLLM's loop calls again at once: without it, the engine spins
    on the cores the producer's save needs); once the blocks land it takes them within a few steps."""
    ctx, sched, worker, _, events = halves
    config = dataclasses.replace(ctx.config, step_policy=StepMode(policy))
    consumer = EmsScheduler(dataclasses.replace(ctx, role=KvRole.CONSUMER, config=config), events)
    try:
        if policy == "in_step":  # the policy places a lookup in the step once it has measured one
            consumer.lookups.policy.record_lookup(0.0001)
        a = Request("a", PROMPT)
        assert answer(sched, a) == 0
        sched.update_state_after_alloc(a, Blocks([0, 1, 2, 3]), 0)
        meta = sched.build_connector_meta(Schedule.prefill(a, [0, 1, 2, 3]))  # the forward ran; no copy-out yet
        b = Request("b", PROMPT, kv_transfer_params={"ems_blocks": 3, "ems_model_id": ctx.model_id})
        started = time.monotonic()
        assert waits_for(consumer, b, 0.3)
        waited = time.monotonic() - started
        asks = ctx.stats.totals().lookup_save_waits
        assert 2 <= asks <= waited / IDLE_WAIT_S + 2
        assert sum(r["wait_s"] for r in consumer.steps.records()) > waited / 2  # asleep, not spinning
        worker.wait_for_save(meta)
        assert worker.wait_saves(10)
        landed = time.monotonic()
        while (tokens := consumer.get_num_new_matched_tokens(b, 0)[0]) is None and time.monotonic() - landed < 5:
            consumer.build_connector_meta(Schedule())
        assert tokens == 3 * BLOCK and time.monotonic() - landed < 0.5  # (in_step: loaded in the step it is admitted)
    finally:
        consumer.shutdown()


def test_a_wait_for_blocks_that_never_arrive_is_bounded_by_save_wait_ms(halves):
    ctx, _, _, _, events = halves
    config = dataclasses.replace(ctx.config, save_wait_ms=400)
    consumer = EmsScheduler(dataclasses.replace(ctx, role=KvRole.CONSUMER, config=config), events)
    try:
        announced = {"ems_blocks": 3, "ems_model_id": ctx.model_id}
        started = time.monotonic()
        b = Request("b", PROMPT, kv_transfer_params=announced)
        assert waits_for(consumer, b, 0.2)
        assert answer(consumer, b) == 0  # the producer's save never came: computed, not waited on forever
        assert 0.4 <= time.monotonic() - started < 5
        # another namespace's announcement is not waited for at all
        other = Request("c", PROMPT, kv_transfer_params={**announced, "ems_model_id": "another-model"})
        started = time.monotonic()
        assert answer(consumer, other) == 0 and time.monotonic() - started < 0.4
    finally:
        consumer.shutdown()


def test_a_request_waits_for_a_prefix_this_engine_is_saving(halves):
    """kv_both: request a's blocks were sent to be saved and are still being copied out; request c (the same
    prefix, not in vLLM's local cache) waits for them instead of recomputing."""
    _, sched, worker, _, _ = halves
    a = Request("a", PROMPT)
    assert answer(sched, a) == 0
    sched.update_state_after_alloc(a, Blocks([0, 1, 2, 3]), 0)
    meta = sched.build_connector_meta(Schedule.prefill(a, [0, 1, 2, 3]))
    c = Request("c", PROMPT)
    assert waits_for(sched, c, 0.3)
    worker.wait_for_save(meta)
    assert worker.wait_saves(10)
    assert answer(sched, c) == 3 * BLOCK


def test_save_wait_ms_0_never_waits(halves):
    ctx, _, _, _, events = halves
    config = ConnectorConfig.from_extra({"local_pool": "off", "save_wait_ms": 0})
    consumer = EmsScheduler(dataclasses.replace(ctx, role=KvRole.CONSUMER, config=config), events)
    try:
        b = Request("b", PROMPT, kv_transfer_params={"ems_blocks": 3, "ems_model_id": ctx.model_id})
        assert answer(consumer, b) == 0
        assert ctx.stats.totals().lookup_save_waits == 0
    finally:
        consumer.shutdown()


def test_each_step_is_recorded(halves):
    """The per-step record (`steps`): the scheduler's lookups, loads and saves sent, its waits; the worker's loads
    started and finished, copy-outs queued and the seconds its calls took."""
    _, sched, worker, _, _ = halves
    save(sched, worker, Request("a", PROMPT), [0, 1, 2, 3])
    b = Request("b", PROMPT)
    assert answer(sched, b) == 3 * BLOCK
    sched.update_state_after_alloc(b, Blocks([8, 9, 10, 11]), 3 * BLOCK)
    step(sched, worker, Schedule())
    finish_load(worker, "b")
    records = sched.steps.records()
    assert sum(r["lookups_sent"] for r in records) == 2  # a's and b's, each in its step's batch
    assert sum(r["lookup_batches"] for r in records) == 2 and all(r["lookup_s"] >= 0 for r in records)
    assert [(r["loads_sent"], r["load_blocks"]) for r in records if r["loads_sent"]] == [(1, 3)]
    assert [r["save_blocks"] for r in records if r["save_blocks"]] == [3]
    assert any(r["lookups_waiting"] for r in records)  # told "ask again" while their batch ran
    assert [r["at_s"] for r in records] == sorted(r["at_s"] for r in records)
    done = worker.steps.records()
    assert sum(r["loads_started"] for r in done) == 1 and sum(r["loads_done"] for r in done) == 1
    assert sum(r["save_blocks"] for r in done) == 3
    assert all(r["call_s"] >= r["wait_s"] >= 0 for r in done) and sum(r["load_s"] for r in done) > 0


def admit_loading(sched: EmsScheduler, worker: EmsWorker, request: Request, blocks: list[int]) -> None:
    """Admit `request` with its pool hit, loading asynchronously, and send its load to the worker (not reported yet)."""
    hit = answer(sched, request)
    assert hit > 0
    sched.update_state_after_alloc(request, Blocks(blocks), hit)
    assert [x.req_id for x in step(sched, worker, Schedule()).loads] == [request.request_id]


def report_load(sched: EmsScheduler, worker: EmsWorker, req_id: str) -> set[int]:
    """The worker's report of the load, handed to the scheduler half as vLLM does (`update_connector_output`)."""
    failed = finish_load(worker, req_id)
    sched.update_connector_output(None, {req_id})
    return failed


def test_requests_sharing_a_prefix_wait_for_the_load_under_way_instead_of_loading_their_own(halves):
    """b's asynchronous load of three blocks a saved is under way: c and d (the same prefix; c with its own tail, in
    the pool too) are not admitted with their own copy but wait until b's load is reported. Then vLLM's prefix cache
    holds the prefix: c asks from past it and is answered at once (its first lookup told it), d has nothing past it,
    and the pool was read for the prefix once."""
    ctx, sched, worker, _, _ = halves
    tailed = PROMPT[: 3 * BLOCK] + list(range(900, 900 + 2 * BLOCK + 1))
    save(sched, worker, Request("a", tailed), [0, 1, 2, 4, 5, 6])  # the prefix (PROMPT's full blocks) and c's tail
    b, c, d = Request("b", PROMPT), Request("c", tailed), Request("d", PROMPT)
    assert sched.get_num_new_matched_tokens(c, 0) == (None, False)  # c and b are asked in one batch
    admit_loading(sched, worker, b, [8, 9, 10, 11])  # b's answer came first: it is admitted
    assert finish_load(worker, "b") == set()  # the worker is done; vLLM has not been told yet
    loaded = ctx.stats.totals().load_blocks
    assert waits_for(sched, d, 0.3)
    assert sched.get_num_new_matched_tokens(c, 0) == (None, False)
    assert any(r["load_waits"] for r in sched.steps.records())
    sched.update_connector_output(None, {"b"})
    # vLLM now caches b's blocks: c and d find the prefix locally and ask only for what lies beyond
    assert sched.get_num_new_matched_tokens(c, 3 * BLOCK) == (2 * BLOCK, True)  # no step in between: no new lookup
    assert sched.get_num_new_matched_tokens(d, 3 * BLOCK) == (0, False)  # nothing past the prefix
    c.num_computed_tokens = 3 * BLOCK
    sched.update_state_after_alloc(c, Blocks([8, 9, 10, 14, 15, 16]), 2 * BLOCK)
    assert [(x.req_id, x.block_ids) for x in step(sched, worker, Schedule()).loads] == [("c", [14, 15])]
    assert finish_load(worker, "c") == set()
    assert ctx.stats.totals().load_blocks - loaded == 2  # c's tail; the prefix was loaded once, by b


def test_an_answer_tells_later_starts_up_to_its_first_missing_block():
    """A request that waited for another's load asks from further on: the answer it had already tells it, without
    the network, for any start up to the first block it found missing, in the same epoch and while fresh."""
    answer_ = LookupAnswer(start=0, hits=5, asked=7, epoch=b"e", at=100.0)
    assert [answer_.hits_from(s, 7, b"e", 100.5, 1.0) for s in range(7)] == [5, 4, 3, 2, 1, 0, None]
    assert answer_.hits_from(3, 8, b"e", 100.5, 1.0) is None  # other blocks (a longer prompt)
    assert answer_.hits_from(3, 7, b"f", 100.5, 1.0) is None  # another epoch
    assert answer_.hits_from(3, 7, b"e", 101.5, 1.0) is None  # too old


def test_the_wait_for_another_requests_load_is_bounded_by_save_wait_ms(halves):
    """b's load is never reported: c waits `save_wait_ms` and then goes on by itself (its own lookup and load)."""
    ctx, other, worker, _, events = halves
    config = dataclasses.replace(ctx.config, save_wait_ms=400)
    sched = EmsScheduler(dataclasses.replace(ctx, config=config), events)
    try:
        save(other, worker, Request("a", PROMPT), [0, 1, 2, 3])  # another engine saved the prefix
        admit_loading(sched, worker, Request("b", PROMPT), [8, 9, 10, 11])
        c = Request("c", PROMPT)
        started = time.monotonic()
        assert waits_for(sched, c, 0.2)
        assert answer(sched, c) == 3 * BLOCK  # its own copy, once the wait is over
        assert 0.4 <= time.monotonic() - started < 5
    finally:
        sched.shutdown()


def test_a_failed_load_releases_the_requests_waiting_for_it(halves):
    """The pool loses a's blocks between b's lookup and b's load (a node died): b's load fails, and c, which waited
    for it, goes on at once (a lookup of its own, a miss), not at the end of its wait."""
    ctx, other, worker, _, events = halves
    config = dataclasses.replace(ctx.config, save_wait_ms=30_000)
    sched = EmsScheduler(dataclasses.replace(ctx, config=config), events)
    store = ctx.cc._pool.store  # the embedded pool's (EmbeddedPool)
    try:
        before = set(store.keys())
        save(other, worker, Request("a", PROMPT), [0, 1, 2, 3])  # another engine saved the prefix
        blocks = set(store.keys()) - before
        assert len(blocks) == 3
        b, c = Request("b", PROMPT), Request("c", PROMPT)
        hit = answer(sched, b)
        sched.update_state_after_alloc(b, Blocks([8, 9, 10, 11]), hit)
        for key in blocks:
            assert store.delete(key)
        step(sched, worker, Schedule())  # b's load goes to the worker
        assert waits_for(sched, c, 0.2)
        assert report_load(sched, worker, "b") == {8, 9, 10}  # vLLM recomputes them (or fails b, by its policy)
        started = time.monotonic()
        assert answer(sched, c) == 0  # released: the pool no longer holds the prefix
        assert time.monotonic() - started < 5
    finally:
        sched.shutdown()

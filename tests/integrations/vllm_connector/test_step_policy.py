"""The step policy (`ems.integrations.vllm.lookups.step_policy`): its decisions alone (random sequences of measurements and
requests: never in the step when forced asynchronous or with the breaker open, never past the step's bound), and
driven through the connector's halves with stand-ins for vLLM: on a fast pool a hit is looked up and loaded inside
the step (vLLM's synchronous path), on a hung pool node (SIGSTOPped) no step is held past the bound and the requests
go asynchronously."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from fake_vllm import BLOCK, Blocks, Events, Request, Schedule, kv_caches, make_context
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import step

from ems import Ems
from ems.integrations.connector_config import IN_STEP_LOAD_GRACE
from ems.integrations.local_pool import ensure_local_pool, stop_local_pool
from ems.integrations.vllm.lookups.step_policy import EWMA_WEIGHT, Placement, StepMode, StepPolicy
from ems.integrations.vllm.scheduler import EmsScheduler
from ems.integrations.vllm.worker import EmsWorker

PROMPT = list(range(100, 100 + 3 * BLOCK + 2))  # three full blocks and a partial one
BLOCK_BYTES = 1 << 20

# ---- the decisions alone ----

actions = st.one_of(
    st.tuples(st.just("lookup"), st.floats(0.0, 0.2), st.booleans()),  # a lookup thread's measurement
    st.tuples(st.just("transfer"), st.integers(0, 1 << 30), st.floats(0.0, 2.0)),  # workers' load bytes, seconds
    st.tuples(st.just("save"), st.integers(0, 1 << 30), st.floats(0.0, 2.0)),
    st.tuples(st.just("in_step"), st.integers(0, 1 << 30), st.floats(0.0, 2.0)),  # in-step phases' bytes, seconds
    st.tuples(st.just("ask"), st.floats(0.0, 1.0), st.booleans()),  # an in-step lookup: fraction of timeout used
    st.tuples(st.just("load"), st.integers(0, 200), st.booleans()),  # a hit of n blocks (breaker open?)
    st.tuples(st.just("ask_load"), st.integers(0, 200), st.sampled_from(["r0", "r1", "r2", "r3"])),  # of a request
    st.tuples(st.just("forget"), st.just(0), st.sampled_from(["r0", "r1", "r2", "r3"])),
    st.tuples(st.just("step"), st.just(0), st.just(False)),
)


@settings(max_examples=300, deadline=None)
@given(
    mode=st.sampled_from(list(StepMode)),
    budget_ms=st.integers(0, 200),
    script=st.lists(actions, max_size=60),
)
def test_decisions_never_exceed_the_bound_and_respect_the_mode(mode, budget_ms, script):
    policy = StepPolicy(mode, budget_ms / 1000, BLOCK_BYTES)
    breaker_open = False
    deferred_last: set[str] = set()  # requests put off in the step before this one (room held in this one)
    deferred_now: set[str] = set()
    for kind, a, b in script:
        if kind == "lookup":
            policy.record_lookup(a, timed_out=b)
        elif kind in ("transfer", "save", "in_step"):
            if kind == "transfer":
                policy.record_transfer(a, b)
            elif kind == "in_step":
                policy.record_transfer(a, b, in_step_bytes=a, in_step_s=b)  # (in-step loads are load jobs too)
            else:
                policy.record_transfer(0, 0.0, a, b)
        elif kind == "ask":
            breaker_open = b
            timeout = policy.lookup_timeout_s(breaker_open)
            if timeout is None:
                continue
            assert mode is not StepMode.ASYNC and not breaker_open
            assert timeout <= policy.left_s() + 1e-12 and timeout > 0
            if mode is StepMode.AUTO:  # only once a lookup was measured fast, and not marked slow
                assert policy.lookup_s is not None and not policy.slow
            used = a * timeout
            policy.spend_lookup(used, timed_out=a >= 0.95)
        elif kind == "load":
            decision = policy.decide_load(a, b)
            assert decision.placement is not Placement.NEXT_STEP  # (no request named: never put off)
            if decision.placement is Placement.IN_STEP:
                assert mode is not StepMode.ASYNC and not b and a > 0
                if mode is StepMode.AUTO:
                    assert policy.rate_Bps is not None
        elif kind == "ask_load":
            was_put_off = b in deferred_last
            decision = policy.decide_load(a, breaker_open, b)
            if decision.placement is not Placement.ASYNC:
                assert mode is not StepMode.ASYNC and not breaker_open and a > 0
            if decision.placement is Placement.NEXT_STEP:
                assert not was_put_off  # at most one step in a row
                assert decision.predicted_s * 2 <= policy.budget_s + 1e-9  # it fits a whole step
                deferred_now.add(b)
            deferred_last.discard(b)
        elif kind == "forget":
            policy.forget(b)
            deferred_last.discard(b)
            deferred_now.discard(b)
        else:
            policy.begin_step()
            deferred_last, deferred_now = deferred_now, set()
        # the step's in-step work (lookups measured, loads predicted) and the room it holds for requests put off
        # from the last step never pass the bound; nor does the room promised to the next
        assert policy.spent_s + policy.held_s() <= policy.budget_s + 1e-9
        assert sum(policy._promised.values()) <= policy.budget_s + 1e-9


def test_auto_waits_for_measurements_and_backs_off_a_slow_pool():
    policy = StepPolicy(StepMode.AUTO, 0.05, BLOCK_BYTES)
    assert policy.lookup_timeout_s(False) is None  # nothing measured: asynchronous
    assert policy.decide_load(4).placement is Placement.ASYNC
    policy.record_lookup(0.0005)
    assert policy.lookup_timeout_s(False) == pytest.approx(0.05)
    assert policy.lookup_timeout_s(True) is None  # breaker open
    policy.record_transfer(0, 0.0, 100 * BLOCK_BYTES, 0.1)  # saves at 1 GB/s stand in for the load rate
    assert policy.decide_load(10).placement is Placement.IN_STEP  # ~10 ms predicted, 20 ms reserved
    assert policy.decide_load(20).placement is Placement.ASYNC  # ~42 ms reserved: past the 30 ms left
    policy.record_transfer(BLOCK_BYTES, 1.0)  # a measured load at 1 MB/s replaces the stand-in
    policy.begin_step()
    assert policy.decide_load(1).placement is Placement.ASYNC
    policy.spend_lookup(0.05, timed_out=True)  # an in-step lookup used its whole timeout
    policy.begin_step()
    assert policy.slow and policy.lookup_timeout_s(False) is None
    policy.record_lookup(0.0005)  # the lookup thread finds the pool fast again
    assert not policy.slow and policy.lookup_timeout_s(False) is not None
    forced = StepPolicy(StepMode.IN_STEP, 0.05, BLOCK_BYTES)
    assert forced.lookup_timeout_s(False) == pytest.approx(0.05) and forced.decide_load(3).placement is Placement.IN_STEP
    assert StepPolicy(StepMode.ASYNC, 0.05, BLOCK_BYTES).lookup_timeout_s(False) is None


def test_the_rate_follows_in_step_loads_and_a_slow_job_beside_a_forward_does_not_drag_it_down():
    policy = StepPolicy(StepMode.AUTO, 0.05, BLOCK_BYTES)
    policy.record_transfer(100 * BLOCK_BYTES, 0.1, in_step_bytes=100 * BLOCK_BYTES, in_step_s=0.1)  # ~1 GB/s
    measured = policy.rate_Bps
    assert measured == pytest.approx(100 * BLOCK_BYTES / 0.1)
    # an asynchronous 1-block load that took 250 ms beside a forward: at most the rate, no news about it
    policy.record_transfer(BLOCK_BYTES, 0.25)
    assert policy.rate_Bps == measured
    assert policy.decide_load(10).placement is Placement.IN_STEP  # ~10 ms predicted, as the in-step loads showed
    # in-step loads that ran ten times slower move it down (a moving average, not at once)
    policy.record_transfer(10 * BLOCK_BYTES, 0.1, in_step_bytes=10 * BLOCK_BYTES, in_step_s=0.1)
    lowered = policy.rate_Bps
    assert lowered is not None and measured / 10 < lowered < measured
    # a job faster than the estimate shows the rate is at least that: it raises it
    policy.record_transfer(100 * BLOCK_BYTES, 0.05)
    assert policy.rate_Bps is not None and policy.rate_Bps > lowered
    # an in-step phase slower than its own jobs (the phase also settles the blocks): the phase is the rate, its
    # jobs' faster figure raises nothing
    phased = StepPolicy(StepMode.AUTO, 0.05, BLOCK_BYTES)
    phased.record_transfer(10 * BLOCK_BYTES, 0.01, in_step_bytes=10 * BLOCK_BYTES, in_step_s=0.1)
    assert phased.rate_Bps == pytest.approx(10 * BLOCK_BYTES / 0.1)
    phased.record_transfer(10 * BLOCK_BYTES, 0.01, in_step_bytes=10 * BLOCK_BYTES, in_step_s=0.2)
    assert phased.rate_Bps == pytest.approx((1 - EWMA_WEIGHT) * 10 * BLOCK_BYTES / 0.1 + EWMA_WEIGHT * 10 * BLOCK_BYTES / 0.2)
    # the first load measured of either kind sets the rate (here an asynchronous one)
    fresh = StepPolicy(StepMode.AUTO, 0.05, BLOCK_BYTES)
    fresh.record_transfer(BLOCK_BYTES, 0.25)
    assert fresh.rate_Bps == pytest.approx(BLOCK_BYTES / 0.25)


def test_a_hit_that_does_not_fit_this_step_waits_for_the_next_whose_bound_holds_room_for_it():
    policy = StepPolicy(StepMode.AUTO, 0.05, BLOCK_BYTES)
    policy.record_transfer(0, 0.0, in_step_bytes=BLOCK_BYTES, in_step_s=0.001)  # 1 ms a block: a block needs 2
    assert policy.decide_load(20, request_id="a").placement is Placement.IN_STEP  # 40 of the 50 ms
    put_off = policy.decide_load(10, request_id="b")  # 20 ms: not in the 10 left, in the next step's 50
    assert put_off.placement is Placement.NEXT_STEP and put_off.predicted_s == pytest.approx(0.01)
    assert policy.decide_load(10).placement is Placement.ASYNC  # no request named: never put off
    assert policy.decide_load(15, request_id="c").placement is Placement.NEXT_STEP  # 30 ms: the next step's rest
    assert policy.decide_load(1, request_id="d").placement is Placement.IN_STEP  # what fits this step still does
    assert policy.decide_load(5, request_id="e").placement is Placement.ASYNC  # the next step is promised
    assert policy.decide_load(30, request_id="f").placement is Placement.ASYNC  # 60 ms: no step holds it
    assert policy.step_deferred == 2 and policy.step_loads == 2
    policy.begin_step()
    assert policy.held_s() == pytest.approx(0.05) and policy.left_s() == 0.0  # b's and c's room: none for others
    assert policy.decide_load(1, request_id="g").placement is Placement.NEXT_STEP
    assert policy.decide_load(10, request_id="b").placement is Placement.IN_STEP  # its own room
    assert policy.left_s() == pytest.approx(0.0) and policy.held_s() == pytest.approx(0.03)  # c's
    policy.record_late_load(BLOCK_BYTES, 0.1)  # the rate fell a hundredfold: c no longer fits its room
    assert policy.decide_load(15, request_id="c").placement is Placement.ASYNC  # not put off twice in a row
    policy.begin_step()
    assert policy.held_s() == pytest.approx(0.002)  # g's, promised before the rate fell
    policy.forget("g")  # g ended: its room is free
    assert policy.held_s() == 0.0 and policy.left_s() == pytest.approx(0.05)
    # room held for a request that is not asked again lapses with the step
    lapsing = StepPolicy(StepMode.IN_STEP, 0.05, BLOCK_BYTES)
    lapsing.record_transfer(0, 0.0, in_step_bytes=BLOCK_BYTES, in_step_s=0.001)
    assert lapsing.decide_load(20, request_id="x").placement is Placement.IN_STEP
    assert lapsing.decide_load(10, request_id="y").placement is Placement.NEXT_STEP
    lapsing.begin_step()
    assert lapsing.left_s() == pytest.approx(0.03)  # y's 20 ms held
    lapsing.begin_step()  # y was not asked
    assert lapsing.left_s() == pytest.approx(0.05)
    # forced asynchronous: never put off
    never = StepPolicy(StepMode.ASYNC, 0.05, BLOCK_BYTES)
    never.record_transfer(0, 0.0, in_step_bytes=BLOCK_BYTES, in_step_s=0.001)
    assert never.decide_load(1, request_id="z").placement is Placement.ASYNC


# ---- through the halves ----


def answer(sched: EmsScheduler, request: Request) -> tuple[int, bool, int]:
    """`get_num_new_matched_tokens` until answered: (tokens, load_async, steps it took)."""
    for steps in range(1000):
        tokens, load_async = sched.get_num_new_matched_tokens(request, request.num_computed_tokens)
        if tokens is not None:
            return tokens, load_async, steps
        sched.build_connector_meta(Schedule())
    raise AssertionError("the lookup was never answered")


def compute_and_save(sched: EmsScheduler, worker: EmsWorker, request: Request, blocks: list[int]) -> None:
    tokens, _, _ = answer(sched, request)
    assert tokens == 0
    sched.update_state_after_alloc(request, Blocks(blocks), 0)
    step(sched, worker, Schedule.prefill(request, blocks))
    assert worker.wait_saves(10)
    sched.request_finished(request, blocks)
    worker.get_finished({request.request_id}, None)


def make_halves(**extra: object):
    ctx = make_context(**extra)
    caches = kv_caches(ctx.num_blocks)
    worker = EmsWorker(ctx)
    worker.register_kv_caches(caches, 0, {"CPU_ATTN"})
    sched = EmsScheduler(ctx, Events())
    return ctx, sched, worker, caches


@pytest.mark.parametrize("mode", ["auto", "in_step"])
def test_a_fast_pool_looks_up_and_loads_inside_the_step(mode):
    # (a bound far above what the embedded pool takes, so a busy host does not send the request asynchronously)
    ctx, sched, worker, caches = make_halves(step_policy=mode, in_step_ms=5000)
    try:
        compute_and_save(sched, worker, Request("a", PROMPT), [0, 1, 2, 3])
        # vLLM hands the workers' statistics to the scheduler each step: the measured rates
        sched.update_connector_output(ctx.stats.drain().to_dict())
        b = Request("b", PROMPT)
        tokens, load_async, steps = answer(sched, b)
        # answered in the step it was asked in, to be loaded before the forward (vLLM's synchronous path)
        assert (tokens, load_async, steps) == (3 * BLOCK, False, 0)
        sched.update_state_after_alloc(b, Blocks([8, 9, 10, 11]), 3 * BLOCK)
        b.num_computed_tokens = 3 * BLOCK
        meta = step(sched, worker, Schedule.prefill(b, [8, 9, 10, 11]))  # b is scheduled in this same step
        assert [(x.req_id, x.block_ids, x.in_step) for x in meta.loads] == [("b", [8, 9, 10], True)]
        for layer in caches.values():  # loaded once start_load_kv returned: before the forward
            assert torch.equal(layer[8:11], layer[0:3])
        _, received = worker.get_finished(set(), meta)
        assert not received  # never reported as an asynchronous load
        assert worker.get_block_ids_with_load_errors() == set()
        record = sched.steps.records()[-1]
        assert record["in_step_loads"] == 1 and record["in_step_load_blocks"] == 3
        assert record["in_step_lookups"] == 1 and record["lookups_sent"] == 0
        assert worker.steps.records()[-1]["in_step_loads"] == 1
        assert worker.steps.records()[-1]["in_step_loads_late"] == 0
        # the policy's estimates the decision rested on: a rate and a lookup's latency, both measured
        assert record["policy_load_Bps"] > 0 and record["policy_lookup_s"] > 0
        assert meta.saves == []  # loaded blocks are not saved again
    finally:
        sched.shutdown()
        worker.shutdown()
        Ems.shutdown()


def test_a_hit_past_the_steps_room_is_loaded_in_the_next_step_and_its_prefix_waits_for_it():
    """Two saved prompts; the measured rate fits one 3-block load in a step, not two. The first hit loads in the
    step; the second is put off to the next step (not asynchronously: that costs at least two) and loads there,
    in the step; a third request sharing the second's prompt waits for that load rather than loading a copy."""
    ctx, sched, worker, caches = make_halves(step_policy="auto", in_step_ms=5000)
    other = [p + 1000 for p in PROMPT]
    try:
        compute_and_save(sched, worker, Request("a", PROMPT), [0, 1, 2, 3])
        compute_and_save(sched, worker, Request("c", other), [4, 5, 6, 7])
        sched.update_connector_output(ctx.stats.drain().to_dict())
        # measured: 3 blocks in 1.5 s (a load reserves twice that: 3 of the 5 s bound), lookups in milliseconds
        sched.lookups.policy.record_transfer(0, 0.0, in_step_bytes=3 * ctx.block_bytes, in_step_s=1.5)
        b, d, e = Request("b", PROMPT), Request("d", other), Request("e", other)
        assert sched.get_num_new_matched_tokens(b, 0) == (3 * BLOCK, False)  # in this step
        assert sched.get_num_new_matched_tokens(d, 0) == (None, False)  # the next step's
        assert sched.get_num_new_matched_tokens(e, 0) == (None, False)  # waits for d's load of their prompt
        sched.update_state_after_alloc(b, Blocks([8, 9, 10, 11]), 3 * BLOCK)
        b.num_computed_tokens = 3 * BLOCK
        step(sched, worker, Schedule.prefill(b, [8, 9, 10, 11]))
        record = sched.steps.records()[-1]
        assert (record["in_step_loads"], record["loads_deferred"], record["load_waits"]) == (1, 1, 1)
        assert record["lookups_waiting"] == 2
        # the next step: d first (vLLM puts the requests it skipped back in front), in the step, in its held room
        assert sched.lookups.policy.held_s() == pytest.approx(3.0)
        assert sched.get_num_new_matched_tokens(d, 0) == (3 * BLOCK, False)
        sched.update_state_after_alloc(d, Blocks([12, 13, 14, 15]), 3 * BLOCK)
        d.num_computed_tokens = 3 * BLOCK
        meta = step(sched, worker, Schedule.prefill(d, [12, 13, 14, 15]))
        assert [(x.req_id, x.block_ids, x.in_step) for x in meta.loads] == [("d", [12, 13, 14], True)]
        for layer in caches.values():  # loaded before the forward
            assert torch.equal(layer[12:15], layer[4:7])
        assert worker.get_block_ids_with_load_errors() == set()
        # e: vLLM's prefix cache now holds the prompt's blocks (d's in-step load is cached at once): nothing to load
        assert sched.get_num_new_matched_tokens(e, 3 * BLOCK) == (0, False)
    finally:
        sched.shutdown()
        worker.shutdown()
        Ems.shutdown()


def test_forced_async_keeps_the_asynchronous_path():
    ctx, sched, worker, _ = make_halves(step_policy="async")
    try:
        compute_and_save(sched, worker, Request("a", PROMPT), [0, 1, 2, 3])
        sched.update_connector_output(ctx.stats.drain().to_dict())
        tokens, load_async, steps = answer(sched, Request("b", PROMPT))
        assert tokens == 3 * BLOCK and load_async and steps >= 1
    finally:
        sched.shutdown()
        worker.shutdown()
        Ems.shutdown()


@pytest.fixture
def node(tmp_path):
    pool = ensure_local_pool(str(tmp_path), "64MiB")
    yield pool
    os.kill(pool.pid, signal.SIGCONT)
    Ems.shutdown()
    stop_local_pool(str(tmp_path))


def on_node(node) -> dict:
    """The halves' settings for the pool node `node`, every lookup and load in the step (within the bound)."""
    return {
        "local_pool": "off",
        "pool_nodes": [node.address],
        "access_id": node.access_id,
        "access_key": node.access_key,
        "step_policy": "in_step",
        "breaker_cooldown_s": 60.0,
    }


def hit_in_the_step(ctx, sched: EmsScheduler, worker: EmsWorker) -> Request:
    """Request "a" computed and saved, then "b" of the same prompt: a hit of 3 blocks, admitted to load in the step
    (vLLM's synchronous path) into blocks 8-10."""
    compute_and_save(sched, worker, Request("a", PROMPT), [0, 1, 2, 3])
    sched.update_connector_output(ctx.stats.drain().to_dict())
    # measured fast: the load fits the bound even when this busy host slowed the save that measured the rate
    sched.lookups.policy.record_transfer(1 << 30, 0.001)
    b = Request("b", PROMPT)
    tokens, load_async, _ = answer(sched, b)
    assert (tokens, load_async) == (3 * BLOCK, False)  # a hit, to be loaded in the step
    sched.update_state_after_alloc(b, Blocks([8, 9, 10, 11]), 3 * BLOCK)
    return b


def test_a_hung_node_holds_a_step_no_longer_than_the_grace(node):
    """The node stops answering after this engine measured it fast: the step's in-step lookups together end within
    `in_step_ms` and its in-step load within `IN_STEP_LOAD_GRACE` times it (the lookup thread's own timeout is 20
    times longer), the requests go asynchronously (or miss), and the load's blocks are reported failed (recomputed)."""
    bound_ms = 150
    ctx, sched, worker, _ = make_halves(**on_node(node), in_step_ms=bound_ms, lookup_timeout_ms=20 * bound_ms)
    try:
        b = hit_in_the_step(ctx, sched, worker)
        os.kill(node.pid, signal.SIGSTOP)
        started = time.monotonic()
        meta = step(sched, worker, Schedule.prefill(b, [8, 9, 10, 11]))
        load_s = time.monotonic() - started
        assert [x.in_step for x in meta.loads] == [True]
        assert worker.get_block_ids_with_load_errors() == {8, 9, 10}  # vLLM recomputes them
        worker.get_finished(set(), meta)  # closes the step's record
        late_step = worker.steps.records()[-1]
        assert (late_step["in_step_loads_late"], late_step["in_step_late_blocks"]) == (1, 3)
        # the load that ran out of its bound drops the measured rate at once: the next hit loads asynchronously
        late = ctx.stats.totals()
        assert late.load_late_bytes == 3 * ctx.block_bytes
        assert late.load_late_seconds >= 0.9 * IN_STEP_LOAD_GRACE * bound_ms / 1000  # it ran to its timeout
        sched.update_connector_output(ctx.stats.drain().to_dict())
        assert sched.lookups.policy.decide_load(3).placement is Placement.ASYNC
        # five new requests in one step: their in-step lookups share the step's bound; each is asked asynchronously
        # (its in-step lookup timed out) or misses at once (the client already counts the node as failing)
        started = time.monotonic()
        answers = [
            sched.get_num_new_matched_tokens(Request(f"c{i}", [i] + PROMPT), 0)
            for i in range(5)  # (other prompts: nothing of them is known)
        ]
        lookups_s = time.monotonic() - started
        assert set(answers) <= {(None, False), (0, False)}, answers
        sched.build_connector_meta(Schedule())
        record = sched.steps.records()[-1]
        assert record["lookups_sent"] == answers.count((None, False))
        # bounded by in_step_ms (150 ms; the load by twice it), not by the lookup thread's 3 s timeout nor the loads'
        # 5 s one; the margin is for a busy host, whose threads wake late (2 spinning processes on 2 cores: 0.28 s
        # for the lookups)
        within = 2 * bound_ms / 1000 + 0.5
        assert record["in_step_lookup_s"] < within, record
        assert load_s < IN_STEP_LOAD_GRACE * bound_ms / 1000 + 0.5 and lookups_s < within, (load_s, lookups_s)
    finally:
        os.kill(node.pid, signal.SIGCONT)
        sched.shutdown()
        worker.shutdown()


def test_a_load_slowed_past_the_bound_is_waited_for_not_recomputed(node):
    """The node pauses for 1.3 times `in_step_ms` while a step's in-step load runs: the load ends within its grace
    (twice the bound), its blocks arrive and nothing is recomputed; the step's record counts it late, and the
    policy measures it as every load job (not as a load that ran out, whose rate it would take at once)."""
    bound_ms = 200
    ctx, sched, worker, caches = make_halves(**on_node(node), in_step_ms=bound_ms)
    resume = threading.Timer(1.3 * bound_ms / 1000, os.kill, (node.pid, signal.SIGCONT))
    try:
        b = hit_in_the_step(ctx, sched, worker)
        os.kill(node.pid, signal.SIGSTOP)
        resume.start()
        meta = step(sched, worker, Schedule.prefill(b, [8, 9, 10, 11]))
        assert [x.in_step for x in meta.loads] == [True]
        assert worker.get_block_ids_with_load_errors() == set()  # loaded, not recomputed
        for layer in caches.values():
            assert torch.equal(layer[8:11], layer[0:3])
        worker.get_finished(set(), meta)
        record = worker.steps.records()[-1]
        assert (record["in_step_loads_late"], record["in_step_late_blocks"]) == (1, 0)
        assert record["in_step_load_s"] > bound_ms / 1000
        stats = ctx.stats.drain()
        assert (stats.load_late_bytes, stats.load_failed_blocks) == (0, 0)
        assert stats.load_bytes == 3 * ctx.block_bytes and stats.load_seconds > bound_ms / 1000
        # the in-step phase, as the policy's rate reads it: the blocks it loaded over the time it held the step
        assert stats.load_in_step_bytes == 3 * ctx.block_bytes and stats.load_in_step_seconds > bound_ms / 1000
    finally:
        resume.cancel()
        os.kill(node.pid, signal.SIGCONT)
        sched.shutdown()
        worker.shutdown()

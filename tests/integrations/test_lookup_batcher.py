"""lookup_batcher: a step's lookups answered in the background, one batch, each answer what a lookup of its own
would say, asking the pool for fewer blocks; a hung pool node never holds the caller. Through the real embedded
pool and a real pool node (SIGSTOPped)."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ems import CcConfig, CcKvOption, Ems, EmsConfig
from ems.integrations import kv_layouts
from ems.integrations.block_transfer import BlockMover, lookup
from ems.integrations.vllm.lookups.batcher import LookupBatcher, _Ask, answer_batch
from ems.integrations.vllm.lookups.breaker import LookupBreaker

BLOCKS = 8


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"batch-{i}".encode()).digest()


def register(cc) -> int:
    layers = [torch.zeros((BLOCKS, 2, 16, 64), dtype=torch.bfloat16) for _ in range(2)]
    planes = [kv_layouts.block_planes(layer, BLOCKS) for layer in layers]
    shapes = [kv_layouts.shape_of(p) for p in planes]
    cc.register_kvcache([list(p) for p in planes], kv_layouts.store_groups(shapes))
    return sum(s.block_bytes for s in shapes)


@pytest.fixture
def pool():
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="batcher"), pool_capacity="128MiB"))
    cc = Ems.get_cc()
    mover = BlockMover(cc, register(cc), inflight_budget=64)
    stored: set[int] = set()
    yield cc, mover, stored
    Ems.shutdown()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    in_pool=st.sets(st.integers(0, 39), max_size=40),
    requests=st.lists(st.lists(st.integers(0, 39), min_size=1, max_size=12, unique=True), min_size=1, max_size=8),
)
def test_a_batch_answers_what_each_lookup_alone_would_asking_each_block_at_most_once(pool, in_pool, requests):
    cc, mover, stored = pool
    new = sorted(in_pool - stored)
    for i in range(0, len(new), BLOCKS):  # the pool holds (at least) these blocks
        chunk = new[i : i + BLOCKS]
        assert mover.save_async(list(range(len(chunk))), [block_hash(k) for k in chunk])
        assert mover.wait(30)
    stored.update(new)
    held = stored  # every block saved by earlier examples is there too
    breaker = LookupBreaker(cc, 1, False, 2000, 1.0)
    asks = [_Ask(f"r{n}", tuple(block_hash(k) for k in keys), b"") for n, keys in enumerate(requests)]
    calls = cc.metrics()["exists_calls"]
    answers = answer_batch(asks, breaker)
    asked_calls = cc.metrics()["exists_calls"] - calls
    for ask, keys in zip(asks, requests):
        expected = next((i for i, k in enumerate(keys) if k not in held), len(keys))
        assert answers[ask.req_id] == expected == lookup(cc, list(ask.hashes), 1, False)
    distinct = {tuple(keys) for keys in requests}
    assert asked_calls <= len(distinct)
    # a request whose blocks another request of the batch already answered for costs no call
    longest = max(requests, key=len)
    if all(tuple(r) == tuple(longest[: len(r)]) for r in requests):
        assert asked_calls == 1


def test_with_leases_every_request_that_will_load_a_block_holds_its_own_lease(pool):
    """Two requests of one batch share a prefix: each holds a lease on it (each load ends one), so the first load
    does not leave the second one's blocks to eviction; a request known to miss at its first block asks nothing."""
    cc, mover, _ = pool
    shared = [block_hash(200 + i) for i in range(3)]
    assert mover.save_async([0, 1, 2], shared) and mover.wait(30)
    breaker = LookupBreaker(cc, 1, False, 2000, 1.0, lease_ms=30_000)
    store = cc._pool.store
    asks = [
        _Ask("long", (*shared, block_hash(250)), b""),
        _Ask("short", tuple(shared[:2]), b""),
        _Ask("other", (block_hash(250),), b""),
    ]
    calls = cc.metrics()["exists_calls"]
    assert answer_batch(asks, breaker) == {"long": 3, "short": 2, "other": 0}
    assert cc.metrics()["exists_calls"] - calls == 2  # "other" starts with the block "long" found missing
    assert mover.load([4, 5, 6], shared).loaded == 3  # the first request's load: the second's leases remain
    assert store.stats().leased_bytes > 0
    assert mover.load([4, 5], shared[:2]).loaded == 2
    assert store.stats().leased_bytes == 0


def test_the_background_thread_answers_dispatched_asks_and_drops_stale_ones(pool):
    cc, mover, _ = pool
    hashes = [block_hash(100 + i) for i in range(4)]
    assert mover.save_async([0, 1, 2], hashes[:3]) and mover.wait(30)
    batcher = LookupBatcher(LookupBreaker(cc, 1, False, 2000, 1.0))
    try:
        batcher.ask("a", hashes)
        batcher.ask("b", hashes[:2])
        assert batcher.asked("a") and batcher.answer("a") is None  # asked, not dispatched yet
        batcher.dispatch()
        batcher.wait(10)
        assert not batcher.pending()
        assert batcher.answer("a") == 3 and batcher.answer("b") == 2
        assert batcher.answer("a") is None  # taken once
        batcher.ask("c", hashes)
        batcher.dispatch()
        batcher.forget("c")  # the request finished: its answer is dropped
        batcher.wait(10)
        assert batcher.answer("c") is None and not batcher.asked("c")
    finally:
        batcher.close()


def test_a_hung_node_never_holds_the_caller_and_opens_the_breaker(tmp_path):
    from ems.integrations.local_pool import ensure_local_pool, stop_local_pool

    node = ensure_local_pool(str(tmp_path), "64MiB")
    try:
        Ems.init(
            EmsConfig(
                cc_config=CcConfig(rank_id=0, device_id=0, model_id="batcher-hung"),
                access_id=node.access_id,
                access_key=node.access_key,
                pool_nodes=[node.address],
                read_cache_capacity=0,
            )
        )
        cc = Ems.get_cc()
        mover = BlockMover(cc, register(cc), option=CcKvOption(timeout=2000))
        hashes = [block_hash(200 + i) for i in range(4)]
        assert mover.save_async([0, 1, 2, 3], hashes) and mover.wait(30)
        breaker = LookupBreaker(cc, 1, False, 600, 30.0)
        batcher = LookupBatcher(breaker)
        os.kill(node.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            batcher.ask("a", hashes)
            batcher.dispatch()
            assert batcher.answer("a") is None
            assert time.monotonic() - started < 0.2  # the caller never waited for the node
            batcher.wait(10)
            assert batcher.answer("a") == 0 and breaker.is_open()  # the lookup timed out: a miss, breaker open
            started = time.monotonic()
            batcher.ask("b", hashes)
            batcher.dispatch()
            batcher.wait(10)
            assert batcher.answer("b") == 0 and time.monotonic() - started < 0.3  # open: answered without the node
        finally:
            os.kill(node.pid, signal.SIGCONT)
            batcher.close()
            breaker.close()
    finally:
        Ems.shutdown()
        stop_local_pool(str(tmp_path))

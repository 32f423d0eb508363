"""lookup_breaker and the mover's in-flight budget against a real pool node that is SIGSTOPped (hung, its port still
accepting): one lookup costs its timeout, later ones answer at once until the node answers again; saves and loads
never wait for the hung node; a resumed node serves again."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from test_block_transfer import make_cache, register, vllm_hash

from ems import CcConfig, CcKvOption, Ems, EmsConfig
from ems.integrations.block_transfer import BlockMover
from ems.integrations.local_pool import ensure_local_pool, stop_local_pool
from ems.integrations.transfer_stats import StatsSink
from ems.integrations.vllm.lookups.breaker import LookupBreaker

LOOKUP_MS = 300
COOLDOWN_S = 0.5


@pytest.fixture
def node(tmp_path):
    pool = ensure_local_pool(str(tmp_path), "64MiB")
    Ems.init(
        EmsConfig(
            cc_config=CcConfig(rank_id=0, device_id=0, model_id="breaker"),
            pool_nodes=[pool.address],
            access_id=pool.access_id,
            access_key=pool.access_key,
            read_cache_capacity=0,
            max_inflight=4,
        )
    )
    yield pool
    os.kill(pool.pid, signal.SIGCONT)
    Ems.shutdown()
    stop_local_pool(str(tmp_path))


def timed(call):
    start = time.monotonic()
    out = call()
    return out, time.monotonic() - start


def test_a_hung_node_costs_one_lookup_timeout_then_nothing(node):
    cc = Ems.get_cc()
    _, planes, shapes = make_cache(torch.Generator().manual_seed(3))
    stats = StatsSink()
    mover = BlockMover(cc, register(cc, planes, shapes), option=CcKvOption(timeout=2000), stats=stats, inflight_budget=2)
    breaker = LookupBreaker(cc, 1, False, LOOKUP_MS, COOLDOWN_S, stats)
    try:
        check_breaker(node, cc, planes, mover, breaker, stats)
    finally:
        breaker.close()


def check_breaker(node, cc, planes, mover, breaker, stats):
    hashes = [vllm_hash(i) for i in range(4)]
    assert mover.save_async([0, 1, 2, 3], hashes) and mover.wait(30)
    assert breaker.lookup(hashes) == 4 and not breaker.is_open()
    os.kill(node.pid, signal.SIGSTOP)
    try:
        # a lookup of blocks still on their way to the pool (`trips=False`): its timeout is a short answer, the
        # breaker stays closed
        hits, waited = timed(lambda: breaker.lookup(hashes, trips=False))
        assert hits == 0 and not breaker.is_open() and LOOKUP_MS / 1000 * 0.9 <= waited < 5.0
        hits, first = timed(lambda: breaker.lookup(hashes))
        assert hits == 0 and breaker.is_open() and LOOKUP_MS / 1000 * 0.9 <= first < 5.0
        for _ in range(20):  # every later lookup: no network, no wait
            hits, later = timed(lambda: breaker.lookup(hashes))
            assert hits == 0 and later < 0.05
        # saves and loads never block the caller: at most two take the budget (the client may also fail them at
        # once, having marked the node down), the rest are dropped; a load finds no budget (None: retried on a
        # later step) or fails
        _, saving = timed(lambda: [mover.save_async([i], [vllm_hash(10 + i)]) for i in range(6)])
        assert saving < 1.0 and stats.totals().save_failed_blocks >= 4
        pending, starting = timed(lambda: mover.start_load([8], [hashes[0]]))
        assert starting < 0.5
        while pending is not None and (outcome := mover.poll_load(pending)) is None:
            time.sleep(0.01)
        if pending is not None:
            assert outcome.loaded == 0 and outcome.failed_block_ids == [8]
        assert stats.totals().lookup_skipped_blocks == 80 and stats.totals().breaker_trips == 1
    finally:
        os.kill(node.pid, signal.SIGCONT)
    assert mover.wait(10)  # the pending saves end (stored late, or timed out)
    deadline = time.monotonic() + 20
    while breaker.is_open() and time.monotonic() < deadline:  # the probe finds the node answering again
        time.sleep(0.05)
    assert not breaker.is_open() and breaker.lookup(hashes) == 4
    pending = mover.start_load([8, 9, 10, 11], hashes)
    assert pending is not None
    while (outcome := mover.poll_load(pending)) is None:
        time.sleep(0.01)
    assert outcome.loaded == 4 and outcome.failed_block_ids == []
    for src, dst in zip(range(4), range(8, 12)):
        for k, v in planes:
            assert torch.equal(k[dst], k[src]) and torch.equal(v[dst], v[src])

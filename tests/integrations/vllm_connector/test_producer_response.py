"""A producer's step and its saves (`producer_response`), against a real pool node that is SIGSTOPped (hung, its port
still accepting): with "after_save" the step (`wait_for_save`, before vLLM sends the step's outputs) returns only
once the pool has acknowledged the step's saves, so the blocks are there when the response leaves; a pool that does
not answer holds the step `producer_wait_ms` at most, once, and later steps do not wait until those saves have ended;
"immediate" and `kv_both` engines never wait."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest
from fake_vllm import block_hashes, kv_caches, make_context

from ems.integrations.block_transfer import lookup
from ems.integrations.connector_config import KvRole
from ems.integrations.local_pool import ensure_local_pool, stop_local_pool
from ems.integrations.vllm.metadata import BlockTransfer, EmsConnectorMetadata
from ems.integrations.vllm.worker import EmsWorker

HUNG_S = 0.4  # how long the node is stopped while a step waits for its saves


@pytest.fixture
def node(tmp_path):
    pool = ensure_local_pool(str(tmp_path), "64MiB")
    yield pool
    os.kill(pool.pid, signal.SIGCONT)
    stop_local_pool(str(tmp_path))


def producer(node, role: KvRole = KvRole.PRODUCER, **extra: object) -> EmsWorker:
    ctx = make_context(pool_nodes=[node.address], access_id=node.access_id, access_key=node.access_key, **extra)
    worker = EmsWorker(dataclasses.replace(ctx, role=role))
    worker.register_kv_caches(kv_caches(ctx.num_blocks), 0, set())
    return worker


def save_step(rid: str, first: int) -> tuple[EmsConnectorMetadata, list[bytes]]:
    """A step that computed a request's two blocks (`first`, `first + 1`)."""
    hashes = block_hashes(list(range(first * 100, first * 100 + 8)))
    return EmsConnectorMetadata(saves=[BlockTransfer(rid, [first, first + 1], hashes)]), hashes


def timed_step(worker: EmsWorker, meta: EmsConnectorMetadata) -> float:
    started = time.monotonic()
    worker.wait_for_save(meta)
    return time.monotonic() - started


def in_pool(worker: EmsWorker, hashes: list[bytes]) -> int:
    return lookup(worker._ctx.cc, hashes, 1, False)


def stopped_for(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    threading.Timer(seconds, os.kill, (pid, signal.SIGCONT)).start()


def test_a_producers_step_returns_once_the_pool_has_its_saves(node):
    worker = producer(node, producer_wait_ms=10_000)
    try:
        meta, hashes = save_step("a", 0)
        stopped_for(node.pid, HUNG_S)
        took = timed_step(worker, meta)
        assert HUNG_S * 0.9 <= took < 5.0  # it waited for the node's acknowledgement, not for its bound
        assert in_pool(worker, hashes) == 2  # the response leaves with the blocks in the pool
        assert worker._ctx.stats.totals().save_blocks == 2
        record = worker.get_finished({"a"}, EmsConnectorMetadata())  # copied out: released in the same step
        assert record[0] == {"a"}
        step = worker.steps.records()[-1]
        assert step["save_wait_s"] >= HUNG_S * 0.9 and step["save_waits_late"] == 0
    finally:
        worker.shutdown()


@pytest.mark.parametrize(("role", "response"), [(KvRole.PRODUCER, "immediate"), (KvRole.BOTH, "after_save")])
def test_immediate_producers_and_kv_both_engines_never_wait_for_the_pool(node, role, response):
    worker = producer(node, role, producer_response=response, producer_wait_ms=10_000)
    try:
        meta, hashes = save_step("a", 0)
        stopped_for(node.pid, HUNG_S)
        assert timed_step(worker, meta) < HUNG_S / 2
        assert worker.wait_saves(10) and in_pool(worker, hashes) == 2
        assert worker.steps.records() == [] or worker.steps.records()[-1]["save_wait_s"] == 0
    finally:
        worker.shutdown()


def test_a_hung_pool_holds_a_producers_step_at_most_its_bound_once(node):
    bound_s = 0.3
    worker = producer(node, producer_wait_ms=round(bound_s * 1000), timeout_ms=1500)
    try:
        os.kill(node.pid, signal.SIGSTOP)
        meta, _ = save_step("a", 0)
        first = timed_step(worker, meta)
        assert bound_s * 0.9 <= first < bound_s + 1.0  # the bound, then the step goes on
        worker.get_finished(set(), EmsConnectorMetadata())
        meta, _ = save_step("b", 2)
        assert timed_step(worker, meta) < bound_s / 2  # the late saves have not ended: no wait at all
        worker.get_finished(set(), EmsConnectorMetadata())
        records = worker.steps.records()
        assert [r["save_waits_late"] for r in records] == [1, 0]
        os.kill(node.pid, signal.SIGCONT)
        assert worker.wait_saves(10)  # stored late, or timed out
        # those saves have ended: the next step waits for its own again, and they are in the pool when it returns
        # (the client may count the node as down for a moment after its timeouts: a later step's, then)
        landed = []
        for i in range(12):
            meta, hashes = save_step(f"c{i}", 4 + 2 * i)
            timed_step(worker, meta)
            landed.append(in_pool(worker, hashes))
            if landed[-1] == 2:
                break
            time.sleep(0.5)
        assert landed[-1] == 2, landed
    finally:
        os.kill(node.pid, signal.SIGCONT)
        worker.shutdown()

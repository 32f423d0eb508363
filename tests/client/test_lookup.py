"""`exists` when pool nodes fail (`ems.datapath.jobs.lookup`): what it reports, and what it logs about the failed nodes.

Over real in-process stores behind `FaultyNode`s (no read cache in front of in-process nodes: every key is asked of
a node), one of them failing every call."""

from __future__ import annotations

import logging

import pytest
from ems_testlib import make_cache, slots_of_blocks
from fault_injection import FaultyNode

from ems import CcConfig, CcKvOption, ContextCaching, EmsConfig
from ems.backends.pool_client import PoolClient
from ems.settings import resolve_settings
from ems.store.kv_store import KvStore
from ems.transport.inprocess import InProcessNode

BS, BLOCKS = 4, 64
HASHES = [5000 + b for b in range(BLOCKS)]


def _saved(replicas: int, hedge: bool = False) -> tuple[list[FaultyNode], ContextCaching, PoolClient]:
    """Three nodes holding BLOCKS blocks, each on its `replicas` owners; the client and its pool. Unhedged by
    default: a hedge to a replica may answer before the failed node's error is seen, and then the call never
    learns of the failure (what these tests check is what it logs when it does)."""
    nodes = {f"n{i}:1": FaultyNode(InProcessNode(KvStore(64 << 20)), address=f"n{i}:1") for i in range(3)}
    pool = PoolClient(list(nodes.values()), replicas=replicas, connect=lambda address: nodes[address], hedge=hedge)
    cc = ContextCaching(
        CcConfig(rank_id=0, device_id=0, model_id="lookup"),
        None,
        pool,
        resolve_settings(EmsConfig(pool_replicas=replicas, pool_hedge=hedge)),
    )
    cc.register_kvcache(make_cache(layers=1, blocks=BLOCKS, block_size=BS))
    assert cc.save(slots_of_blocks(range(BLOCKS), BS), HASHES, [BS] * BLOCKS, CcKvOption(timeout=5000)).success == BLOCKS
    return list(nodes.values()), cc, pool


def _failure_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "ems" and "pool node(s) failed" in r.getMessage()]


def test_a_failed_node_whose_replicas_answered_is_no_warning(caplog):
    nodes, cc, pool = _saved(replicas=2)
    try:
        nodes[0].fail = True  # it owns about two thirds of the blocks; each has another owner
        with caplog.at_level(logging.INFO, logger="ems"):
            assert cc.exists(HASHES).success == BLOCKS
        (record,) = _failure_records(caplog)
        assert record.levelno == logging.INFO, record.getMessage()
        assert "other nodes (replicas) answered for their keys, all 64 found" in record.getMessage()
        assert "count as misses" not in record.getMessage()
    finally:
        cc.close()
        pool.close()


def test_a_failed_node_under_hedged_reads_is_never_a_warning(caplog):
    """Hedged, the replicas may answer before the failed node's error is in: then nothing is said, else an info."""
    for _ in range(5):
        nodes, cc, pool = _saved(replicas=2, hedge=True)
        try:
            nodes[0].fail = True
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="ems"):
                assert cc.exists(HASHES).success == BLOCKS
            assert all(r.levelno == logging.INFO for r in _failure_records(caplog)), caplog.text
        finally:
            cc.close()
            pool.close()


def test_a_failed_node_whose_keys_nobody_answered_is_a_warning(caplog):
    nodes, cc, pool = _saved(replicas=1)
    try:
        nodes[0].fail = True  # it owns about a third of the blocks, which have no other copy
        with caplog.at_level(logging.INFO, logger="ems"):
            assert cc.exists(HASHES).success < BLOCKS
        (record,) = _failure_records(caplog)
        assert record.levelno == logging.WARNING
        assert "no other node (replica) answered for count as misses" in record.getMessage()
        found = sum(cc.exists([h]).success for h in HASHES)
        assert f"({found} of {BLOCKS} keys found)" in record.getMessage(), (found, record.getMessage())
    finally:
        cc.close()
        pool.close()

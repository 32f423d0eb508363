"""No silent zero hits (`ems.client.namespaces`): engines of one model on one pool that differ in one namespace part
are told which part, once; an engine that hits, or whose tenant holds nothing else of its model, is told nothing; a
tenant never reads another's records. Several `ContextCaching` over one pool of two in-process nodes (`PoolClient`,
the pool engines of separate processes share) stand for several engines; the embedded pool, which no other engine
can share, gets no record."""

from __future__ import annotations

import logging

import pytest
import torch

from ems import CcConfig, CcKvOption, EmsConfig, KvBufferWrapper, PrimaryKey
from ems.backends.embedded import EmbeddedPool
from ems.backends.pool_client import PoolClient
from ems.client.context_caching import ContextCaching
from ems.settings import resolve_settings
from ems.store.kv_store import KvStore
from ems.store.ns_records import is_record_key
from ems.transport.inprocess import InProcessNode

BLOCK = 16


@pytest.fixture
def stores():
    return [KvStore(64 << 20), KvStore(64 << 20)]


@pytest.fixture
def engines(stores):
    made: list[ContextCaching] = []
    nodes = [InProcessNode(store) for store in stores]

    def make(tenant: str = "alpha", tp: int = 1, dtype: torch.dtype = torch.float32, model: str = "m") -> ContextCaching:
        config = CcConfig(rank_id=0, device_id=0, model_id=model, tp_world_size=tp)
        cc = ContextCaching(config, tenant, PoolClient(nodes), resolve_settings(EmsConfig(read_cache_capacity=0)))
        cc.register_kvcache([[torch.randn(8, BLOCK, 2, 16).to(dtype) for _ in range(2)] for _ in range(2)])
        made.append(cc)
        return cc

    yield make
    for cc in made:
        cc.close()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ems" and r.levelno == logging.WARNING]


def _records(stores: list[KvStore]) -> list[bytes]:
    lists = [store.keys() for store in stores]  # (lists, most recent last)
    return [k for held in lists for k in held if is_record_key(k)]


def _miss(cc: ContextCaching, n: int) -> None:
    for i in range(n):
        assert cc.exists([10_000 + i]).success == 0


@pytest.mark.parametrize("differ", ["tp_size", "dtype"])
def test_an_engine_that_never_hits_is_told_once_which_part_differs(engines, caplog, differ):
    first = engines()
    assert first.save(list(range(2 * BLOCK)), [1, 2], [BLOCK, BLOCK]).success == 2
    second = engines(tp=2) if differ == "tp_size" else engines(dtype=torch.float16)
    caplog.set_level(logging.WARNING, logger="ems")
    assert second.exists([1, 2]).success == 0  # the same hashes: another namespace
    _miss(second, 98)
    assert second.namespace_watch.thread is None  # 99 lookups: not yet
    _miss(second, 1)
    second.namespace_watch.thread.join(10)
    _miss(second, 200)  # more misses say nothing more
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    assert f"{differ}: this engine" in warned[0] and "model 'm'" in warned[0]
    other = {"tp_size": "dtype", "dtype": "tp_size"}[differ]
    assert f"{other}:" not in warned[0]
    assert second.namespace_watch.diagnosis == warned[0]


def test_the_first_minute_counts_as_well_as_the_first_hundred_lookups(engines, caplog):
    first = engines()
    assert first.save(list(range(BLOCK)), [1], [BLOCK]).success == 1
    second = engines(tp=4)
    second.namespace_watch.after_s = 0.0  # (a minute, shortened: the next lookup is past it)
    caplog.set_level(logging.WARNING, logger="ems")
    assert second.load(list(range(BLOCK)), [1], [BLOCK]).success == 0  # a V1 load counts as a lookup too
    second.namespace_watch.thread.join(10)
    assert len(_warnings(caplog)) == 1 and "tp_size" in _warnings(caplog)[0]


def test_an_engine_that_hits_or_has_no_other_namespace_is_told_nothing(engines, caplog):
    caplog.set_level(logging.WARNING, logger="ems")
    first = engines()
    assert first.save(list(range(BLOCK)), [1], [BLOCK]).success == 1
    _miss(first, 150)  # alone with its model: nothing to compare with
    first.namespace_watch.thread.join(10)
    assert first.namespace_watch.diagnosis is None
    twin = engines()  # the same namespace: it hits
    assert twin.exists([1]).success == 1
    _miss(twin, 150)
    assert twin.namespace_watch.thread is None
    other_model = engines(model="m2", tp=2)
    _miss(other_model, 100)
    other_model.namespace_watch.thread.join(10)
    assert other_model.namespace_watch.diagnosis is None
    assert _warnings(caplog) == []


def test_an_engine_that_started_first_is_told_once_the_other_namespace_appears(engines, caplog):
    caplog.set_level(logging.WARNING, logger="ems")
    early = engines(tp=2)
    _miss(early, 100)  # alone: nothing to say yet
    early.namespace_watch.thread.join(10)
    assert early.namespace_watch.diagnosis is None
    later = engines()
    assert later.save(list(range(BLOCK)), [1], [BLOCK]).success == 1
    _miss(early, 199)  # the next round is twice as long
    early.namespace_watch.thread.join(10)
    assert early.namespace_watch.diagnosis is None
    _miss(early, 1)
    early.namespace_watch.thread.join(10)
    _miss(early, 1000)
    warned = _warnings(caplog)
    assert len(warned) == 1 and "tp_size: this engine 2, the other 1" in warned[0]


def test_v0_lookups_are_not_observed(engines):
    cc = engines()
    buf = torch.zeros(64, dtype=torch.uint8)
    option = CcKvOption(write_rcache=False)
    for i in range(120):
        assert cc.exists([PrimaryKey("d", f"a{i}")], option).success == 0
        assert cc.load(option, [PrimaryKey("d", f"a{i}")], [[KvBufferWrapper(buf.data_ptr(), 64)]]).success == 0
    assert cc.namespace_watch.thread is None and not cc.namespace_watch.settled


def test_a_tenant_never_reads_another_tenants_records(engines, stores, caplog):
    alpha = engines("alpha")
    assert alpha.save(list(range(BLOCK)), [1], [BLOCK]).success == 1
    beta = engines("beta", tp=2)  # differs from alpha's engine in one part, but is another tenant
    caplog.set_level(logging.WARNING, logger="ems")
    assert [r.namespace for r in beta.namespace_watch.others()] == [beta.namespace_watch.record().namespace]
    _miss(beta, 100)
    beta.namespace_watch.thread.join(10)
    assert beta.namespace_watch.diagnosis is None and _warnings(caplog) == []
    records = _records(stores)
    assert len(records) == 2  # one per tenant, under keys of their own


def test_a_record_is_written_once_per_namespace_and_again_when_it_changes(engines, stores):
    first = engines()
    before = _records(stores)
    engines()  # the same namespace and parts: nothing new
    assert _records(stores) == before
    first.describe_namespace(parts={"epoch": "e1"})
    (record,) = first.namespace_watch.others()
    assert record.parts["epoch"] == "e1" and record.parts["tp_size"] == "1"


def test_the_embedded_pool_gets_no_record_and_no_diagnosis():
    store = KvStore(16 << 20)
    cc = ContextCaching(CcConfig(rank_id=0, device_id=0, model_id="m"), None, EmbeddedPool(store), resolve_settings(EmsConfig()))
    try:
        cc.register_kvcache([[torch.randn(8, BLOCK, 2, 16) for _ in range(2)] for _ in range(2)])
        _miss(cc, 150)
        assert store.keys() == [] and cc.namespace_watch.thread is None
    finally:
        cc.close()

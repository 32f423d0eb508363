"""Namespace records on a Mooncake Store (`ems.store.ns_records`): a record is an ordinary value under the Mooncake key
of its record key (`ems/` + hex), so an engine of one tenant that differs from another of the same model in one part
is told which, and another tenant's engine, whose record keys differ by the tenant in their digest, sees none of it.
Runs where Mooncake's package is installed (the vLLM venv); skipped otherwise."""

from __future__ import annotations

import logging

import torch

from ems import CcConfig, EmsConfig
from ems.backends.mooncake import mooncake_key
from ems.client.api import connect_pool
from ems.client.context_caching import ContextCaching
from ems.settings import resolve_settings
from ems.store.ns_records import decode_record, record_keys

BLOCK = 16


def _engine(mooncake, tenant: str, tp: int, made: list) -> ContextCaching:
    config = EmsConfig(access_id=tenant, **mooncake.settings())
    settings = resolve_settings(config)
    pool = connect_pool(config, settings)
    cc = ContextCaching(CcConfig(rank_id=0, device_id=0, model_id="moon-ns", tp_world_size=tp), tenant, pool, settings)
    made.append((cc, pool))
    cc.register_kvcache([[torch.randn(8, BLOCK, 2, 16) for _ in range(2)] for _ in range(2)])
    return cc


def test_records_on_mooncake_name_the_differing_part_within_a_tenant_only(mooncake, caplog):
    made: list = []
    try:
        first = _engine(mooncake, "alpha", 1, made)
        assert first.save(list(range(2 * BLOCK)), [1, 2], [BLOCK, BLOCK]).success == 2
        second = _engine(mooncake, "alpha", 2, made)
        beta = _engine(mooncake, "beta", 2, made)
        caplog.set_level(logging.WARNING, logger="ems")
        for i in range(100):
            assert second.exists([1, 2] if i == 0 else [500 + i]).success == 0
            assert beta.exists([1, 2] if i == 0 else [500 + i]).success == 0
        second.namespace_watch.thread.join(15)
        beta.namespace_watch.thread.join(15)
        warned = [r.getMessage() for r in caplog.records if r.name == "ems" and r.levelno == logging.WARNING]
        assert len(warned) == 1 and "tp_size: this engine 2, the other 1" in warned[0], warned
        assert beta.namespace_watch.diagnosis is None  # alpha's namespaces are not beta's to see

        # where the record lives: the Mooncake key of its record key (a raw Mooncake client reads it back)
        from mooncake.store import MooncakeDistributedStore

        raw = MooncakeDistributedStore()
        assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", mooncake.master) == 0
        try:
            found = [decode_record(bytes(raw.get(mooncake_key(k)) or b"")) for k in record_keys("alpha", "moon-ns")]
            assert {r.parts["tp_size"] for r in found if r is not None} == {"1", "2"}
            beta_found = [decode_record(bytes(raw.get(mooncake_key(k)) or b"")) for k in record_keys("beta", "moon-ns")]
            assert [r.parts["tp_size"] for r in beta_found if r is not None] == ["2"]
        finally:
            raw.close()
    finally:
        for cc, pool in made:
            cc.close()
            pool.close()

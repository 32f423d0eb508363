"""No silent zero hits through a real pool node: engines publish their namespace records to the node, an engine of
one tenant that differs from another of the same model in one part is told which (its log and `ems-pool status
--namespaces`), another tenant sees none of it, and the node counts lookups per namespace under capped labels."""

from __future__ import annotations

import logging
import urllib.request

import pytest
import torch
from cluster_testlib import free_port
from pool_testlib import KEY_A, KEY_B, PoolProcess

from ems import CcConfig, EmsConfig
from ems.client.api import connect_pool
from ems.client.context_caching import ContextCaching
from ems.pool import status
from ems.settings import resolve_settings

pytest.importorskip("prometheus_client")
pytest.importorskip("ucxx")
BLOCK = 16
KEYS = {"alpha": KEY_A, "beta": KEY_B}


@pytest.fixture(scope="module")
def node():
    metrics = f"127.0.0.1:{free_port()}"
    proc = PoolProcess("64MiB", KEYS, args=["--metrics", metrics])
    proc.metrics = metrics
    yield proc
    proc.cleanup()


@pytest.fixture
def engines(node):
    made: list[tuple[ContextCaching, object]] = []

    def make(tenant: str, tp: int = 1) -> ContextCaching:
        config = EmsConfig(access_id=tenant, access_key=KEYS[tenant], pool_nodes=[node.address], read_cache_capacity=0)
        settings = resolve_settings(config)
        pool = connect_pool(config, settings)
        cc = ContextCaching(CcConfig(rank_id=0, device_id=0, model_id="ns-model", tp_world_size=tp), tenant, pool, settings)
        cc.register_kvcache([[torch.randn(8, BLOCK, 2, 16) for _ in range(2)] for _ in range(2)])
        made.append((cc, pool))
        return cc

    yield make
    for cc, pool in made:
        cc.close()
        pool.close()  # type: ignore[attr-defined]


def test_two_engines_differing_in_tp_are_told_which_part_in_their_log_and_in_status(node, engines, caplog, capsys):
    first = engines("alpha")
    assert first.save(list(range(4 * BLOCK)), [1, 2, 3, 4], [BLOCK] * 4).success == 4
    second = engines("alpha", tp=2)
    beta = engines("beta")  # alpha's first engine's twin, in another tenant
    caplog.set_level(logging.WARNING, logger="ems")
    for i in range(100):
        assert second.exists([1, 2] if i == 0 else [1000 + i]).success == 0
    second.namespace_watch.thread.join(15)
    warned = [r.getMessage() for r in caplog.records if r.name == "ems" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "tp_size: this engine 2, the other 1" in warned[0], warned

    # beta's engine is told nothing of alpha's namespaces: its lookups miss, its records are its own
    assert beta.exists([1, 2, 3, 4]).success == 0
    assert [r.namespace for r in beta.namespace_watch.others()] == [beta.namespace_watch.record().namespace]

    assert status.main(["--nodes", node.metrics, "--namespaces"]) == 0
    out = capsys.readouterr().out
    alpha_part, beta_part = out.split("tenant beta")
    first_ns = first.namespace_watch.record().namespace.hex()[:16]
    second_ns = second.namespace_watch.record().namespace.hex()[:16]
    assert "tenant alpha: 2 namespace(s)" in alpha_part and beta_part.startswith(": 1 namespace(s)")
    assert first_ns in alpha_part and second_ns in alpha_part and first_ns not in beta_part
    rows = {line.split()[0]: line.split() for line in alpha_part.splitlines() if line.strip()[:16] in (first_ns, second_ns)}
    assert rows[first_ns][1:3] == ["ns-model", "4"]  # model, values held
    assert rows[second_ns][1:5] == ["ns-model", "0", "101", "0.0%"]  # 100 lookups, the first of two keys
    assert f"differs from {first_ns}: tp_size (2 vs 1)" in alpha_part
    assert "tp_size=2" in alpha_part and "tp_size=1" in beta_part and "differs" not in beta_part


def test_the_node_counts_lookups_per_namespace(node, engines):
    cc = engines("alpha")
    assert cc.save(list(range(BLOCK)), [77], [BLOCK]).success == 1
    for _ in range(3):
        assert cc.exists([77, 78]).success == 1
    ns = cc.namespace_watch.record().namespace.hex()
    with urllib.request.urlopen(f"http://{node.metrics}/metrics", timeout=5) as r:
        text = r.read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        (s.name, s.labels.get("tenant"), s.labels.get("namespace")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("ems_pool_namespace_")
    }
    assert samples[("ems_pool_namespace_lookups_total", "alpha", ns[:16])] >= 6
    assert samples[("ems_pool_namespace_hits_total", "alpha", ns[:16])] >= 3


def test_ems_pool_help_names_status_and_its_namespace_listing(capsys):
    from ems.pool.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "ems-pool status" in text and "--namespaces" in text
    with pytest.raises(SystemExit):
        status.main(["--help"])
    assert "--namespaces" in capsys.readouterr().out

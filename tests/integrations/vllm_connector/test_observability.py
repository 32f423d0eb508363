"""EmsConnector's Prometheus counters through vLLM's connector metrics (`build_prom_metrics`), on a real
prometheus_client registry; KV events are checked in a real engine (test_vllm_engine.py)."""

from __future__ import annotations

import functools
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def test_prometheus_counters_add_up_what_the_stats_carry():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from ems.integrations.transfer_stats import TransferStats
    from ems.integrations.vllm import EmsConnector

    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    from vllm.config import VllmConfig

    prom = EmsConnector.build_prom_metrics(VllmConfig(), types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe(TransferStats(load_blocks=3, load_bytes=300, breaker_trips=1).to_dict(), engine_idx=0)
    prom.observe(TransferStats(load_blocks=2, save_blocks=5).to_dict(), engine_idx=0)
    prom.observe(TransferStats(load_blocks=7).to_dict(), engine_idx=1)

    def value(name: str, engine: str) -> float | None:
        return registry.get_sample_value(f"vllm:ems_{name}_total", {"model_name": "m", "engine": engine})

    assert value("load_blocks", "0") == 5 and value("load_blocks", "1") == 7
    assert value("load_bytes", "0") == 300 and value("save_blocks", "0") == 5 and value("breaker_trips", "0") == 1
    assert value("save_blocks", "1") == 0

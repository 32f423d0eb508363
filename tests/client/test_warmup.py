"""Registering a CPU cache warms the small call's path (`ems.client.warmup`) without touching anything of the user's:
the cache's bytes, the pool's keys, the metrics; a warm-up that fails never fails the
registration."""

from __future__ import annotations

import logging

import pytest
import torch
from ems_testlib import make_cache

from ems import Ems
from ems.client.warmup import warm_small_calls
from ems.datapath.jobs import EmbeddedSave
from ems.datapath.layout import register_layout


def _store_keys() -> list[bytes]:
    return list(Ems._pool.store._entries)


@pytest.mark.parametrize("interleaved", [False, True])
def test_registration_warms_without_writing_anything(cc, interleaved: bool) -> None:
    cache = make_cache(layers=2, blocks=6, block_size=4, interleaved=interleaved)
    before = [[t.view(torch.uint8).clone() for t in layer] for layer in cache]
    metrics = cc.metrics()
    cc.register_kvcache(cache)
    assert all(torch.equal(t.view(torch.uint8), b) for layer, bl in zip(cache, before) for t, b in zip(layer, bl))
    assert _store_keys() == [] and cc.metrics() == metrics  # nothing in the pool, no call counted
    assert (0, 4) in cc.layout.one_run_plans  # the first block's plan was built (arithmetic: nothing read)
    # the calls themselves are unchanged: a save and a load round-trip
    assert cc.save(list(range(8)), [1, 2], [4, 4]).success == 2
    fresh = [[torch.zeros_like(t) for t in layer] for layer in cache]
    cc.register_kvcache(fresh)
    assert cc.load(list(range(8, 16)), [1, 2], [4, 4]).success == 2
    for got, want in zip(fresh, cache):
        for g, w in zip(got, want):
            assert torch.equal(g[2:4].view(torch.uint8), w[0:2].view(torch.uint8))


def test_split_planes_and_odd_shapes_warm_too() -> None:
    """MLA-like planes of different row sizes and dtypes: the scratch cache mirrors the first and last plane."""
    k = torch.randn(4, 3, 1, 10).to(torch.bfloat16)
    v = torch.randn(4, 3, 1, 6)
    layout = register_layout([[k, v]])
    warm_small_calls(layout, _torch_backend())
    assert (0, 3) in layout.one_run_plans


def test_a_failing_warm_up_leaves_registration_working(cc, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    def broken(self) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(EmbeddedSave, "begin", broken)
    with caplog.at_level(logging.WARNING, logger="ems.client.warmup"):
        cc.register_kvcache(make_cache(layers=1, blocks=4, block_size=4))
    assert "warming" in caplog.text
    monkeypatch.undo()
    assert cc.save(list(range(4)), [7], [4]).success == 1


def _torch_backend():
    from ems.kernels.torch_backend import TorchBackend

    return TorchBackend()

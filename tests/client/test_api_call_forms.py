"""Runs `api_call_forms.exercise` (the call forms mypy checks against the overloads): each one works."""

from __future__ import annotations

import torch
from api_call_forms import exercise
from ems_testlib import make_cache

from ems import CcResult


def test_every_typed_call_form_works(cc):
    cc.register_kvcache(make_cache(layers=1, blocks=4, block_size=2))
    buffer = torch.arange(64, dtype=torch.uint8)
    results = exercise(cc, buffer)
    assert all(isinstance(r, CcResult) and r.success == r.total for r in results), results

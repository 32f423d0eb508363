"""Fixtures of tests/integrations: no EMS_* settings and no initialised `Ems` around each test."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_ems(clean_ems, monkeypatch):
    monkeypatch.delenv("EMS_LOCAL_POOL_DIR", raising=False)
    yield

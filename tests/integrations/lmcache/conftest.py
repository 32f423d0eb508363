"""tests/integrations/lmcache: LMCache's own loaders against real pool nodes.

LMCache's metrics logger sets `PROMETHEUS_MULTIPROC_DIR` (to a fixed /tmp directory) in the process that builds it;
each test here puts the variable back as it was, so that the vLLM servers later tests start do not inherit it and add
their counters to one shared directory."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _lmcache_leaves_the_metrics_directory_as_it_was() -> Iterator[None]:
    before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    yield
    if before is None:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    else:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = before

"""Fixtures of tests/compat: a clean `Ems` per test, and the pool the engine talks to (embedded, or two real
pool-node processes on 127.0.0.1)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pool"))

from pool_testlib import PoolProcess, pool_nodes  # noqa: F401


@pytest.fixture(autouse=True)
def _isolated_ems(clean_ems):
    yield


@pytest.fixture(scope="module")
def two_nodes():
    """Two anonymous pool nodes shared by a module's tests (each test uses its own keys)."""
    nodes = [PoolProcess("256MiB") for _ in range(2)]
    yield nodes
    for node in nodes:
        node.cleanup()


@pytest.fixture(params=["embedded", "nodes"])
def pool(request) -> list[str] | None:
    """None for the embedded pool, else the addresses of two real pool nodes."""
    if request.param == "embedded":
        return None
    try:
        import ucxx  # noqa: F401
    except ImportError:
        pytest.skip("ucxx is not installed: no real pool nodes")
    return [n.address for n in request.getfixturevalue("two_nodes")]

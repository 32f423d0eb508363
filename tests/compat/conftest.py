"""Fixtures of tests/compat: a clean `Ems` per test, and the pool the engine talks to (embedded, two real
pool-node processes on 127.0.0.1, or a real Mooncake Store on 127.0.0.1)."""

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


@pytest.fixture(params=["embedded", "nodes", "mooncake"])
def pool(request, monkeypatch) -> list[str] | None:
    """None for the embedded pool; the addresses of two real pool nodes; or, for Mooncake, [] (no nodes) with
    `EMS_POOL_BACKEND=mooncake` and `EMS_MOONCAKE_MASTER` in the environment, as a deployment would set them (the
    adapters pass no pool settings of their own)."""
    if request.param == "embedded":
        return None
    if request.param == "mooncake":
        store = request.getfixturevalue("mooncake")
        monkeypatch.setenv("EMS_POOL_BACKEND", "mooncake")
        monkeypatch.setenv("EMS_MOONCAKE_MASTER", store.master)
        return []
    try:
        import ucxx  # noqa: F401
    except ImportError:
        pytest.skip("ucxx is not installed: no real pool nodes")
    return [n.address for n in request.getfixturevalue("two_nodes")]

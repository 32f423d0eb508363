"""Shared fixtures. Never imports triton and never sets TRITON_INTERPRET (tests/kernels has its own conftest)."""

from __future__ import annotations

import os

import pytest

from ems import Ems

_EMS_ENV = (
    "EMS_POOL_NODES",
    "EMS_POOL_CAPACITY",
    "EMS_READ_CACHE_CAPACITY",
    "EMS_STAGING_CAPACITY",
    "EMS_MAX_INFLIGHT",
    "EMS_KERNEL_BACKEND",
    "EMS_CONNECT_TIMEOUT_MS",
    "EMS_DEVICE",
)


@pytest.fixture(autouse=True)
def _clean_ems_env(monkeypatch):
    """Every test starts with no EMS_* settings in the environment and no initialised `Ems`, and leaves none."""
    for name in _EMS_ENV:
        monkeypatch.delenv(name, raising=False)
    Ems.shutdown()
    yield
    Ems.shutdown()


@pytest.fixture
def fault_node_factory():
    """Build `FaultyNode`s around embedded stores; releases any injected hang at teardown."""
    from fault_injection import FaultyNode
    from ems.store import KvStore
    from ems.transport.inprocess import InProcessNode

    made: list = []

    def make(capacity: int = 64 << 20, address=None) -> FaultyNode:
        node = FaultyNode(InProcessNode(KvStore(capacity)), address)
        made.append(node)
        return node

    yield make
    for node in made:
        node.release()

"""Fixtures shared by every test folder. Never imports triton and never sets TRITON_INTERPRET (tests/kernels has
its own conftest for that)."""

from __future__ import annotations

import pytest

EMS_SETTING_ENV = (
    "EMS_POOL_NODES",
    "EMS_POOL_CAPACITY",
    "EMS_READ_CACHE_CAPACITY",
    "EMS_STAGING_CAPACITY",
    "EMS_MAX_INFLIGHT",
    "EMS_KERNEL_BACKEND",
    "EMS_CONNECT_TIMEOUT_MS",
    "EMS_DEVICE",
    "EMS_POOL_ETCD",
    "EMS_POOL_CLUSTER",
    "EMS_POOL_REPLICAS",
    "EMS_POOL_SHM",
    "EMS_POOL_BACKEND",
    "EMS_MOONCAKE_MASTER",
    "EMS_MOONCAKE_METADATA",
    "EMS_MOONCAKE_PROTOCOL",
    "EMS_MOONCAKE_DEVICES",
    "EMS_MOONCAKE_HOSTNAME",
    "EMS_MOONCAKE_BUFFER",
    "EMS_MOONCAKE_SEGMENT",
)


@pytest.fixture
def clean_ems(monkeypatch):
    """No EMS_* pool settings in the environment and no initialised `Ems`, before and after the test."""
    from ems import Ems

    for name in EMS_SETTING_ENV:
        monkeypatch.delenv(name, raising=False)
    Ems.shutdown()
    yield
    Ems.shutdown()


@pytest.fixture
def fault_node_factory():
    """Build `FaultyNode`s (tests/fault_injection.py) around embedded stores; releases injected hangs at teardown."""
    from fault_injection import FaultyNode

    from ems.store.kv_store import KvStore
    from ems.transport.inprocess import InProcessNode

    made: list = []

    def make(capacity: int = 64 << 20, address=None) -> FaultyNode:
        node = FaultyNode(InProcessNode(KvStore(capacity)), address)
        made.append(node)
        return node

    yield make
    for node in made:
        node.release()


@pytest.fixture(scope="session")
def mooncake_store():
    """A Mooncake Store on 127.0.0.1 (tests/mooncake_testlib.py) shared by the session; skips, saying why, when
    Mooncake's package is not installed."""
    from mooncake_testlib import MooncakeCluster, mooncake_missing

    reason = mooncake_missing()
    if reason is not None:
        pytest.skip(reason)
    cluster = MooncakeCluster()
    yield cluster
    cluster.close()


@pytest.fixture
def mooncake(mooncake_store):
    """The session's Mooncake Store, emptied for this test."""
    mooncake_store.clear()
    yield mooncake_store

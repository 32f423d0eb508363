"""Fixtures of tests/ems."""

from __future__ import annotations

import pytest

from ems import CcConfig, Ems, EmsConfig


@pytest.fixture(autouse=True)
def _isolated_ems(clean_ems):
    """Every test here starts without EMS_* settings in the environment and without an initialised `Ems`."""
    yield


@pytest.fixture
def cc():
    """An initialised embedded SDK (64 MiB pool); shut down after the test."""
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="test-model"), pool_capacity="64MiB"))
    yield Ems.get_cc()
    Ems.shutdown()


@pytest.fixture
def faulty(fault_node_factory):
    """(cc, node): a `ContextCaching` over one `FaultyNode(InProcessNode(KvStore))`."""
    from ems_testlib import direct_cc

    node = fault_node_factory()
    client = direct_cc([node])
    yield client, node
    client.close()

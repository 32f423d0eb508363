"""Fixtures of the SDK-level test folders (tests/client, tests/datapath, tests/backends, tests/store): each folder's
conftest imports them, so they apply there and nowhere else."""

from __future__ import annotations

import pytest

from ems import CcConfig, Ems, EmsConfig


@pytest.fixture(autouse=True)
def _isolated_ems(clean_ems):
    """Every test here starts without EMS_* settings in the environment and without an initialised `Ems`."""
    yield


@pytest.fixture
def cc(request):
    """An initialised SDK, shut down after the test: on the embedded pool (64 MiB), or, for a test marked
    `@on_both_pools` (ems_testlib), on each backend in turn: embedded, then a real Mooncake Store on 127.0.0.1
    (`pool_backend="mooncake"`; skipped, saying why, without Mooncake's package)."""
    settings: dict = {"pool_capacity": "64MiB"}
    if getattr(request, "param", "embedded") == "mooncake":
        settings = request.getfixturevalue("mooncake").settings()
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="test-model"), **settings))
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

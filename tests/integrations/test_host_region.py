"""`ems.integrations.host_region`: the engine plug-ins' shared part, without an engine (the embedded pool)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ems import CcKvOption
from ems.integrations.host_region import HostRegion, chunk_hash, close_client, open_client, plugin_config


@pytest.fixture
def client():
    cc = open_client(plugin_config("test", {"local_pool": "off", "pool_capacity": "32MiB"}), "host-region-test")
    yield cc
    close_client(cc)


def test_runs_of_slots_round_trip_byte_exact(client):
    unit = 256
    memory = torch.randint(0, 256, (64 * unit,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    region = HostRegion(client, memory, unit, slots_per_value=4)
    option = CcKvOption(write_rcache=False)
    starts, lengths = [0, 5, 11, 20], [4, 1, 3, 4]
    original = memory.clone()
    assert region.save([11, 12, 13, 14], starts, lengths, option).success == 4
    memory.zero_()
    assert region.load([11, 12, 13, 14], starts, lengths, option).success == 4
    for s, n in zip(starts, lengths):
        assert torch.equal(memory[s * unit : (s + n) * unit], original[s * unit : (s + n) * unit])
    assert int(memory[4 * unit : 5 * unit].sum()) == 0  # nothing outside the runs was written
    # a run read into other slots, and a miss ends the prefix
    assert region.load([13, 99, 11], [40, 50, 60], [3, 1, 4], option).success == 1
    assert torch.equal(memory[40 * unit : 43 * unit], original[11 * unit : 14 * unit])
    assert region.exists([11, 12, 99, 13], option) == 2


def test_slot_mapping_of_runs():
    slots, runs = HostRegion._slots([7, 2, 30], [2, 3, 1])
    assert slots.tolist() == [7, 8, 2, 3, 4, 30] and runs.tolist() == [2, 3, 1]
    slots, runs = HostRegion._slots(np.array([4, 9]), 1)
    assert slots.tolist() == [4, 9] and runs.tolist() == [1, 1]


def test_chunk_hash_is_deterministic_and_keeps_v1_ints():
    assert chunk_hash(12345) == 12345
    assert chunk_hash(b"abc") == chunk_hash(bytearray(b"abc")) == chunk_hash("abc")
    assert chunk_hash(b"abc") != chunk_hash(b"abd") and 0 <= chunk_hash(b"abc") < 2**256
    with pytest.raises(TypeError):
        chunk_hash(1.5)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"timeout_ms": "x"}, "my.slot.timeout_ms"),
        ({"pool_nodes": ["bad"]}, "pool_nodes"),
        ({"step_policy": "auto"}, "step_policy"),
    ],
)
def test_plugin_config_names_the_key(extra, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        plugin_config("my.slot", extra)

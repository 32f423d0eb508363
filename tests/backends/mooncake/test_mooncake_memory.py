"""The Mooncake backend's registered memory (`ems.backends.mooncake.memory`), without a store: the registry's
coverage against a brute-force check, and where a call's bytes go: a value that lies inside one registered region
is read from (or placed at) its own address, every other one goes through the bounce buffer with its bytes intact,
and a receive's bounced values are copied out only where they were placed."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ems.backends.mooncake.memory import RegisteredMemory, Registry
from ems.backends.mooncake.workers import Workers
from ems.kernels.host_copy import address_of


@pytest.mark.parametrize("seed", range(5))
def test_registry_covers_exactly_the_ranges_inside_one_region(seed):
    """`Registry.covers` against a brute-force check, over random disjoint regions and random ranges."""
    rng = np.random.default_rng(seed)
    registry = Registry()
    regions = []
    at = int(rng.integers(0, 1000))
    for _ in range(int(rng.integers(0, 8))):
        size = int(rng.integers(1, 500))
        regions.append((at, at + size))
        registry.add(at, size)
        at += size + int(rng.integers(0, 50))  # adjacent regions too (gap 0): a range across both is not covered
    if regions and rng.random() < 0.5:
        start, _ = regions.pop(int(rng.integers(0, len(regions))))
        registry.remove(start)
    addresses = rng.integers(0, at + 100, 400).astype(np.int64)
    sizes = rng.integers(0, 300, 400).astype(np.int64)
    want = np.array([any(lo <= a and a + n <= hi for lo, hi in regions) for a, n in zip(addresses, sizes)])
    assert (registry.covers(addresses, sizes) == want).all()


def _bytes_at(address: int, nbytes: int) -> bytes:
    return ctypes.string_at(address, nbytes)


@pytest.fixture(scope="module")
def memory():
    """A `RegisteredMemory` whose store is not set up (nothing is registered with Mooncake: the tests register
    regions in its registry themselves)."""
    workers = Workers(1, "test-memory")
    memory = RegisteredMemory(lambda: None, workers)
    yield memory
    memory.clear()
    workers.close()


# each value: (parts' sizes, whether its bytes lie in the registered region)
value_specs = st.lists(st.tuples(st.lists(st.integers(0, 300), min_size=1, max_size=3), st.booleans()), max_size=12)


@settings(max_examples=60, deadline=None)
@given(specs=value_specs, seed=st.integers(0, 2**32 - 1))
def test_a_put_reads_registered_values_in_place_and_bounces_the_rest_intact(memory, specs, seed):
    rng = np.random.default_rng(seed)
    region = np.zeros(8192, dtype=np.uint8)  # "registered": its range is in the registry while the test runs
    base = address_of(region)
    memory.registry.add(base, region.size)
    try:
        values, at = [], 0
        for sizes, registered in specs:
            parts = []
            for size in sizes:
                data = rng.integers(0, 256, size, dtype=np.uint8)
                if registered and len(sizes) == 1:
                    region[at : at + size] = data
                    parts.append(region[at : at + size])
                    at += size
                else:
                    parts.append(data.tobytes())
            values.append(parts)
        sizes = np.array([sum(len(memoryview(p)) for p in v) for v in values], dtype=np.int64)
        placement = memory.sources(values, sizes)
        for i, parts in enumerate(values):
            joined = b"".join(bytes(p) for p in parts)
            assert _bytes_at(int(placement.addresses[i]), len(joined)) == joined, i
            in_place = len(parts) == 1 and isinstance(parts[0], np.ndarray)
            if in_place:
                assert int(placement.addresses[i]) == address_of(parts[0])  # zero copy
        bounced = [i for i, parts in enumerate(values) if not (len(parts) == 1 and isinstance(parts[0], np.ndarray))]
        assert (placement.bounce is None) == (not bounced)
        memory.give_back(placement, returned=True)
        assert memory.bounce.leased_bytes == 0
    finally:
        memory.registry.remove(base)


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(1, 300), st.booleans(), st.booleans()), max_size=12),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_receive_places_into_registered_outs_and_copies_bounced_ones_out_where_placed(memory, specs, seed):
    """Each out: (size, registered, placed by the store). The store's placing is done here by writing the value at
    the address the placement names, as Mooncake's `batch_get_into` does."""
    rng = np.random.default_rng(seed)
    region = np.zeros(8192, dtype=np.uint8)
    base = address_of(region)
    memory.registry.add(base, region.size)
    try:
        outs, at = [], 0
        for size, registered, _ in specs:
            if registered:
                outs.append(region[at : at + size])
                at += size
            else:
                outs.append(np.zeros(size, dtype=np.uint8))
        for out in outs:
            out[:] = 0xEE  # poison
        sizes = np.array([out.size for out in outs], dtype=np.int64)
        placement = memory.targets(outs, sizes)
        data = [rng.integers(0, 256, out.size, dtype=np.uint8) for out in outs]
        placed = np.array([p for _, _, p in specs], dtype=bool)
        for i in np.flatnonzero(placed).tolist():
            ctypes.memmove(int(placement.addresses[i]), data[i].ctypes.data, data[i].size)
        memory.copy_back(placement, outs, sizes, placed)
        for i, (out, (_, registered, was_placed)) in enumerate(zip(outs, specs)):
            if registered:
                assert int(placement.addresses[i]) == address_of(out)  # straight into the caller's buffer
            if was_placed:
                assert np.array_equal(out, data[i]), i
            else:
                assert (out == 0xEE).all(), i  # nothing written where the store placed nothing
        memory.give_back(placement, returned=False)  # a call that did not return: retired, never reused
        assert memory.bounce.leased_bytes == 0
    finally:
        memory.registry.remove(base)

"""A node's shared-memory copies through its store (`put_copied_each`, `read_into`), on DRAM alone and on DRAM in
front of a disk: a good value is stored as its source's bytes, a damaged one is refused, every reservation comes
back, and a load's copies land exactly at their offsets."""

from __future__ import annotations

import numpy as np
import pytest
from pool_testlib import joined, make_values

from ems.pool.disk_tier import DiskTier
from ems.pool.tiered_store import TieredStore
from ems.store.kv_store import KvStore


@pytest.fixture(params=["dram", "tiered"])
def store(request, tmp_path):  # type: ignore[no-untyped-def]
    if request.param == "dram":
        made = KvStore(64 << 20)
        yield made
        made.close()
        return
    disk = DiskTier(str(tmp_path), 64 << 20, 64 << 20)
    disk.open()
    tiered = TieredStore(64 << 20, disk, min_read_bytes=0)
    yield tiered
    tiered.close()


def test_put_copied_each_stores_the_good_copies_and_refuses_the_damaged(store):
    values = [np.frombuffer(joined(v), dtype=np.uint8).copy() for v in make_values(6, (256 << 10) + 7, seed=5)]
    values[2][-1] ^= 1  # a payload byte
    values[4][0] ^= 1  # the magic
    region = np.zeros(sum(v.size + 64 for v in values), dtype=np.uint8)  # the sources lie in one region, unaligned
    sources, at = [], 3
    for value in values:
        region[at : at + value.size] = value
        sources.append(region[at : at + value.size])
        at += value.size + 61
    keys = [b"k%d" % i for i in range(len(values))]
    charges = [store.charge_of(len(k), v.size) for k, v in zip(keys, values)]
    buffers = [store.allocate(v.size, reserve=c) for v, c in zip(values, charges)]
    assert store.put_copied_each(keys, buffers, sources, charges) == [True, True, False, True, False, True]
    region[:] = 0  # the client writes its region again: what was stored is the node's copy
    got = store.get_many(keys)
    for i, (value, stored) in enumerate(zip(values, got)):
        if i in (2, 4):
            assert stored is None
        else:
            assert bytes(stored) == value.tobytes()
    used = store.stats().used_bytes
    assert used == sum(c for i, c in enumerate(charges) if i not in (2, 4))  # the refused reservations came back


def test_read_into_copies_each_value_to_its_offset(store):
    values = [joined(v) for v in make_values(4, (300 << 10) + 1, seed=9)]
    keys = [b"r%d" % i for i in range(len(values))]
    sources = [np.frombuffer(v, dtype=np.uint8) for v in values]
    charges = [store.charge_of(len(k), len(v)) for k, v in zip(keys, values)]
    buffers = [store.allocate(len(v), reserve=c) for v, c in zip(values, charges)]
    assert store.put_copied_each(keys, buffers, sources, charges) == [True] * len(values)
    found = store.get_many(keys)
    region = np.full(sum(len(v) for v in values) + 400, 0xEE, dtype=np.uint8)
    offsets = [5 + i * (len(values[0]) + 90) for i in range(len(values))]
    store.read_into(found, [region[o : o + len(v)] for o, v in zip(offsets, values)])
    expected = np.full_like(region, 0xEE)
    for offset, value in zip(offsets, values):
        expected[offset : offset + len(value)] = np.frombuffer(value, dtype=np.uint8)
    assert np.array_equal(region, expected)

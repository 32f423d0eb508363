"""`DiskTier` in process, driven as `TieredStore` drives it (a put invalidates the key, an eviction submits the key's
newest value), by random sequences of puts, evictions, lookups, waits for the writer and restarts on the same
directory, against a model: a lookup returns the key's newest value exactly or a miss, never an older value, never
another key's; what was invalidated is a miss until submitted again; `contains_many` agrees with the model where the
model is sure; the bytes on the disk stay within the capacity."""

from __future__ import annotations

import os
import random
import time

import pytest
from pool_testlib import joined, make_values

from ems.pool.disk import DiskTier
from ems.pool.disk.records import ALIGN

KEYS = [f"tenant/{i}".encode() for i in range(10)]


def _drained(disk: DiskTier, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while disk.stats().queued_values and time.monotonic() < deadline:
        time.sleep(0.005)
    assert disk.stats().queued_values == 0, "the writer did not drain the queue"


def _file_bytes(root) -> int:
    return sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(root) for name in names)


@pytest.mark.parametrize("seed", range(4))
def test_random_puts_evictions_lookups_and_restarts_against_a_model(tmp_path, seed):
    rng = random.Random(seed)
    values = [joined(v) for size in (3000, 9000, 20000) for v in make_values(4, size, seed=seed * 10 + size)]
    capacity = 24 * ALIGN  # a few records: writing evicts
    disk = DiskTier(str(tmp_path), capacity, queue_bytes=16 * ALIGN)  # a small ring: some evictions are dropped
    disk.open()
    newest: dict[bytes, bytes] = {}  # key -> its newest value (a put)
    stale: set[bytes] = set()  # keys put and not submitted since: the tier must miss them
    writes = hits = 0
    try:
        for step in range(160):
            key = rng.choice(KEYS)
            op = rng.random()
            if op < 0.25:  # a put of a new value: the tier's copy is stale from now on
                disk.invalidate(key)
                newest[key] = rng.choice(values)
                stale.add(key)
            elif op < 0.55 and key in newest:  # DRAM evicts the key's newest value
                disk.submit(key, newest[key])
                stale.discard(key)
            elif op < 0.85:
                found, token = disk.lookup(key)
                if found is not None:
                    assert key in newest and key not in stale, (step, key)
                    assert bytes(found) == newest[key], (step, key, "an older or another key's value")
                    assert disk.still_current(key, token)
                elif key in stale or key not in newest:
                    assert not disk.contains_many([key])[0], (step, key)
            elif op < 0.95:
                _drained(disk)
                assert _file_bytes(tmp_path) <= capacity
                held = disk.contains_many(KEYS)
                for k, flag in zip(KEYS, held):
                    assert not (flag and (k in stale or k not in newest)), (step, k)
            else:  # a restart on the same directory (graceful or not: a queued value may be lost either way)
                stats = disk.stats()
                writes, hits = writes + stats.writes, hits + stats.hits
                assert stats.integrity_errors == 0 and stats.io_errors == 0
                disk.close()
                disk = DiskTier(str(tmp_path), capacity, queue_bytes=16 * ALIGN)
                disk.open()
        stats = disk.stats()
        assert stats.integrity_errors == 0 and stats.io_errors == 0
        assert writes + stats.writes > 0 and hits + stats.hits > 0
    finally:
        disk.close()

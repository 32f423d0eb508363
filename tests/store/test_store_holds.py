"""Holds in the store (`ems.store.index.Holds`, `KvStore.hold_many`) and through the public `exists`: random sequences of
puts, lookups with leases or pins, reads and deletes against a model (a held key is never evicted while the store
can make room otherwise, a read ends one lease holder, a replaced value drops its holds, budgets hold), and the
embedded pool's `exists(..., lease_ms=..., pin=True)` with its argument checks."""

from __future__ import annotations

import time

import numpy as np
import pytest
from ems_testlib import make_cache, on_both_pools, slots_of_blocks
from hypothesis import given, settings
from hypothesis import strategies as st

from ems import CcKvOption, Ems, EmsErrorCode, EmsException
from ems.store.kv_store import ENTRY_OVERHEAD, KvStore
from ems.transport.exists_holds import Hold

CAPACITY = 64 << 10
KEYS = [f"k{i}".encode() for i in range(24)]

put = st.tuples(st.just("put"), st.sampled_from(KEYS), st.integers(2 << 10, 12 << 10))
ops = st.lists(
    st.one_of(
        put,
        put,  # as often as the rest: the store keeps evicting
        st.tuples(st.just("lease"), st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)),
        st.tuples(st.just("pin"), st.lists(st.sampled_from(KEYS), min_size=1, max_size=2)),
        st.tuples(st.just("get"), st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)),
        st.tuples(st.just("delete"), st.sampled_from(KEYS)),
    ),
    min_size=20,
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_sequences_keep_every_held_key(sequence):
    store = KvStore(CAPACITY, verify_on_put=False)
    leases: dict[bytes, int] = {}  # key -> holders the model expects
    pins: set[bytes] = set()
    for op in sequence:
        kind = op[0]
        if kind == "put":
            _, key, size = op
            assert store.put(key, [np.full(size, 7, np.uint8)])
            leases.pop(key, None)  # holds belong to the value it replaced
            pins.discard(key)
        elif kind in ("lease", "pin"):
            keys = op[1]
            present = store.contains_many(keys)
            kept = store.hold_many(keys, Hold.lease(60_000) if kind == "lease" else Hold.pin())
            for key, there, ok in zip(keys, present, kept):
                assert ok <= there  # never kept what is not there
                if ok and kind == "lease":
                    leases[key] = leases.get(key, 0) + 1
                elif ok:
                    pins.add(key)
        elif kind == "get":
            for key, value in zip(op[1], store.get_many(op[1])):
                if value is not None and key in leases:
                    leases[key] -= 1
                    if leases[key] == 0:
                        del leases[key]
        else:
            store.delete(op[1])
            leases.pop(op[1], None)
            pins.discard(op[1])
        held = sorted(set(leases) | pins)
        assert store.contains_many(held) == [True] * len(held), "a held key was evicted"
        stats = store.stats()
        assert stats.used_bytes + stats.spare_bytes <= CAPACITY
        assert stats.leased_bytes <= CAPACITY // 2 and stats.pinned_bytes <= CAPACITY // 64
        assert stats.held_evictions == 0  # values this small always leave room among the unheld


def test_a_store_full_of_held_keys_still_takes_a_value_within_its_capacity():
    store = KvStore(CAPACITY, verify_on_put=False)
    size = CAPACITY // 4 - 64 - ENTRY_OVERHEAD
    keys = [b"a", b"b", b"c", b"d"]
    for key in keys:
        assert store.put(key, [np.zeros(size, np.uint8)])
    assert store.hold_many(keys, Hold.lease(60_000)) == [True, True, False, False]  # half the capacity, no more
    assert store.put(b"e", [np.zeros(size, np.uint8)])
    assert store.contains_many(keys) == [True, True, False, True]  # c went: the oldest unheld
    assert store.put(b"big", [np.zeros(CAPACITY - 200, np.uint8)])  # only by evicting the held ones too
    stats = store.stats()
    assert stats.held_evictions == 2 and stats.leased_bytes == 0
    assert stats.used_bytes <= CAPACITY


def test_an_expired_lease_no_longer_keeps_its_key():
    store = KvStore(CAPACITY, verify_on_put=False)
    size = CAPACITY // 8
    assert store.put(b"old", [np.zeros(size, np.uint8)])
    assert store.hold_many([b"old"], Hold.lease(50)) == [True]
    time.sleep(0.2)
    for i in range(16):
        assert store.put(f"n{i}".encode(), [np.zeros(size, np.uint8)])
    assert store.contains_many([b"old"]) == [False]


@on_both_pools
def test_public_exists_with_a_lease_or_a_pin(cc):
    """`exists(..., lease_ms=N)` counts the blocks the pool keeps for the load; `pin=True` the ones it pins. The
    embedded pool does both; Mooncake leases every object its exists finds by itself (its master's lease) and cannot
    pin one it already holds (its pins are set at put), so `pin=True` finds none there."""
    bs = 4
    cache = make_cache(layers=2, blocks=8, block_size=bs)
    cc.register_kvcache(cache)
    hashes = [101, 102, 103, 104]
    assert cc.save(slots_of_blocks([0, 1, 2, 3], bs), hashes, [bs] * 4).success == 4
    assert cc.exists(hashes, CcKvOption(), lease_ms=5000).success == 4
    assert cc.exists([999] + hashes, lease_ms=5000).success == 0
    pinned = cc.exists(hashes, pin=True).success
    settings = Ems.settings()
    assert settings is not None
    assert pinned == (0 if settings.pool_backend.value == "mooncake" else 4)
    assert cc.load(slots_of_blocks([4, 5, 6, 7], bs), hashes, [bs] * 4).success == 4
    bad_arguments = (
        {"lease_ms": 0},
        {"lease_ms": 60_001},
        {"lease_ms": True},
        {"lease_ms": 5.0},
        {"pin": "yes"},
        {"lease_ms": 5, "pin": True},
        {"lease": 5},
    )
    for kwargs in bad_arguments:
        with pytest.raises(EmsException) as error:
            cc.exists(hashes, **kwargs)
        assert error.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT

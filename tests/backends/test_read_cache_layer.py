"""`ReadCache` on its own: what it serves, what it drops, what it leaves to the pool, what it evicts and reuses."""

from __future__ import annotations

import random
import sys
import threading
import weakref
from collections import OrderedDict

import numpy as np

from ems.backends.pool_client import ReadCache
from ems.store.index import ENTRY_OVERHEAD
from ems.store.value_format import ExpectedValues, ValueKind, build_headers, checksum


def _values(n: int, size: int) -> tuple[list[bytes], ExpectedValues]:
    rng = np.random.default_rng(3)
    payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]
    expected = ExpectedValues(ValueKind.BLOCKS_V1, 7, np.arange(n, dtype=np.uint64), np.full(n, size, dtype=np.int64))
    headers = build_headers(expected, [checksum([p]) for p in payloads])
    return [h + p for h, p in zip(headers, payloads)], expected


def test_remembers_only_what_was_stored_and_serves_it():
    cache = ReadCache(1 << 20)
    values, expected = _values(3, 100)
    keys = [b"a", b"b", b"c"]
    cache.remember(keys, [[v] for v in values], [True, False, True])
    assert cache.contains(keys) == [True, False, True]
    got = cache.lookup(keys, expected)
    assert got[1] is None and bytes(got[0]) == values[0] and bytes(got[2]) == values[2]
    outs = [np.zeros(len(v), np.uint8) for v in values]
    assert cache.place(keys, outs, expected) == [True, False, True]
    assert outs[0].tobytes() == values[0]


def test_an_entry_that_is_not_the_expected_value_is_dropped():
    cache = ReadCache(1 << 20)
    values, expected = _values(2, 64)
    cache.remember([b"x", b"y"], [[values[1]], [values[1]]], [True, True])  # "x" holds value 1: not what is expected
    assert cache.lookup([b"x", b"y"], expected)[0] is None
    assert cache.contains([b"x", b"y"]) == [False, True]  # dropped, so it never shadows the pool's copy
    cache.remember([b"x"], [[values[1]]], [True])
    outs = [np.zeros(len(values[0]), np.uint8), np.zeros(len(values[1]), np.uint8)]
    assert cache.place([b"x", b"y"], outs, expected) == [False, True]
    assert cache.contains([b"x"]) == [False]


def test_place_needs_the_buffer_length():
    cache = ReadCache(1 << 20)
    cache.remember([b"k"], [[b"12345678"]], [True])
    short, exact = np.zeros(4, np.uint8), np.zeros(8, np.uint8)
    assert cache.place([b"k", b"k"], [short, exact]) == [False, True]
    assert exact.tobytes() == b"12345678"


def _charge(key: bytes, nbytes: int) -> int:
    return len(key) + nbytes + ENTRY_OVERHEAD


def test_evicts_the_least_recently_used_within_the_capacity():
    cache = ReadCache(3 * _charge(b"k0", 100))
    keys = [b"k0", b"k1", b"k2"]
    cache.remember(keys, [[bytes([i]) * 100] for i in range(3)], [True] * 3)
    assert cache.contains(keys) == [True, True, True]
    cache.lookup([b"k0"])  # k0 becomes the most recently used: k1 goes first
    cache.remember([b"k3"], [[b"\x03" * 100]], [True])
    assert cache.contains(keys + [b"k3"]) == [True, False, True, True]
    cache.remember([b"big"], [[b"\x09" * (3 * _charge(b"k0", 100))]], [True])  # larger than the whole cache
    assert cache.contains([b"big"]) == [False] and len(cache) == 3


def test_a_readers_view_keeps_its_bytes_after_eviction_and_a_free_buffer_is_reused():
    cache = ReadCache(_charge(b"a", 64))
    cache.remember([b"a"], [[b"\x01" * 64]], [True])
    (view,) = cache.lookup([b"a"])
    cache.remember([b"b"], [[b"\x02" * 64]], [True])  # evicts "a" while the reader holds it: a fresh buffer
    assert bytes(view) == b"\x01" * 64 and view.readonly
    (held,) = cache._hits([b"b"])
    del view
    cache.remember([b"c"], [[b"\x03" * 64]], [True])  # evicts "b", which only the test's reference holds
    assert bytes(held) == b"\x02" * 64
    del held
    before = weakref.ref(cache._hits([b"c"])[0])
    cache.remember([b"d"], [[b"\x04" * 64]], [True])  # evicts "c", unheld: its buffer takes "d"
    (after,) = cache._hits([b"d"])
    assert after is before() and bytes(after) == b"\x04" * 64


def test_a_key_saved_again_copies_into_its_old_buffer_unless_a_reader_holds_it():
    cache = ReadCache(1 << 20)
    cache.remember([b"k"], [[b"\x01" * 64]], [True])
    first = weakref.ref(cache._hits([b"k"])[0])  # (alive only while the cache holds it)
    cache.remember([b"k"], [[b"\x02" * 64]], [True])
    (second,) = cache._hits([b"k"])
    assert second is first() and bytes(second) == b"\x02" * 64
    del second
    (view,) = cache.lookup([b"k"])
    cache.remember([b"k"], [[b"\x03" * 64]], [True])  # the reader's view keeps the old bytes
    assert bytes(view) == b"\x02" * 64 and bytes(cache.lookup([b"k"])[0]) == b"\x03" * 64
    assert len(cache) == 1 and cache._used == _charge(b"k", 64)


def test_random_calls_match_a_model_lru():
    """Random remembers (of several parts, some replacing, some too large), lookups, places and drops against an
    ordered-dict model of the same capacity."""
    rng = random.Random(11)
    capacity = 6 * _charge(b"k00", 48)
    cache, model = ReadCache(capacity), OrderedDict()
    for _ in range(3000):
        key = f"k{rng.randrange(12):02d}".encode()
        op = rng.random()
        if op < 0.45:
            nbytes = rng.choice([16, 48, 48, 48, 96, capacity])
            value = bytes(rng.randrange(256) for _ in range(min(nbytes, 64))) * (nbytes // min(nbytes, 64) + 1)
            value = value[:nbytes]
            cut = rng.randrange(len(value) + 1)
            cache.remember([key], [[value[:cut], value[cut:]]], [True])
            model.pop(key, None)
            if _charge(key, nbytes) <= capacity:
                while model and sum(_charge(k, len(v)) for k, v in model.items()) + _charge(key, nbytes) > capacity:
                    model.popitem(last=False)
                model[key] = value
        elif op < 0.75:
            got = cache.lookup([key])[0]
            assert (got is None) == (key not in model)
            if got is not None:
                assert bytes(got) == model[key]
                model.move_to_end(key)
        elif op < 0.9:
            size = len(model[key]) if key in model and rng.random() < 0.8 else 48
            out = np.zeros(size, np.uint8)
            placed = cache.place([key], [out])[0]
            assert placed == (key in model and len(model[key]) == size)
            if key in model:
                model.move_to_end(key)
            if placed:
                assert out.tobytes() == model[key]
        else:
            assert cache.contains([key]) == [key in model]
        assert list(cache._entries) == list(model)
        assert cache._used == sum(_charge(k, len(v)) for k, v in model.items()) <= capacity


def test_same_key_remembered_from_threads_keeps_one_whole_value():
    cache = ReadCache(1 << 20)
    values = [bytes([i]) * 4096 for i in range(8)]

    def remember(i: int) -> None:
        for _ in range(200):
            cache.remember([b"k"], [[values[i][:100], values[i][100:]]], [True])

    threads = [threading.Thread(target=remember, args=(i,)) for i in range(8)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch inside each remember, between its locked steps
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    (got,) = cache.lookup([b"k"])
    assert bytes(got) in values and len(cache) == 1 and cache._used == _charge(b"k", 4096)

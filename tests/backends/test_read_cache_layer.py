"""`ReadCache` on its own: what it serves, what it drops, what it leaves to the pool."""

from __future__ import annotations

import numpy as np

from ems.backends.pool_client import ReadCache
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

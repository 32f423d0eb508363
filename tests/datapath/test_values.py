"""`ems.datapath.jobs.transfer.ReceivedValues`: a load's received values as one value object; its prefixes stop at the first
missing or wrong value, and values a pool checked (`ReadCheck.EXPECTED`) are not checked again."""

from __future__ import annotations

import numpy as np
import pytest

from ems.backends.base import ReadCheck
from ems.datapath.jobs.transfer import ReceivedValues
from ems.store.value_format import ExpectedValues, ValueKind, build_headers, checksum


def _values(n: int, size: int) -> tuple[list[bytes], ExpectedValues]:
    rng = np.random.default_rng(11)
    payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]
    expected = ExpectedValues(ValueKind.BLOCKS_V1, 3, np.arange(n, dtype=np.uint64), np.full(n, size, dtype=np.int64))
    return [h + p for h, p in zip(build_headers(expected, [checksum([p]) for p in payloads]), payloads)], expected


def test_the_verified_prefix_stops_at_the_first_damaged_or_missing_value():
    values, expected = _values(5, 64)
    damaged = bytearray(values[2])
    damaged[-1] ^= 0xFF
    received = ReceivedValues([values[0], values[1], bytes(damaged), None, values[4]], expected)
    assert received.checked is ReadCheck.NONE and received.present() == 3
    assert received.verified_prefix() == 2  # value 2's checksum is wrong
    assert received.range(3, 5).present() == 0 and received.range(4, 5).verified_prefix() == 1
    assert ReceivedValues(values, expected).verified_prefix() == 5
    with pytest.raises(ValueError):
        ReceivedValues(values[:4], expected)  # one expected value per value


def test_values_the_pool_checked_are_hits_as_far_as_they_are_present():
    values, expected = _values(4, 32)
    damaged = bytearray(values[1])
    damaged[-1] ^= 0xFF
    checked = ReceivedValues([values[0], bytes(damaged), values[2], None], expected, ReadCheck.EXPECTED)
    assert checked.verified_prefix() == 3  # the pool vouched for each value it placed: nothing is read again
    assert checked.range(1, 4).checked is ReadCheck.EXPECTED and checked.range(1, 4).present() == 2

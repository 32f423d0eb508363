"""`value_format.checksum`: XXH3-64 of a value's payload, the same whichever way it is computed (a large part is
hashed through the xxhash extension's C function with the GIL held; see `_xxh3_holding_the_gil`)."""

from __future__ import annotations

import numpy as np
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from ems.value_format import _GIL_HELD_FROM, _XXH3_HOLDING_THE_GIL, checksum

SIZES = st.sampled_from([0, 1, 7, _GIL_HELD_FROM - 1, _GIL_HELD_FROM, _GIL_HELD_FROM + 1, 3 * _GIL_HELD_FROM + 5])


def test_the_installed_xxhash_exports_the_function_held_with_the_gil():
    """Without it a large checksum falls back to xxhash's own call, which releases the GIL (correct, but slow beside
    a busy Python thread): this says so if a new xxhash stops exporting it."""
    assert _XXH3_HOLDING_THE_GIL is not None


@settings(max_examples=60, deadline=None)
@given(size=SIZES, offset=st.integers(0, 63), seed=st.integers(0, 2**32 - 1))
def test_every_buffer_kind_hashes_as_xxhash_does(size, offset, seed):
    data = np.random.default_rng(seed).integers(0, 256, size + offset, dtype=np.uint8)[offset:]  # any alignment
    expected = xxhash.xxh3_64_intdigest(data.tobytes())
    for part in (data, memoryview(data), memoryview(data).toreadonly(), data.tobytes(), bytearray(data.tobytes())):
        assert checksum([part]) == expected
    half = size // 2
    assert checksum([data[:half], data[half:]]) == expected  # streamed parts: the same digest

"""`host_copy.copy_buffers` (a node's batch of values into a shared-memory region: one C call, large copies with
streaming stores) and `HostCopy.copy_hash_many` (a save's copy and hash in one pass): every byte lands where it
belongs, whatever the sizes and alignments, and nothing outside a destination is touched."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from ems.kernels.host_copy import buffer_addresses, copy_buffers, host_copy
from ems.store.value_format import STREAM_HASH_TABLE

# around the streaming-store threshold (256 KiB) and the hash step (64 KiB), and the 1 MiB block of a value
SIZES = st.sampled_from([0, 1, 15, 64, (64 << 10) - 1, (256 << 10) - 1, 256 << 10, (256 << 10) + 17, (1 << 20) + 40])


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(SIZES, min_size=1, max_size=6),
    shifts=st.lists(st.integers(0, 63), min_size=6, max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_copy_buffers_places_every_byte_and_nothing_else(sizes, shifts, seed):
    rng = np.random.default_rng(seed)
    guard = 64
    region = rng.integers(0, 256, sum(sizes) + (guard + 64) * (len(sizes) + 1), dtype=np.uint8)
    before = region.copy()
    sources, outs, spans = [], [], []
    at = guard
    for size, shift in zip(sizes, shifts):
        at += shift  # any alignment of the destination ...
        source = rng.integers(0, 256, size + shift, dtype=np.uint8)[shift:]  # ... and of the source
        sources.append(memoryview(source).toreadonly())
        outs.append(region[at : at + size])
        spans.append((at, size))
        at += size + guard
    copy_buffers(outs, sources)
    expected = before.copy()
    for (start, size), source in zip(spans, sources):
        expected[start : start + size] = np.frombuffer(source, dtype=np.uint8)
    assert np.array_equal(region, expected)


@pytest.mark.parametrize("sizes", [[40, 40], [40, (64 << 10) + 40, (1 << 20) + 40, 41]])
def test_copy_hash_many_hashes_each_copy_from_skip_on(sizes):
    library = host_copy()
    if library is None or STREAM_HASH_TABLE is None:
        pytest.fail("the compiled host copy or xxhash's exported streaming XXH3 is missing (both are on every CI machine)")
    rng = np.random.default_rng(len(sizes))
    sources = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    outs = [np.zeros(n, dtype=np.uint8) for n in sizes]
    lengths = np.array(sizes, dtype=np.int64)
    digests = library.copy_hash_many(STREAM_HASH_TABLE, buffer_addresses(outs), buffer_addresses(sources), lengths, 40)
    assert [o.tobytes() for o in outs] == [s.tobytes() for s in sources]
    assert digests.tolist() == [xxhash.xxh3_64_intdigest(s[40:].tobytes()) for s in sources]
    with pytest.raises(ValueError, match="at least skip"):
        library.copy_hash_many(STREAM_HASH_TABLE, buffer_addresses(outs), buffer_addresses(sources), lengths, 41)

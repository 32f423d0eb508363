"""`value_format.checksum`: XXH3-64 of a value's payload, the same whichever way it is computed (a large part is
hashed through the xxhash extension's C function with the GIL held; see `_xxh3_holding_the_gil`)."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from ems.store.value_format import _GIL_HELD_FROM, _XXH3_HOLDING_THE_GIL, checksum

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


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 33, 4096, _GIL_HELD_FROM + 3, 600_000]), min_size=0, max_size=12),
    seed=st.integers(0, 2**32 - 1),
)
def test_payload_checksums_batch_hashes_each_payload_as_xxhash_does(sizes, seed):
    """The one-call batch (`payload_checksums`, the C loop over xxhash's own function, GIL held or released by the
    batch's size) gives each value's payload digest, whatever kind of buffer each value is."""
    from ems.store.value_format import HEADER_SIZE, payload_checksums

    rng = np.random.default_rng(seed)
    kinds = [lambda a: a, memoryview, lambda a: a.tobytes(), lambda a: memoryview(a).toreadonly(), bytearray]
    values = [kinds[i % len(kinds)](rng.integers(0, 256, HEADER_SIZE + n, dtype=np.uint8)) for i, n in enumerate(sizes)]
    expected = [xxhash.xxh3_64_intdigest(bytes(memoryview(v)[HEADER_SIZE:])) for v in values]
    assert payload_checksums(values) == expected


def test_valid_prefix_stops_at_the_first_damaged_payload_of_a_batch():
    """A load's verify hashes its values in one batch; a damaged byte in any value ends the prefix there."""
    from ems.store.value_format import (
        HEADER_SIZE,
        MAGIC,
        VERSION,
        ExpectedValues,
        ValueKind,
        header_struct,
        payload_checksums,
        valid_prefix,
    )

    rng = np.random.default_rng(7)
    n, length = 9, 200_000
    digests = np.arange(1, n + 1, dtype=np.uint64)
    expected = ExpectedValues(ValueKind.BLOCKS_V1, 0xABC, digests, np.full(n, length, dtype=np.int64))
    values = [rng.integers(0, 256, HEADER_SIZE + length, dtype=np.uint8) for _ in range(n)]
    for value, digest, checksum_ in zip(values, digests.tolist(), payload_checksums(values)):
        header_struct.pack_into(value, 0, MAGIC, VERSION, int(ValueKind.BLOCKS_V1), 0xABC, digest, length, checksum_)
    assert valid_prefix(values, expected) == n
    for damaged in (0, 4, n - 1):
        copy = [v.copy() for v in values]
        copy[damaged][HEADER_SIZE + 12345] ^= 1
        assert valid_prefix(copy, expected) == damaged
    values[3] = values[3][:-1]  # a short value ends the prefix before any hashing
    assert valid_prefix(values, expected) == 3


@settings(max_examples=40, deadline=None)
@given(
    cases=st.lists(st.sampled_from(["good", "short", "magic", "version", "length", "checksum", "payload"]), max_size=10),
    size=st.sampled_from([0, 100, 300_000]),
)
def test_well_formed_many_agrees_with_is_well_formed(cases, size):
    """A node checks a PUT's values in one batch (`well_formed_many`); each answer is `is_well_formed`'s."""
    from ems.store.value_format import HEADER_SIZE, MAGIC, VERSION, header_struct, is_well_formed, part_checksum, well_formed_many

    rng = np.random.default_rng(size)
    values = []
    for case in cases:
        value = rng.integers(0, 256, HEADER_SIZE + size, dtype=np.uint8)
        header_struct.pack_into(value, 0, MAGIC, VERSION, 2, 7, 9, size, part_checksum(value[HEADER_SIZE:]))
        if case == "short":
            value = value[: HEADER_SIZE - 1]
        elif case == "magic":
            value[0] ^= 1
        elif case == "version":
            value[4] = 200
        elif case == "length":
            value = value[:-1] if size else np.concatenate([value, np.zeros(1, np.uint8)])
        elif case == "checksum":
            value[HEADER_SIZE - 1] ^= 1
        elif case == "payload" and size:
            value[HEADER_SIZE + size // 2] ^= 0x80
        values.append(value)
    assert well_formed_many(values) == [is_well_formed(v) for v in values]
    assert [ok for ok, case in zip(well_formed_many(values), cases) if case == "good"] == [True] * cases.count("good")


def _mixed_values(cases: list[str], size: int) -> list[np.ndarray]:
    from ems.store.value_format import HEADER_SIZE, MAGIC, VERSION, header_struct, part_checksum

    rng = np.random.default_rng(size + len(cases))
    values = []
    for case in cases:
        value = rng.integers(0, 256, HEADER_SIZE + size, dtype=np.uint8)
        header_struct.pack_into(value, 0, MAGIC, VERSION, 2, 7, 9, size, part_checksum(value[HEADER_SIZE:]))
        if case == "short":
            value = value[: HEADER_SIZE - 1]
        elif case == "checksum":
            value[HEADER_SIZE - 1] ^= 1
        elif case == "payload" and size:
            value[HEADER_SIZE + size // 2] ^= 0x80
        values.append(value)
    return values


@settings(max_examples=40, deadline=None)
@given(
    cases=st.lists(st.sampled_from(["good", "short", "checksum", "payload"]), max_size=10),
    size=st.sampled_from([0, 100, 300_000]),
    source_kind=st.sampled_from(["array", "readonly view", "bytes"]),
)
def test_copy_well_formed_many_copies_every_value_and_judges_the_copy(cases, size, source_kind):
    """A node's shared-memory save (`copy_well_formed_many`): every destination ends holding its source's bytes,
    and each answer is `is_well_formed` of the copy, whatever the batch's mix and the sources' buffer kind."""
    from ems.store.value_format import copy_well_formed_many, is_well_formed

    values = _mixed_values(cases, size)
    sources = {
        "array": values,
        "readonly view": [memoryview(v).toreadonly() for v in values],
        "bytes": [v.tobytes() for v in values],
    }[source_kind]
    dsts = [np.full(v.size, 0xAB, dtype=np.uint8) for v in values]
    verdicts = copy_well_formed_many(dsts, sources)
    for dst, value in zip(dsts, values):
        assert dst.tobytes() == value.tobytes()
    assert verdicts == [is_well_formed(v) for v in values]
    assert [ok for ok, case in zip(verdicts, cases) if case == "good"] == [True] * cases.count("good")


def test_copy_refuses_a_destination_it_cannot_write_or_of_another_length():
    from ems.kernels.host_copy import copy_buffers
    from ems.store.value_format import copy_well_formed_many

    value = _mixed_values(["good"], 64)[0]
    for bad in (np.empty(value.size - 1, np.uint8), memoryview(np.empty_like(value)).toreadonly(), bytes(value.size)):
        for copy in (copy_buffers, copy_well_formed_many):
            with pytest.raises(ValueError, match="writable, contiguous"):
                copy([np.empty_like(value), bad], [value, value])
    with pytest.raises(ValueError, match="as many"):
        copy_buffers([np.empty_like(value)], [value, value])


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 33, 4096, _GIL_HELD_FROM + 3, 600_000]), min_size=1, max_size=12),
    start=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_encode_in_place_writes_the_headers_a_load_accepts(sizes, start, seed):
    """A save's encode (`encode_in_place`: one C call for more than a few values, struct for a few) gives each value
    exactly the header `build_headers` makes with its payload's XXH3, whatever the path, the buffer kind or where the
    values start in the request; a load then takes every one (`matches`)."""
    from ems.store.value_format import HEADER_SIZE, ExpectedValues, ValueKind, build_headers, encode_in_place, matches

    rng = np.random.default_rng(seed)
    lengths = np.array([0] * start + sizes, dtype=np.int64)
    expected = ExpectedValues(
        ValueKind.BLOCKS_V1, int(rng.integers(0, 2**63)), rng.integers(0, 2**63, lengths.size).astype(np.uint64), lengths
    )
    payloads = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    want = [
        h + p.tobytes()
        for h, p in zip(build_headers(expected, [xxhash.xxh3_64_intdigest(p.tobytes()) for p in payloads], start), payloads)
    ]
    for as_buffer in (lambda a: a, memoryview):
        values = [np.concatenate([rng.integers(0, 256, HEADER_SIZE, dtype=np.uint8), p]) for p in payloads]  # stale headers
        encode_in_place([as_buffer(v) for v in values], expected, start)
        assert [v.tobytes() for v in values] == want
        assert all(matches(v, expected, start + i) for i, v in enumerate(values))


def test_encode_in_place_refuses_a_value_of_the_wrong_length_and_writes_nothing():
    """The C loop trusts its lengths: a batch with one value shorter than its header and payload is refused before
    any header is written."""
    from ems.store.value_format import HEADER_SIZE, ExpectedValues, ValueKind, encode_in_place

    n = 8
    lengths = np.full(n, 256, dtype=np.int64)
    expected = ExpectedValues(ValueKind.BLOCKS_V1, 7, np.arange(n, dtype=np.uint64), lengths)
    values = [np.full(HEADER_SIZE + 256, 0xAB, dtype=np.uint8) for _ in range(n)]
    values[5] = values[5][:-1]
    for batch, start in ((values, 0), (values[4:6], 4)):  # the C path, and the struct path of a few
        with pytest.raises(ValueError):
            encode_in_place(batch, expected, start)
        assert all((v == 0xAB).all() for v in values)

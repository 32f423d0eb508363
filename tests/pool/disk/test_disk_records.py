"""The disk tier's pieces in process: the record format (every damaged byte is caught), record names (parsed back
exactly, other names left out), and the write ring (live slots never overlap) against a model."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from pool_testlib import joined, make_values

from ems.pool.disk.records import (
    ALIGN,
    HEADER_BYTES,
    aligned_buffer,
    decode_record,
    encode_record,
    key_hash,
    parse_names,
    record_bytes,
    record_name,
)
from ems.pool.disk.ring import WriteRing


def _record(key: bytes, size: int, seed: int = 0) -> tuple[np.ndarray, bytes]:
    value = joined(make_values(1, size, seed=seed)[0])
    data = aligned_buffer(record_bytes(len(key), len(value)))
    encode_record(data, key, value, seq=7)
    return data, value


@settings(max_examples=60, deadline=None)
@given(key=st.binary(min_size=1, max_size=80), size=st.integers(1, 5000), spot=st.floats(0, 1), bit=st.integers(0, 7))
def test_a_record_reads_back_and_any_flipped_bit_is_caught(key, size, spot, bit):
    data, value = _record(key, size)
    assert decode_record(data, key).tobytes() == value
    assert decode_record(data, key + b"x") is None and decode_record(data, b"other" + key) is None  # another key
    meaningful = HEADER_BYTES + len(key) + len(value)
    damaged = data.copy()
    damaged[min(int(spot * meaningful), meaningful - 1)] ^= 1 << bit
    assert decode_record(damaged, key) is None
    for cut in (0, HEADER_BYTES - 1, meaningful - 1):  # a truncated file
        assert decode_record(data[:cut], key) is None


def test_record_names_parse_back_and_other_names_are_left_out():
    rng = np.random.default_rng(1)
    records = [(key_hash(f"k{i}".encode()), int(rng.integers(0, 2**63)), int(rng.integers(1, 2**40)) * ALIGN) for i in range(300)]
    names = [record_name(*r) for r in records]
    junk = ["x" * len(names[0]), names[0][:-4] + ".tmp", names[1].upper(), names[2][:-1], "é" * len(names[0]), "probe"]
    mixed = junk[:3] + names + junk[3:]
    hashes, seqs, sizes, positions = parse_names(mixed)
    assert [mixed[p] for p in positions.tolist()] == names
    assert hashes == [r[0] for r in records]
    assert seqs.tolist() == [r[1] for r in records] and sizes.tolist() == [r[2] for r in records]
    assert parse_names([])[0] == [] and parse_names(junk)[0] == []


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 50)), max_size=120))
def test_the_write_ring_never_hands_out_overlapping_live_slots(ops):
    ring = WriteRing(16 * ALIGN)
    live = []
    for take, pages, pick in ops:
        if take or not live:
            slot = ring.take(pages * ALIGN, 0, 0)
            if slot is None:
                # refused only when no free run of that length exists (in the ring's order), never while it is empty
                assert live or pages * ALIGN > ring.size
                continue
            assert slot.start % ALIGN == 0 and slot.start + slot.nbytes <= ring.size
            for other in live:
                assert slot.start + slot.nbytes <= other.start or other.start + other.nbytes <= slot.start
            live.append(slot)
        else:
            ring.release(live.pop(pick % len(live)))
        assert ring.live_bytes == sum(s.nbytes for s in live)


def test_one_lookup_reads_at_most_drams_size_from_the_disk(tmp_path):
    """A GET naming more disk-resident values than DRAM holds: a found prefix, exact, the rest misses; each of
    them is still found on its own."""
    import time

    from ems.pool.disk import DiskTier
    from ems.pool.tiered_store import TieredStore

    disk = DiskTier(str(tmp_path), 64 << 20, 64 << 20)
    disk.open()
    store = TieredStore(4 << 20, disk, min_read_bytes=0)  # (the node's floor would cover this small DRAM)
    try:
        values = [joined(v) for v in make_values(16, (1 << 20) - 40, seed=3)]
        keys = [f"g{i}".encode() for i in range(16)]
        for key, value in zip(keys, values):
            charge = store.charge_of(len(key), len(value))
            buffer = store.allocate(len(value), reserve=charge)
            buffer[:] = np.frombuffer(value, dtype=np.uint8)
            assert store.put_owned(key, buffer, reserved=charge)
        deadline = time.monotonic() + 20
        while disk.stats().queued_values and time.monotonic() < deadline:
            time.sleep(0.02)
        got = store.get_many(keys[:12])  # the oldest 12: on the disk only
        found = [g is not None for g in got]
        assert 3 <= sum(found) <= 5 and found == sorted(found, reverse=True), found
        assert all(bytes(g) == v for g, v in zip(got, values) if g is not None)
        assert all(bytes(store.get_many([k])[0]) == v for k, v in zip(keys[:12], values))
    finally:
        store.close()

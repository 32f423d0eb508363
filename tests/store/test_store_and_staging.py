"""Units: the LRU `KvStore` (order, capacity accounting, malformed values refused) and the `StagingPool` (bounded,
back-pressure, an oversized request runs alone)."""

from __future__ import annotations

import functools
import random
import threading
import time

import numpy as np
import pytest
import torch
from ems_testlib import direct_cc, make_cache, slots_of_blocks
from fault_injection import damage

from ems.buffers import POPULATE_STEP, SpareCpuPacer
from ems.datapath.arguments import Operation
from ems.datapath.calls import bind_call
from ems.datapath.layout import register_layout
from ems.datapath.planning import plan_blocks
from ems.staging import MIN_BUFFER, StagingPool
from ems.store import recycling as arena  # (the arena lives in the buffer supply's module)
from ems.store.kv_store import ENTRY_OVERHEAD, KvStore
from ems.store.value_format import (
    HEADER_SIZE,
    ExpectedValues,
    ValueKind,
    build_headers,
    checksum,
    is_well_formed,
    parse_header,
    valid_flags,
    valid_prefix,
)


def value(payload: bytes, sig: int = 7) -> bytes:
    expected = ExpectedValues(ValueKind.BLOCKS_V1, sig, np.array([len(payload)], np.uint64), np.array([len(payload)]))
    return build_headers(expected, [checksum([payload])])[0] + payload


def charge(key: bytes, v: bytes) -> int:
    return len(key) + len(v) + ENTRY_OVERHEAD


# ------------------------------------------------------------------ value format


def test_value_format_roundtrip_and_damage():
    v = value(b"payload-bytes")
    assert len(v) == HEADER_SIZE + 13 and is_well_formed(v)
    assert parse_header(v)["payload_len"] == 13
    for mode in ("flip", "truncate", "empty"):
        assert not is_well_formed(damage(v, mode))
    for position in (0, 5, 24, 32):  # magic, version, payload_len, checksum: a node can see these are wrong
        assert not is_well_formed(damage(v, "header", position))
    # version 3 -> 2: a well-formed value of a version nodes still store, but never this client's: a miss
    older = damage(v, "header", 4)
    assert is_well_formed(older) and parse_header(older) is None
    # layout_sig/tokens_digest are only checkable by the client, which knows what it expects (valid_prefix)
    assert not is_well_formed(v + b"x")
    assert parse_header(b"short") is None


@pytest.mark.parametrize("n", [1, 2, 4, 5, 9])
def test_build_headers_small_and_vectorised_paths_agree(n, monkeypatch):
    """A few headers are packed with struct, many with numpy: byte for byte the same, extreme fields included, and
    for values start.. of a request (a chunk) the same as those values' headers in the whole request."""
    import ems.store.value_format as vf

    rng = np.random.default_rng(n)
    expected = ExpectedValues(
        ValueKind.BLOCKS_V1, 2**64 - 1, rng.integers(0, 2**63, n, dtype=np.uint64) * 2 + 1, rng.integers(0, 2**40, n)
    )
    checksums = [int(x) for x in rng.integers(0, 2**63, n, dtype=np.uint64) * 2 + 1]
    small = build_headers(expected, checksums)
    chunks = [build_headers(expected, checksums[a : a + 2], a) for a in range(n)]  # values a, a+1 (a save's chunk)
    monkeypatch.setattr(vf, "_FEW", -1)
    assert build_headers(expected, checksums) == small
    assert all(len(h) == HEADER_SIZE and parse_header(h) is not None for h in small)
    for a, chunk in enumerate(chunks):
        assert chunk == small[a : a + 2] == build_headers(expected, checksums[a : a + 2], a)


def test_valid_prefix_checks_every_field():
    payloads = [b"a" * 10, b"b" * 10, b"c" * 10]
    expected = ExpectedValues(ValueKind.BLOCKS_V1, 7, np.array([1, 1, 1], np.uint64), np.array([10, 10, 10]))
    headers = build_headers(expected, [checksum([p]) for p in payloads])
    values = [h + p for h, p in zip(headers, payloads)]
    assert valid_prefix(values, expected) == 3
    assert valid_prefix([values[0], None, values[2]], expected) == 1
    assert valid_prefix([values[0], values[1], damage(values[2], "flip")], expected) == 2
    other_sig = ExpectedValues(ValueKind.BLOCKS_V1, 8, expected.tokens_digest, expected.payload_len)
    assert valid_prefix(values, other_sig) == 0
    other_kind = ExpectedValues(ValueKind.RAW_V0, 7, expected.tokens_digest, expected.payload_len)
    assert valid_prefix(values, other_kind) == 0
    other_tokens = ExpectedValues(ValueKind.BLOCKS_V1, 7, np.array([1, 2, 1], np.uint64), expected.payload_len)
    assert valid_prefix(values, other_tokens) == 1


@pytest.mark.parametrize("seed", range(8))
def test_valid_flags_is_matches_of_every_value(seed):
    """Per value, not a leading run: a damaged, absent or foreign value in the middle leaves the others' flags as
    `valid_prefix` of each one alone says; many values go through the batched checksum, one the single one."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    payloads = [rng.integers(0, 256, int(rng.integers(1, 3000)), dtype=np.uint8).tobytes() for _ in range(n)]
    expected = ExpectedValues(
        ValueKind.BLOCKS_V1, 7, rng.integers(0, 2**40, n, dtype=np.uint64), np.array([len(p) for p in payloads])
    )
    headers = build_headers(expected, [checksum([p]) for p in payloads])
    values: list[bytes | None] = [h + p for h, p in zip(headers, payloads)]
    for i in range(n):
        harm = rng.integers(0, 5)
        if harm == 1:
            values[i] = None
        elif harm == 2 and values[i] is not None:
            values[i] = damage(values[i], "flip")
        elif harm == 3:
            values[(i + 1) % n] = values[i]  # another position's value: its tokens digest and length differ
    alone = [valid_prefix([values[i]], expected.range(i, i + 1)) == 1 for i in range(n)]
    assert valid_flags(values, expected) == alone


# ------------------------------------------------------------------ KvStore


def test_store_lru_order():
    values = {k: value(bytes([i + 1]) * 100) for i, k in enumerate([b"a", b"b", b"c", b"d"])}
    store = KvStore(3 * charge(b"a", values[b"a"]))
    for k in (b"a", b"b", b"c"):
        assert store.put(k, [values[k]])
    assert store.get(b"a") == values[b"a"]  # a becomes the most recently used
    assert store.put(b"d", [values[b"d"]])
    assert store.contains_many([b"a", b"b", b"c", b"d"]) == [True, False, True, True]
    assert store.stats().evictions == 1
    assert store.put(b"e", [values[b"a"]])  # evicts c, the least recently used now
    assert store.contains_many([b"a", b"c", b"d", b"e"]) == [True, False, True, True]


def test_store_capacity_accounting():
    store = KvStore(10_000)
    v1, v2 = value(b"x" * 500), value(b"y" * 1500)
    assert store.put(b"k1", [v1]) and store.put(b"k2", [v2[:100], v2[100:]])  # parts are concatenated
    assert store.get(b"k2") == v2
    assert store.stats().used_bytes == charge(b"k1", v1) + charge(b"k2", v2)
    assert store.put(b"k1", [v2])  # replacing a key re-charges it
    assert store.stats().used_bytes == 2 * charge(b"k1", v2)
    assert store.stats().entries == 2
    assert store.delete(b"k1") and not store.delete(b"k1")
    assert store.stats().used_bytes == charge(b"k2", v2)
    store.clear()
    assert store.stats().used_bytes == 0 and store.stats().entries == 0
    with pytest.raises(ValueError):
        KvStore(0)


def test_store_many_tiny_values_stay_within_capacity():
    store = KvStore(5000)
    for i in range(500):
        assert store.put(i.to_bytes(4, "little"), [value(b"")])
        assert store.stats().used_bytes <= 5000
    assert store.stats().entries == 5000 // charge(b"1234", value(b""))


def test_store_refuses_value_larger_than_capacity_without_evicting():
    small = value(b"s" * 10)
    store = KvStore(1000)
    assert store.put(b"small", [small])
    assert not store.put(b"big", [value(b"b" * 1000)])
    assert store.contains_many([b"small", b"big"]) == [True, False]
    assert store.stats().rejected_puts == 1 and store.stats().evictions == 0


@pytest.mark.parametrize("mode,position", [("flip", None), ("header", 0), ("header", 32), ("truncate", None), ("empty", None)])
def test_store_refuses_malformed_values(mode, position):
    store = KvStore(10_000)
    good = value(b"z" * 64)
    assert not store.put(b"k", [damage(good, mode, position)])
    assert not store.put(b"k", [b"not an ems value at all, long enough for a header........"])
    assert store.stats().entries == 0 and store.stats().rejected_puts == 2
    assert store.get(b"k") is None
    lenient = KvStore(10_000, verify_on_put=False)  # the client read cache stores what it already verified
    assert lenient.put(b"k", [b"anything"])


def test_store_get_survives_eviction():
    v = value(b"q" * 200)
    store = KvStore(charge(b"k", v))
    got = store.get(b"k") if store.put(b"k", [v]) else None
    assert store.put(b"j", [value(b"r" * 200)])
    assert store.get(b"k") is None
    assert got == v


def test_store_reuses_evicted_buffers_at_capacity():
    values = [value(bytes([i]) * 4000, sig=i) for i in range(40)]
    store = KvStore(4 * charge(b"k00", values[0]))
    for i, v in enumerate(values):
        assert store.put(b"k%02d" % i, [v])
    stats = store.stats()
    assert stats.entries == 4 and stats.evictions == 36
    assert stats.reused_buffers >= 35  # a full pool writes into what it evicted, not into fresh memory
    assert stats.used_bytes + stats.spare_bytes <= stats.capacity_bytes
    assert [bytes(store.get(b"k%02d" % i)) for i in range(36, 40)] == values[36:]


def test_store_never_reuses_a_buffer_a_reader_holds():
    values = [value(bytes([i]) * 4000, sig=i) for i in range(30)]
    store = KvStore(2 * charge(b"k00", values[0]))
    assert store.put(b"k00", [values[0]])
    held = store.get(b"k00")
    for i in range(1, 30):  # k00 is evicted, then same-size puts look for spare buffers
        assert store.put(b"k%02d" % i, [values[i]])
    assert store.get(b"k00") is None
    assert bytes(held) == values[0]
    with pytest.raises(TypeError):
        held[0] = 0  # readers get read-only views


@pytest.mark.parametrize("prefault", [0, 1 << 20])
def test_store_buffers_put_each_payload_on_a_cache_line(prefault):
    """Every buffer the store hands out (fresh, from the arena, recycled) has its payload, after the 40-byte header,
    on a 64-byte boundary; a plan's staging places every payload the same way."""
    store = KvStore(1 << 22, prefault_bytes=prefault)
    for nbytes in (HEADER_SIZE + 1, HEADER_SIZE + 1000, 5000, 70_000):
        reserve = store.charge_of(4, nbytes)
        buffer = store.allocate(nbytes, reserve)
        assert buffer.nbytes == nbytes and (buffer.__array_interface__["data"][0] + HEADER_SIZE) % 64 == 0
        store.recycle(buffer, reserve)
        again = store.allocate(nbytes, reserve)  # the recycled one
        assert np.shares_memory(again, buffer) and store.stats().reused_buffers >= 1
        store.recycle(again, reserve)
    layout = register_layout(make_cache(layers=2, blocks=8, block_size=4, heads=1, head_size=8), None)
    request = bind_call(Operation.SAVE, (slots_of_blocks([1, 3, 4], 4, [4, 3, 4]), [1, 2, 3], [4, 3, 4]), {}, layout)
    plan = plan_blocks(request, layout, b"ns")
    assert ((plan.value_start[:-1] + HEADER_SIZE) % 64 == 0).all()


def _address(buffer) -> int:
    return buffer.__array_interface__["data"][0]


@pytest.mark.parametrize("arena", ["none", "prefaulted", "ahead"])
def test_store_gives_every_buffer_its_own_address(arena):
    """`allocate_many` and `get_many_with_addresses` report each buffer's real address (the embedded jobs copy to
    and from those addresses: a wrong one would be memory corruption), through fresh memory, the arena, recycled
    spares, evictions, overwrites and values handed in by `put_owned` (whose address the store does not know)."""
    rng = random.Random(3)
    kwargs = {"none": {}, "prefaulted": {"prefault_bytes": 150_000}, "ahead": {"prefault_ahead": 150_000}}[arena]
    store = KvStore(200_000, **kwargs)  # room for a few dozen values: evictions
    for step in range(300):
        sizes = [rng.choice([HEADER_SIZE + 8, 1000, 4136, 20_000]) for _ in range(rng.randrange(1, 6))]
        keys = [b"k%d" % rng.randrange(40) for _ in sizes]
        keys = list(dict.fromkeys(keys))
        sizes = sizes[: len(keys)]
        reserves = [store.charge_of(len(k), n) for k, n in zip(keys, sizes)]
        buffers, addresses = store.allocate_many(sizes, reserves)
        assert [_address(b) for b in buffers] == addresses
        if rng.random() < 0.2:  # given back unused
            for b, r, a in zip(buffers, reserves, addresses):
                store.recycle(b, r, a)
            continue
        for b in buffers:
            b[:] = rng.randrange(256)
        store.put_owned_many(keys, buffers, reserves, addresses)
        if rng.random() < 0.1:  # a value the store did not allocate
            outside = np.frombuffer(value(b"x" * 100), dtype=np.uint8).copy()
            store.put_owned(b"outside%d" % step, outside)
        probe = [b"k%d" % i for i in range(40)] + [b"outside%d" % step]
        values, known = store.get_many_with_addresses(probe)
        for v, a in zip(values, known):
            if v is None:
                assert a is None
            elif a is not None:
                assert a == _address(np.frombuffer(v, dtype=np.uint8))
    assert store.stats().reused_buffers > 0 and store.stats().evictions > 0


def test_background_populate_goes_in_small_steps(monkeypatch):
    """A store's arena is faulted in ahead in the background in steps of at most `POPULATE_STEP` (each step holds the
    process's mmap lock, which other threads' mmap and munmap wait for), and gets as far as `prefault_ahead`. How
    long another thread's allocations wait beside it is a figure of perf/bench_populate.py, not a test bound: on a
    busy host it measures the scheduler. The pacer is told the host has spare CPU (a busy host would otherwise hold
    the populate back, which is `SpareCpuPacer`'s own test)."""
    steps: list[int] = []
    real_populate = arena.populate_pages

    def recording_populate(address: int, length: int) -> bool:
        steps.append(length)
        return real_populate(address, length)

    monkeypatch.setattr(arena, "populate_pages", recording_populate)
    monkeypatch.setattr(arena, "SpareCpuPacer", functools.partial(SpareCpuPacer, idle=lambda: None))
    store = KvStore(512 << 20, prefault_ahead=256 << 20)
    try:
        deadline = time.monotonic() + 120  # progress, not speed: generous for a host whose cores are busy
        while store.stats().arena_populated_bytes < 256 << 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.stats().arena_populated_bytes >= 256 << 20, "the background populate did not get as far as ahead"
        assert len(steps) >= (256 << 20) // POPULATE_STEP and max(steps) <= POPULATE_STEP, sorted(set(steps))
    finally:
        store.close()


def test_store_never_recycles_a_view_of_memory_someone_else_holds():
    """A value handed over with `put_owned` that is a view of a larger array (not the store's own allocation) is
    never reused for another value once evicted: whoever holds the array would see its bytes change."""
    store = KvStore(10_000)
    payload = b"z" * 500
    outside = np.zeros(HEADER_SIZE + 500 + 8, dtype=np.uint8)
    view = outside[8:]
    view[:] = np.frombuffer(value(payload), dtype=np.uint8)
    assert store.put_owned(b"k", view)
    del view
    assert store.delete(b"k")
    reserve = store.charge_of(1, HEADER_SIZE + 500)
    fresh = store.allocate(HEADER_SIZE + 500, reserve)
    assert not np.shares_memory(fresh, outside)
    assert bytes(outside[8:]) == value(payload)


def test_store_get_is_read_only_whoever_else_holds_the_buffer():
    """`get` hands out a read-only view of a store-made buffer however many references to it (or to the memory
    behind it) exist at that moment: concurrent readers each hold one. (Before: a reader racing another could get
    the writable array itself.)"""
    store = KvStore(10_000)
    assert store.put(b"k", [value(b"q" * 300)])
    held = store._entries[b"k"]  # white-box: a second holder of the buffer and of its base, like a racing reader
    base_holder = held.base
    for _ in range(3):
        got = store.get(b"k")
        assert isinstance(got, memoryview) and got.readonly and got == value(b"q" * 300)
    del held, base_holder


def test_store_thread_safety():
    store = KvStore(50_000)
    values = [value(bytes([i]) * random.Random(i).randint(1, 900)) for i in range(64)]
    errors = []

    def worker(t):
        rng = random.Random(t)
        try:
            for _ in range(500):
                i = rng.randrange(64)
                key = i.to_bytes(2, "little")
                if rng.random() < 0.5:
                    store.put(key, [values[i]])
                else:
                    got = store.get(key)
                    assert got is None or got == values[i]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    stats = store.stats()
    assert stats.used_bytes <= 50_000
    assert stats.used_bytes == sum(charge(k, bytes(store._entries[k])) for k in store._entries)


# ------------------------------------------------------------------ StagingPool


def _footprint(pool: StagingPool) -> int:
    return pool._leased_bytes + pool._free_bytes


def test_staging_reuses_buffers():
    pool = StagingPool(1 << 20)
    cpu = torch.device("cpu")
    a = pool.acquire(100_000, cpu)
    assert a.capacity >= 100_000 and a.device is a.host
    buffer = a.device
    pool.release(a)
    b = pool.acquire(70_000, cpu)
    assert b.device is buffer
    pool.release(b)
    assert _footprint(pool) <= pool.capacity


def test_staging_takes_any_free_buffer_of_several_sizes():
    """Regression: taking the best-fitting free buffer when it is not the first one in the free list compared leases
    with `==` (tensor contents: an error for different sizes, an ambiguous bool for equal ones)."""
    pool = StagingPool(1 << 22)
    cpu = torch.device("cpu")
    leases = [pool.acquire(size, cpu) for size in (4 * MIN_BUFFER, MIN_BUFFER, 2 * MIN_BUFFER, 2 * MIN_BUFFER)]
    for lease in leases:
        pool.release(lease)
    for size in (MIN_BUFFER, 2 * MIN_BUFFER, 2 * MIN_BUFFER, 4 * MIN_BUFFER):
        lease = pool.acquire(size, cpu)
        assert lease.capacity == size
    pool.clear()


def test_staging_bigger_than_capacity_runs_alone():
    pool = StagingPool(MIN_BUFFER)
    cpu = torch.device("cpu")
    big = pool.acquire(10 * MIN_BUFFER, cpu)
    assert big.capacity >= 10 * MIN_BUFFER
    pool.release(big)
    assert pool._free == [] and _footprint(pool) == 0  # not kept

    small = pool.acquire(1000, cpu)
    started, done = threading.Event(), threading.Event()

    def take_big():
        started.set()
        lease = pool.acquire(10 * MIN_BUFFER, cpu)  # waits for the small lease to go
        done.set()
        pool.release(lease)

    th = threading.Thread(target=take_big)
    th.start()
    started.wait()
    time.sleep(0.1)
    assert not done.is_set()
    pool.release(small)
    th.join(10)
    assert done.is_set()


def test_staging_stays_within_capacity_under_threads():
    capacity = 4 * MIN_BUFFER
    pool = StagingPool(capacity)
    cpu = torch.device("cpu")
    peak = [0]
    lock = threading.Lock()
    errors = []

    def worker(t):
        rng = random.Random(t)
        try:
            for _ in range(50):
                lease = pool.acquire(rng.randint(1, 2 * MIN_BUFFER), cpu)
                with lock:
                    peak[0] = max(peak[0], _footprint(pool))
                lease.device[:8] = t
                time.sleep(0.0005)
                assert int(lease.device[0]) == t  # nobody else holds this buffer
                pool.release(lease)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads), "staging deadlocked"
    assert not errors
    assert peak[0] <= capacity
    assert pool._leased_bytes == 0


def test_save_bigger_than_staging_capacity_completes(fault_node_factory):
    node = fault_node_factory()
    cc = direct_cc([node], staging_capacity=MIN_BUFFER)
    try:
        cache = make_cache(layers=4, blocks=16, block_size=16, heads=4, head_size=32, dtype=torch.float32)
        cc.register_kvcache(cache)  # 16 blocks x 32 KiB = 512 KiB in one request
        slots = slots_of_blocks(range(16), 16)
        futures = [cc.async_save(slots, list(range(100 * k, 100 * k + 16)), [16] * 16) for k in range(3)]
        assert [f.result(timeout=60).success for f in futures] == [16, 16, 16]
        assert cc.load(slots, list(range(16)), [16] * 16).success == 16
        assert cc._staging._leased_bytes == 0
    finally:
        cc.close()

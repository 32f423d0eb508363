"""Prefix semantics (a load's success is the hit prefix; nothing at or after the first miss is written), eviction
under a small pool, damaged or foreign values are misses, and node failures/hangs."""

from __future__ import annotations

import time

import pytest
import torch
from ems_testlib import (
    assert_cache_equals,
    direct_cc,
    expected_after_load,
    fill_random,
    make_cache,
    on_both_pools,
    poison,
    slots_of_blocks,
    snapshot,
)
from fault_injection import is_block

from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsErrorCode, EmsException, KvBufferWrapper, PrimaryKey
from ems.store.kv_store import ENTRY_OVERHEAD
from ems.store.ns_records import is_record_key
from ems.store.value_format import HEADER_SIZE

BS = 4


def _setup(cc, blocks=8, **kw):
    cache = make_cache(layers=2, blocks=blocks, block_size=BS, **kw)
    cc.register_kvcache(cache)
    return cache


# ------------------------------------------------------------------ prefix semantics


@pytest.mark.parametrize("missing", [0, 2, 4])
def test_dropped_middle_block_limits_the_prefix(faulty, missing):
    cc, node = faulty
    cache = _setup(cc)
    hashes = [101, 102, 103, 104, 105]
    block_ids = [6, 0, 3, 5, 1]
    slots = slots_of_blocks(block_ids, BS, [4, 4, 4, 4, 2])
    offsets = [4, 4, 4, 4, 2]
    node.drop_blocks([hashes[missing]])
    result = cc.save(slots, hashes, offsets)
    assert (result.success, result.total) == (missing, 5)  # save reports the consecutive acknowledged blocks
    assert cc.exists(hashes).success == missing
    original = snapshot(cache)
    poisoned = poison(cache)
    result = cc.load(slots, hashes, offsets)
    assert (result.success, result.total) == (missing, 5)
    # the blocks before the miss are loaded; the miss and everything after it keep their poison
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots[: sum(offsets[:missing])]))


@on_both_pools
def test_never_saved_middle_block(cc):
    cache = _setup(cc)
    original = snapshot(cache)
    assert cc.save(slots_of_blocks([1], BS), [1], [BS]).success == 1
    assert cc.save(slots_of_blocks([3], BS), [3], [BS]).success == 1
    slots = slots_of_blocks([1, 2, 3], BS)
    assert cc.exists([1, 2, 3]).success == 1
    assert cc.exists([2, 1]).success == 0
    poisoned = poison(cache)
    assert cc.load(slots, [1, 2, 3], [BS] * 3).success == 1
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots[:BS]))


@on_both_pools
def test_nothing_saved_loads_nothing(cc):
    cache = _setup(cc)
    poisoned = poison(cache)
    assert cc.load([0, 1], [1], [2]).success == 0
    assert_cache_equals(cache, poisoned)
    assert cc.exists([1]).success == 0


@on_both_pools
def test_v0_missing_key_is_prefix(cc):
    option = CcKvOption()
    keys = [PrimaryKey("r", str(i)) for i in range(3)]
    bufs = [fill_random(torch.empty(32, dtype=torch.float16)) for _ in range(3)]
    values = [[KvBufferWrapper(b.data_ptr(), 64)] for b in bufs]
    assert cc.save(option, keys[:1], values[:1]).success == 1
    assert cc.save(option, keys[2:], values[2:]).success == 1
    original = [b.clone() for b in bufs]
    for b in bufs:
        fill_random(b)
    poisoned = [b.clone() for b in bufs]
    assert cc.load(option, keys, values).success == 1
    assert torch.equal(bufs[0].view(torch.uint8), original[0].view(torch.uint8))
    assert torch.equal(bufs[1].view(torch.uint8), poisoned[1].view(torch.uint8))
    assert torch.equal(bufs[2].view(torch.uint8), poisoned[2].view(torch.uint8))
    assert cc.exists(keys).success == 1


@on_both_pools
def test_partial_block_is_a_different_value_than_the_full_block(cc):
    """A block saved with 2 tokens must not satisfy a load that asks for 4 tokens of the same hash."""
    cache = _setup(cc)
    assert cc.save([0, 1], [7], [2]).success == 1
    poisoned = poison(cache)
    assert cc.load([0, 1, 2, 3], [7], [4]).success == 0
    assert_cache_equals(cache, poisoned)


# ------------------------------------------------------------------ eviction


def _value_charge(cache_tokens_bytes: int) -> int:
    return cache_tokens_bytes


def test_eviction_lru_keeps_newest_loadable(fault_node_factory):
    layers, heads, head_size = 2, 2, 8
    token_bytes = layers * 2 * heads * head_size * 2  # fp16
    block_value = HEADER_SIZE + BS * token_bytes
    capacity = 5 * (block_value + 17 + 8 + ENTRY_OVERHEAD)  # room for ~5 blocks
    node = fault_node_factory(capacity)
    cc = direct_cc([node])
    try:
        cache = make_cache(layers=layers, blocks=16, block_size=BS, heads=heads, head_size=head_size)
        cc.register_kvcache(cache)
        original = snapshot(cache)
        for i in range(16):  # each save alone always succeeds: eviction, never an error
            assert cc.save(slots_of_blocks([i], BS), [1000 + i], [BS]).success == 1
        stats = node.store.stats()
        assert stats.used_bytes <= capacity
        assert stats.evictions >= 10
        assert cc.exists([1000]).success == 0  # oldest evicted
        newest = list(range(12, 16))
        assert cc.exists([1000 + i for i in newest]).success == 4
        poisoned = poison(cache)
        slots = slots_of_blocks(newest, BS)
        assert cc.load(slots, [1000 + i for i in newest], [BS] * 4).success == 4
        assert_cache_equals(cache, expected_after_load(original, poisoned, slots))
        # a load of the evicted ones is a miss, not an error, and writes nothing
        poisoned = poison(cache)
        assert cc.load(slots_of_blocks([0, 1], BS), [1000, 1001], [BS, BS]).success == 0
        assert_cache_equals(cache, poisoned)
    finally:
        cc.close()


def test_lru_order_follows_reads(fault_node_factory):
    """Loading a block refreshes it: the least recently *used* block goes first."""
    token_bytes = 2 * 2 * 2 * 8 * 2
    block_value = HEADER_SIZE + BS * token_bytes
    capacity = 3 * (block_value + 17 + 8 + ENTRY_OVERHEAD)
    node = fault_node_factory(capacity)
    cc = direct_cc([node])
    try:
        cache = make_cache(layers=2, blocks=6, block_size=BS, heads=2, head_size=8)
        cc.register_kvcache(cache)
        for i in range(3):
            assert cc.save(slots_of_blocks([i], BS), [i], [BS]).success == 1
        assert cc.load(slots_of_blocks([0], BS), [0], [BS]).success == 1  # 0 is now the newest
        assert cc.save(slots_of_blocks([3], BS), [3], [BS]).success == 1  # evicts 1
        assert cc.exists([0]).success == 1
        assert cc.exists([1]).success == 0
        assert cc.exists([2, 3]).success == 2
    finally:
        cc.close()


def test_value_larger_than_pool_is_refused():
    Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "m"), pool_capacity=4096))
    cc = Ems.get_cc()
    cache = make_cache(layers=4, blocks=4, block_size=16, heads=4, head_size=16, dtype=torch.float32)  # 16 KiB/block
    cc.register_kvcache(cache)
    result = cc.save([0], [1], [1])  # 1 token: 512 bytes, fits
    assert result.success == 1
    slots = list(range(16, 32)) + [2]
    result = cc.save(slots, [2, 3], [16, 1])  # block 2 alone exceeds the pool: refused, success stops there
    assert (result.success, result.total) == (0, 2)
    assert cc.exists([2]).success == 0
    poisoned = poison(cache)
    assert cc.load(slots, [2, 3], [16, 1]).success == 0
    assert_cache_equals(cache, poisoned)


# ------------------------------------------------------------------ damaged and foreign values


@pytest.mark.parametrize("mode", ["flip", "header", "truncate", "empty"])
def test_damaged_stored_value_is_a_miss(faulty, mode):
    cc, node = faulty
    cache = _setup(cc)
    hashes = [11, 12, 13]
    slots = slots_of_blocks([0, 4, 2], BS)
    original = snapshot(cache)
    assert cc.save(slots, hashes, [BS] * 3).success == 3
    (key,) = [k for k in node.stored_keys() if is_block(k, [12])]
    node.corrupt_stored(key, mode)
    poisoned = poison(cache)
    assert cc.load(slots, hashes, [BS] * 3).success == 1
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots[:BS]))


def test_damage_in_transit_is_a_miss(faulty):
    cc, node = faulty
    cache = _setup(cc)
    assert cc.save(slots_of_blocks([1, 2], BS), [1, 2], [BS, BS]).success == 2
    node.corrupt_gets = "flip"
    poisoned = poison(cache)
    assert cc.load(slots_of_blocks([1, 2], BS), [1, 2], [BS, BS]).success == 0
    assert_cache_equals(cache, poisoned)


def test_damaged_v0_value_is_a_miss(faulty):
    cc, node = faulty
    option = CcKvOption()
    buf = fill_random(torch.empty(100, dtype=torch.int8))
    w = [[KvBufferWrapper(buf.data_ptr(), 100)]]
    assert cc.save(option, [PrimaryKey("a", "b")], w).success == 1
    node.corrupt_stored(node.stored_keys()[0], "flip")
    fill_random(buf)
    before = buf.clone()
    assert cc.load(option, [PrimaryKey("a", "b")], w).success == 0
    assert torch.equal(buf, before)


def test_store_rejects_a_damaged_put(faulty):
    """A torn value sent to a node is refused there (the node checks header and checksum)."""
    cc, node = faulty
    _setup(cc)
    original_put = node.inner.put

    def torn_put(keys, values, timeout_s):
        values = [[bytes(b"".join(bytes(p) for p in parts))[:-1]] for parts in values]
        return original_put(keys, values, timeout_s)

    node.inner.put = torn_put
    assert cc.save([0, 1], [5], [2]).success == 0
    assert [k for k in node.stored_keys() if not is_record_key(k)] == []  # (the namespace record aside)


@pytest.mark.parametrize(
    "other",
    [
        dict(dtype=torch.bfloat16),  # same bytes per element, other dtype
        dict(heads=4, head_size=4),  # same row bytes, other head split
        dict(heads=1, head_size=16),
    ],
    ids=["dtype", "heads", "heads1"],
)
def test_value_from_another_layout_is_a_miss(fault_node_factory, other):
    """Two engines of one model with differently shaped caches share a pool: neither loads the other's bytes."""
    node = fault_node_factory()
    a = direct_cc([node])
    b = direct_cc([node])
    try:
        cache_a = make_cache(layers=2, blocks=4, block_size=BS, heads=2, head_size=8, dtype=torch.float16)
        a.register_kvcache(cache_a)
        shape = dict(layers=2, blocks=4, block_size=BS, heads=2, head_size=8, dtype=torch.float16)
        shape.update(other)
        cache_b = make_cache(**shape)
        b.register_kvcache(cache_b)
        assert a.save(slots_of_blocks([0, 1], BS), [1, 2], [BS, BS]).success == 2
        poisoned = poison(cache_b)
        assert b.exists([1, 2]).success == 0
        assert b.load(slots_of_blocks([0, 1], BS), [1, 2], [BS, BS]).success == 0
        assert_cache_equals(cache_b, poisoned)
    finally:
        a.close()
        b.close()


def test_foreign_value_under_the_right_key_is_a_miss(faulty):
    """Even if a key collided, a value whose header names another layout is never copied in."""
    cc, node = faulty
    cache = _setup(cc, dtype=torch.float16)
    assert cc.save(slots_of_blocks([0], BS), [1], [BS]).success == 1
    assert cc.save(slots_of_blocks([1], BS, [2]), [2], [2]).success == 1  # 2 tokens: another value shape
    keys = node.stored_keys()
    (k1,) = [k for k in keys if is_block(k, [1])]
    (k2,) = [k for k in keys if is_block(k, [2])]
    node.corrupt_stored(k1, replacement=bytes(node.store.get(k2)))
    poisoned = poison(cache)
    assert cc.load(slots_of_blocks([0], BS), [1], [BS]).success == 0
    assert_cache_equals(cache, poisoned)


# ------------------------------------------------------------------ node failures


def test_failed_node_raises_io_error_and_exists_reports_zero(faulty):
    cc, node = faulty
    cache = _setup(cc)
    assert cc.save([0, 1], [1], [2]).success == 1
    node.fail = True
    with pytest.raises(EmsException) as info:
        cc.save([0, 1], [2], [2])
    assert info.value.status_code() == EmsErrorCode.EMS_IO_ERROR
    poisoned = poison(cache)
    with pytest.raises(EmsException) as info:
        cc.load([0, 1], [1], [2])
    assert info.value.status_code() == EmsErrorCode.EMS_IO_ERROR
    assert_cache_equals(cache, poisoned)
    assert cc.exists([1]).success == 0
    future = cc.async_load([0, 1], [1], [2])
    with pytest.raises(EmsException) as info:
        cc.get_result(future)
    assert info.value.status_code() == EmsErrorCode.EMS_IO_ERROR
    node.fail = False  # the pool comes back
    assert cc.exists([1]).success == 1


def test_one_of_two_nodes_failing_fails_only_its_keys(fault_node_factory):
    good, bad = fault_node_factory(address="node-a:1"), fault_node_factory(address="node-b:2")
    cc = direct_cc([good, bad])
    try:
        cache = make_cache(layers=2, blocks=16, block_size=BS)
        cc.register_kvcache(cache)
        hashes = list(range(1, 17))
        slots = slots_of_blocks(range(16), BS)
        assert cc.save(slots, hashes, [BS] * 16).success == 16
        bad.fail = True
        original = snapshot(cache)
        poisoned = poison(cache)
        n = cc.load(slots, hashes, [BS] * 16).success
        assert 0 <= n < 16  # some keys live on the failed node (rendezvous over 2 nodes, 16 keys)
        assert cc.exists(hashes).success <= n
        assert_cache_equals(cache, expected_after_load(original, poisoned, slots[: n * BS]))
    finally:
        cc.close()


def test_hanging_node_times_out(fault_node_factory):
    """A node that never answers: the call returns within the option's timeout with EMS_IO_TIMEOUT."""
    a, b = fault_node_factory(address="node-a:1"), fault_node_factory(address="node-b:2")
    cc = direct_cc([a, b])
    try:
        cache = make_cache(layers=1, blocks=16, block_size=BS)
        cc.register_kvcache(cache)
        hashes = list(range(1, 17))
        slots = slots_of_blocks(range(16), BS)
        a.hang = b.hang = True
        option = CcKvOption(timeout=200)
        start = time.monotonic()
        with pytest.raises(EmsException) as info:
            cc.save(slots, hashes, [BS] * 16, option)
        assert info.value.status_code() == EmsErrorCode.EMS_IO_TIMEOUT
        assert cc.exists(hashes, option).success == 0
        poisoned = poison(cache)
        with pytest.raises(EmsException) as info:
            cc.load(slots, hashes, [BS] * 16, option)
        assert info.value.status_code() == EmsErrorCode.EMS_IO_TIMEOUT
        assert time.monotonic() - start < 5.0
        a.release(), b.release()
        time.sleep(0.05)
        assert_cache_equals(cache, poisoned)  # a late answer never lands in the cache
    finally:
        a.release(), b.release()
        cc.close()


def test_slow_node_within_timeout_is_fine(faulty):
    cc, node = faulty
    cache = _setup(cc)
    node.delay_s = 0.05
    original = snapshot(cache)
    assert cc.save([0, 1, 2], [1], [3], CcKvOption(timeout=5000)).success == 1
    poisoned = poison(cache)
    assert cc.load([0, 1, 2], [1], [3], CcKvOption(timeout=0)).success == 1
    assert_cache_equals(cache, expected_after_load(original, poisoned, [0, 1, 2]))


@pytest.mark.parametrize("method", ["save", "async_save"])
def test_staging_allocation_failure_is_an_ems_exception(cc, method, monkeypatch):
    """EmsException is the only exception type: an allocator refusing the value's buffer is EMS_INTERNAL_ERROR, and
    nothing stays reserved. (The embedded pool gathers straight into the store's buffers: the store allocates.)"""
    t = fill_random(torch.empty(16))
    keys = [PrimaryKey("a", "b")]
    # a value larger than the whole pool is refused before anything is allocated: a miss, not an error
    assert cc.get_result(cc.async_save(CcKvOption(), keys, [[KvBufferWrapper(t.data_ptr(), 2**62)]])).success == 0
    store = Ems._pool.store
    used = store.stats().used_bytes
    monkeypatch.setattr(
        "ems.store.recycling.BufferSupply.fresh", lambda self, nbytes, count: (_ for _ in ()).throw(MemoryError("no memory"))
    )
    with pytest.raises(EmsException) as info:
        getattr(cc, method)(CcKvOption(), keys, [[KvBufferWrapper(t.data_ptr(), 64)]])
    assert info.value.status_code() == EmsErrorCode.EMS_INTERNAL_ERROR
    monkeypatch.undo()
    assert cc._staging._leased_bytes == 0 and store.stats().used_bytes == used  # the reservation was released
    # the client still works afterwards (no leaked staging or in-flight slot)
    w = [[KvBufferWrapper(t.data_ptr(), 64)]]
    assert cc.get_result(cc.async_save(CcKvOption(), keys, w)).success == 1


@pytest.mark.parametrize("nodes", [1, 2])
def test_transport_bug_is_an_ems_exception_never_a_wrong_block(fault_node_factory, nodes):
    """A node raising something other than TransportError (a transport bug) still yields EmsException / 0 hits."""
    made = [fault_node_factory(address=f"n{i}:1") for i in range(nodes)]
    cc = direct_cc(made)
    try:
        cache = make_cache(layers=1, blocks=4, block_size=BS)
        cc.register_kvcache(cache)
        assert cc.save([0, 1], [1], [2]).success == 1

        def broken(*args, **kwargs):
            raise RuntimeError("transport bug")

        for node in made:
            node.get = broken
            node.exists = broken
            node.put = broken
        poisoned = poison(cache)
        with pytest.raises(EmsException):
            cc.load([0, 1], [1], [2])
        with pytest.raises(EmsException):
            cc.save([0, 1], [1], [2])
        assert cc.exists([1]).success == 0
        assert_cache_equals(cache, poisoned)
    finally:
        cc.close()

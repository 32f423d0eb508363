"""The client's local read cache (remote pools): write_rcache keeps what was written, reads are served from it first,
read_local_only never leaves the process, and whatever it serves is still verified."""

from __future__ import annotations

from ems_testlib import assert_cache_equals, expected_after_load, make_cache, poison, slots_of_blocks, snapshot

from ems import CcConfig, CcKvOption, ContextCaching, EmsConfig
from ems.backends.pool_client import PoolClient
from ems.settings import resolve_settings

BS = 4


def _cc(node, read_cache=1 << 20):
    pool = PoolClient([node], read_cache_capacity=read_cache)
    assert pool.read_cache is not None
    cc = ContextCaching(CcConfig(0, 0, "rc"), None, pool, resolve_settings(EmsConfig()))
    cache = make_cache(layers=2, blocks=6, block_size=BS)
    cc.register_kvcache(cache)
    return cc, pool, cache


def test_write_rcache_serves_reads_when_the_node_fails(fault_node_factory):
    node = fault_node_factory()
    cc, _pool, cache = _cc(node)
    try:
        original = snapshot(cache)
        assert cc.save(slots_of_blocks([0], BS), [1], [BS], CcKvOption(write_rcache=True)).success == 1
        assert cc.save(slots_of_blocks([1], BS), [2], [BS], CcKvOption(write_rcache=False)).success == 1
        node.fail = True
        poisoned = poison(cache)
        slots = slots_of_blocks([0, 1], BS)
        assert cc.load(slots, [1, 2], [BS, BS]).success == 1  # block 1 from the read cache, block 2 unreachable
        assert_cache_equals(cache, expected_after_load(original, poisoned, slots[:BS]))
    finally:
        cc.close()


def test_read_local_only_never_calls_the_node(fault_node_factory):
    node = fault_node_factory()
    cc, _pool, cache = _cc(node)
    try:
        original = snapshot(cache)
        assert cc.save(slots_of_blocks([0, 1], BS), [1, 2], [BS, BS], CcKvOption(write_rcache=False)).success == 2
        gets = node.calls["get"], node.calls["exists"]
        local = CcKvOption(read_local_only=True)
        poisoned = poison(cache)
        assert cc.load(slots_of_blocks([0, 1], BS), [1, 2], [BS, BS], local).success == 0
        assert cc.exists([1, 2], local).success == 0
        assert (node.calls["get"], node.calls["exists"]) == gets
        assert_cache_equals(cache, poisoned)
        assert cc.load(slots_of_blocks([0, 1], BS), [1, 2], [BS, BS]).success == 2  # the node has them
        assert_cache_equals(cache, expected_after_load(original, poisoned, slots_of_blocks([0, 1], BS)))
    finally:
        cc.close()


def _damage_the_read_cache_entry(pool) -> None:
    """Flip the last payload byte of the read cache's only entry (white-box: the node keeps its good copy)."""
    (key,) = list(pool.read_cache._entries)
    value = bytearray(pool.read_cache._entries[key])
    value[-1] ^= 0xFF
    pool.read_cache._entries[key] = bytes(value)


def test_damaged_read_cache_entry_is_a_miss(fault_node_factory):
    node = fault_node_factory()
    cc, pool, cache = _cc(node)
    try:
        assert cc.save(slots_of_blocks([0], BS), [1], [BS]).success == 1
        _damage_the_read_cache_entry(pool)
        poisoned = poison(cache)
        assert cc.load(slots_of_blocks([0], BS), [1], [BS], CcKvOption(read_local_only=True)).success == 0
        assert_cache_equals(cache, poisoned)
    finally:
        cc.close()


def test_unverifiable_read_cache_entry_does_not_shadow_the_node(fault_node_factory):
    node = fault_node_factory()
    cc, pool, cache = _cc(node)
    try:
        original = snapshot(cache)
        assert cc.save(slots_of_blocks([0], BS), [1], [BS]).success == 1
        _damage_the_read_cache_entry(pool)
        poisoned = poison(cache)
        assert cc.load(slots_of_blocks([0], BS), [1], [BS]).success == 1  # the node still has the good value
        assert_cache_equals(cache, expected_after_load(original, poisoned, slots_of_blocks([0], BS)))
    finally:
        cc.close()


def test_many_entries_are_placed_in_one_batch_and_a_damaged_one_in_the_middle_is_not(fault_node_factory):
    """Four blocks kept by the save: a load from the read cache alone places the run before the damaged second
    entry and nothing after it (the batch never copies a value that failed its check); with the node, every block
    loads (the node's good copy replaces the damaged one)."""
    node = fault_node_factory()
    cc, pool, cache = _cc(node)
    blocks, hashes = [0, 1, 2, 3], [11, 12, 13, 14]
    try:
        original = snapshot(cache)
        assert cc.save(slots_of_blocks(blocks, BS), hashes, [BS] * 4).success == 4
        key = list(pool.read_cache._entries)[1]
        value = bytearray(pool.read_cache._entries[key])
        value[-1] ^= 0xFF
        pool.read_cache._entries[key] = bytes(value)
        poisoned = poison(cache)
        local = cc.load(slots_of_blocks(blocks, BS), hashes, [BS] * 4, CcKvOption(read_local_only=True))
        assert local.success == 1
        assert_cache_equals(cache, expected_after_load(original, poisoned, slots_of_blocks([0], BS)))
        assert key not in pool.read_cache._entries  # dropped: it never shadows the node's copy
        poisoned = poison(cache)
        assert cc.load(slots_of_blocks(blocks, BS), hashes, [BS] * 4).success == 4
        assert_cache_equals(cache, expected_after_load(original, poisoned, slots_of_blocks(blocks, BS)))
    finally:
        cc.close()

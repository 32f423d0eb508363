"""Async calls (CcFuture, is_ready, get_result, back-pressure, the engine reusing blocks at once) and concurrent
saves and loads from several threads."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from ems_testlib import (
    assert_cache_equals,
    bytes_equal,
    direct_cc,
    expected_after_load,
    fill_random,
    make_cache,
    on_both_pools,
    poison,
    slots_of_blocks,
    snapshot,
)

from ems import CcFuture, CcKvOption, CcResult, EmsErrorCode, EmsException
from ems.store.ns_records import is_record_key

BS = 4


def test_async_save_copies_out_before_returning(faulty):
    """After async_save returns the engine may overwrite the blocks: the ORIGINAL bytes are what gets stored."""
    cc, node = faulty
    cache = make_cache(layers=2, blocks=6, block_size=BS, dtype=torch.bfloat16)
    cc.register_kvcache(cache)
    node.delay_s = 0.2  # the transfer is still running when the engine overwrites
    slots = slots_of_blocks([1, 4, 2], BS)
    original = snapshot(cache)
    future = cc.async_save(slots, [1, 2, 3], [BS] * 3)
    assert isinstance(future, CcFuture)
    poison(cache)  # the engine reuses the blocks at once
    assert cc.is_ready(future) is False
    assert cc.get_result(future) == CcResult(3, 3)
    assert cc.is_ready(future) is True
    node.delay_s = 0.0
    poisoned = poison(cache)
    assert cc.load(slots, [1, 2, 3], [BS] * 3).success == 3
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots))


def test_async_v0_save_copies_out_before_returning(faulty):
    from ems import KvBufferWrapper, PrimaryKey

    cc, node = faulty
    node.delay_s = 0.2
    buf = fill_random(torch.empty(256, dtype=torch.float32))
    original = buf.clone()
    w = [[KvBufferWrapper(buf.data_ptr(), 1024)]]
    future = cc.async_save(CcKvOption(), [PrimaryKey("x", "y")], w)
    fill_random(buf)
    assert future.result(timeout=10).success == 1
    node.delay_s = 0.0
    fill_random(buf)
    assert cc.load(CcKvOption(), [PrimaryKey("x", "y")], w).success == 1
    assert bytes_equal(buf, original)


def test_is_ready_never_blocks_and_result_timeout(faulty):
    cc, node = faulty
    cache = make_cache(layers=1, blocks=4, block_size=BS)
    cc.register_kvcache(cache)
    node.hang = True
    future = cc.async_save([0, 1], [1], [2], CcKvOption(timeout=0))
    start = time.monotonic()
    for _ in range(100):
        assert cc.is_ready(future) is False
    assert time.monotonic() - start < 0.5
    with pytest.raises(EmsException) as info:
        future.result(timeout=0.05)
    assert info.value.status_code() == EmsErrorCode.EMS_IO_TIMEOUT
    node.release()
    assert cc.get_result(future).success == 1


@on_both_pools
def test_load_after_resolved_save_sees_it(cc):
    cache = make_cache(layers=2, blocks=8, block_size=BS)
    cc.register_kvcache(cache)
    for step in range(5):  # the engine's loop: save after each step, resolved before the next
        fill_random(cache[0][0])
        fill_random(cache[1][1])
        original = snapshot(cache)
        slots = slots_of_blocks([step, step + 1], BS)
        future = cc.async_save(slots, [10 * step, 10 * step + 1], [BS, BS])
        assert cc.get_result(future).success == 2
        poisoned = poison(cache)
        lf = cc.async_load(slots, [10 * step, 10 * step + 1], [BS, BS])
        assert cc.get_result(lf) == CcResult(2, 2)
        assert_cache_equals(cache, expected_after_load(original, poisoned, slots))


def test_backpressure_max_inflight_one_does_not_deadlock(fault_node_factory):
    node = fault_node_factory()
    cc = direct_cc([node], max_inflight=1)
    try:
        cache = make_cache(layers=2, blocks=16, block_size=BS)
        cc.register_kvcache(cache)
        node.delay_s = 0.01
        original = snapshot(cache)
        futures = [cc.async_save(slots_of_blocks([i], BS), [i], [BS]) for i in range(16)]
        # a refused call must give its in-flight slot back
        for _ in range(3):
            with pytest.raises(EmsException):
                cc.async_save([0], [1, 2], [1])
            with pytest.raises(EmsException):
                cc.async_load([0, 0], [1], [2])
        assert [cc.get_result(f).success for f in futures] == [1] * 16
        poisoned = poison(cache)
        loads = [cc.async_load(slots_of_blocks([i], BS), [i], [BS]) for i in range(16)]
        assert [f.result(timeout=30).success for f in loads] == [1] * 16
        assert_cache_equals(cache, expected_after_load(original, poisoned, slots_of_blocks(range(16), BS)))
    finally:
        cc.close()


def test_close_waits_for_pending_saves(fault_node_factory):
    node = fault_node_factory()
    cc = direct_cc([node])
    cache = make_cache(layers=1, blocks=4, block_size=BS)
    cc.register_kvcache(cache)
    node.delay_s = 0.1
    futures = [cc.async_save(slots_of_blocks([i], BS), [i], [BS]) for i in range(4)]
    cc.close()
    assert all(f.done() and f.result().success == 1 for f in futures)
    assert sum(not is_record_key(k) for k in node.stored_keys()) == 4  # the blocks (and the namespace record)


def test_async_failure_surfaces_in_get_result(faulty):
    cc, node = faulty
    cc.register_kvcache(make_cache(layers=1, blocks=4, block_size=BS))
    node.fail = True
    future = cc.async_save([0, 1], [1], [2])
    with pytest.raises(EmsException) as info:
        cc.get_result(future)
    assert info.value.status_code() == EmsErrorCode.EMS_IO_ERROR


@on_both_pools
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_concurrent_saves_and_loads(cc, use_async):
    threads, ops, blocks_per_thread = 4, 20, 3
    cache = make_cache(layers=2, blocks=threads * blocks_per_thread, block_size=BS, heads=2, head_size=8)
    cc.register_kvcache(cache)
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads)

    def call(name, *args):
        if use_async:
            return cc.get_result(getattr(cc, "async_" + name)(*args))
        return getattr(cc, name)(*args)

    def worker(t: int) -> None:
        try:
            rng = random.Random(t)
            gen = torch.Generator().manual_seed(t)
            mine = list(range(t * blocks_per_thread, (t + 1) * blocks_per_thread))
            barrier.wait()
            for op in range(ops):
                order = mine[:]
                rng.shuffle(order)
                offsets = [rng.randint(1, BS) for _ in order]
                slots = slots_of_blocks(order, BS, offsets)
                hashes = [(t << 32) | (op << 8) | i for i in range(len(order))]
                for layer in cache:
                    for tensor in layer:
                        fill_random(tensor[mine[0] : mine[-1] + 1], gen)
                expected = [tensor[mine[0] : mine[-1] + 1].clone() for layer in cache for tensor in layer]
                assert call("save", slots, hashes, offsets).success == len(order)
                for layer in cache:
                    for tensor in layer:
                        fill_random(tensor[mine[0] : mine[-1] + 1], gen)
                poisoned = [tensor[mine[0] : mine[-1] + 1].clone() for layer in cache for tensor in layer]
                assert call("load", slots, hashes, offsets).success == len(order)
                local = [s - mine[0] * BS for s in slots]
                want = expected_after_load(expected, poisoned, local)
                got = [tensor[mine[0] : mine[-1] + 1] for layer in cache for tensor in layer]
                for g, w in zip(got, want):
                    assert bytes_equal(g, w), f"thread {t} op {op}: wrong bytes"
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not any(w.is_alive() for w in workers), "a worker hung"
    assert not errors, errors[0]


def test_concurrent_traffic_under_eviction_never_loads_wrong_bytes(fault_node_factory):
    """A pool far too small for the traffic: loads miss, but whatever they load is exact and the rest untouched."""
    from ems.store.kv_store import ENTRY_OVERHEAD
    from ems.store.value_format import HEADER_SIZE

    layers, heads, head_size = 2, 2, 8
    block_value = HEADER_SIZE + BS * layers * 2 * heads * head_size * 2
    node = fault_node_factory(6 * (block_value + 32 + ENTRY_OVERHEAD))
    cc = direct_cc([node])
    threads, ops, per_thread = 4, 15, 3
    cache = make_cache(layers=layers, blocks=threads * per_thread, block_size=BS, heads=heads, head_size=head_size)
    cc.register_kvcache(cache)
    errors: list[BaseException] = []
    outcomes: list[int] = []

    def worker(t: int) -> None:
        try:
            gen = torch.Generator().manual_seed(100 + t)
            mine = list(range(t * per_thread, (t + 1) * per_thread))
            lo, hi = mine[0], mine[-1] + 1
            for op in range(ops):
                slots = slots_of_blocks(mine, BS)
                hashes = [(t << 40) | (op << 8) | i for i in range(per_thread)]
                for layer in cache:
                    for tensor in layer:
                        fill_random(tensor[lo:hi], gen)
                saved = [tensor[lo:hi].clone() for layer in cache for tensor in layer]
                cc.save(slots, hashes, [BS] * per_thread)
                for layer in cache:
                    for tensor in layer:
                        fill_random(tensor[lo:hi], gen)
                poisoned = [tensor[lo:hi].clone() for layer in cache for tensor in layer]
                n = cc.load(slots, hashes, [BS] * per_thread).success
                outcomes.append(n)
                want = expected_after_load(saved, poisoned, [s - lo * BS for s in slots[: n * BS]])
                for g, w in zip([tensor[lo:hi] for layer in cache for tensor in layer], want):
                    assert bytes_equal(g, w), f"thread {t} op {op}: wrong bytes after a {n}-block load"
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert not any(w.is_alive() for w in workers)
        assert not errors, errors[0]
        assert node.store.stats().used_bytes <= node.store.capacity_bytes
        assert len(outcomes) == threads * ops
    finally:
        cc.close()

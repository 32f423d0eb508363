"""Every call form round-trips bytes exactly: V0, V1 slot_mapping, V1 chunk_descs; dtypes; partial blocks; interleaved
views; layer groups of different shapes; sync and async forms. Loads go into a poisoned cache and must touch only the
slots they name."""

from __future__ import annotations

import random

import pytest
import torch
from ems_testlib import (
    DTYPES,
    assert_cache_equals,
    bytes_equal,
    expected_after_load,
    fill_random,
    make_cache,
    on_both_pools,
    poison,
    slots_of_blocks,
    snapshot,
)

from ems import CcConfig, CcKvOption, Ems, EmsConfig, KvBufferWrapper, PrimaryKey, StoreLayerGroupDesc


def _call(cc, name: str, sync: bool, *args, **kwargs):
    if sync:
        return getattr(cc, name)(*args, **kwargs)
    future = getattr(cc, "async_" + name)(*args, **kwargs)
    return cc.get_result(future)


@on_both_pools
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["separate", "interleaved"])
def test_slot_mapping_roundtrip(cc, dtype, interleaved, sync):
    bs = 4
    cache = make_cache(layers=3, blocks=8, block_size=bs, heads=2, head_size=6, dtype=dtype, interleaved=interleaved)
    cc.register_kvcache(cache)
    # non-adjacent blocks in arbitrary order, tokens within blocks shuffled, last block partial
    offsets = [bs, bs, bs, 3]
    blocks = [5, 1, 7, 2]
    slots = []
    for b, n in zip(blocks, offsets):
        block = [b * bs + o for o in range(n)]
        random.Random(b).shuffle(block)
        slots += block
    hashes = [random.getrandbits(64) for _ in blocks]
    original = snapshot(cache)
    assert _call(cc, "save", sync, slots, hashes, offsets).success == 4
    poisoned = poison(cache)
    result = _call(cc, "load", sync, slots, hashes, offsets)
    assert (result.success, result.total) == (4, 4)
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots))


@on_both_pools
def test_load_into_other_slots_moves_the_rows(cc):
    """A block saved from slots A and loaded into slots B lands in B, token by token in order."""
    cache = make_cache(layers=2, blocks=6, block_size=4, dtype=torch.bfloat16)
    cc.register_kvcache(cache)
    src = [0, 1, 2, 3, 9, 10]
    dst = [20, 21, 22, 23, 5, 4]
    original = snapshot(cache)
    assert cc.save(src, [11, 12], [4, 2]).success == 2
    poisoned = poison(cache)
    assert cc.load(dst, [11, 12], [4, 2]).success == 2
    expected = [p.clone() for p in poisoned]
    for e, o in zip(expected, original):
        for s, d in zip(src, dst):
            e[d // 4, d % 4] = o[s // 4, s % 4]
    assert_cache_equals(cache, expected)


@on_both_pools
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_chunk_descs_roundtrip_with_layer_groups(cc, sync):
    """Three layer groups with different block sizes, heads, head sizes and dtypes; runs of varied lengths."""
    g0 = make_cache(layers=2, blocks=5, block_size=4, heads=2, head_size=8, dtype=torch.float16)
    g1 = make_cache(layers=1, blocks=3, block_size=8, heads=1, head_size=5, dtype=torch.float32)
    g2 = make_cache(layers=2, blocks=4, block_size=2, heads=3, head_size=4, dtype=torch.int8, interleaved=True)
    cache = [g0[0], g1[0], g2[0], g0[1], g2[1]]  # groups interleaved in layer order
    groups = [
        StoreLayerGroupDesc(store_block_size=4, layer_ids=[0, 3]),
        StoreLayerGroupDesc(store_block_size=8, layer_ids=[1]),
        StoreLayerGroupDesc(store_block_size=2, layer_ids=[2, 4]),
    ]
    cc.register_kvcache(cache, groups)
    hashes = [-5, 2**63 + 7, 42]
    chunk_descs = [
        [(8, 4), (1, 3), (17, 2)],  # group 0: 20 slots
        [(16, 8), (0, 5), (9, 1)],  # group 1: 24 slots
        [(6, 2), (0, 1), (3, 2)],  # group 2: 8 slots (run 3..4 crosses a block boundary)
    ]
    original = snapshot(cache)
    result = _call(cc, "save", sync, hashes=hashes, chunk_descs=chunk_descs)
    assert (result.success, result.total) == (3, 3)
    poisoned = poison(cache)
    assert _call(cc, "load", sync, hashes=hashes, chunk_descs=chunk_descs).success == 3
    layer_group = {0: 0, 3: 0, 1: 1, 2: 2, 4: 2}
    expected = []
    for i, (o, p) in enumerate(zip(original, poisoned)):
        runs = chunk_descs[layer_group[i // 2]]
        slots = [s + k for s, n in runs for k in range(n)]
        expected += expected_after_load([o], [p], slots)
    assert_cache_equals(cache, expected)


@on_both_pools
def test_slot_mapping_with_layer_groups(cc):
    """slot_mapping on a multi-group layout: every group takes the same slots."""
    g0 = make_cache(layers=1, blocks=4, block_size=4, heads=2, head_size=8, dtype=torch.float16)
    g1 = make_cache(layers=1, blocks=4, block_size=4, heads=4, head_size=2, dtype=torch.float32)
    cache = [g0[0], g1[0]]
    cc.register_kvcache(cache, [StoreLayerGroupDesc(store_block_size=4, layer_ids=[0]), StoreLayerGroupDesc(4, [1])])
    slots = [13, 2, 7, 8, 9]
    original = snapshot(cache)
    assert cc.save(slots, [1, 2], [3, 2]).success == 2
    poisoned = poison(cache)
    assert cc.load(slots, [1, 2], [3, 2]).success == 2
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots))


def _v0_buffers(sizes_per_key, dtype=torch.float32):
    """One random CPU tensor per buffer; value i is its buffers concatenated."""
    tensors = [[fill_random(torch.empty(n, dtype=dtype)) for n in sizes] for sizes in sizes_per_key]
    values = [[KvBufferWrapper(t.data_ptr(), t.numel() * t.element_size()) for t in ts] for ts in tensors]
    return tensors, values


@on_both_pools
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_v0_roundtrip(cc, sync):
    option = CcKvOption()
    keys = [PrimaryKey("req-1", f"layer-{i}") for i in range(4)]
    tensors, values = _v0_buffers([[16, 3], [1], [100, 7, 9], [33]])
    original = [[t.clone() for t in ts] for ts in tensors]
    result = _call(cc, "save", sync, option, keys, values)
    assert (result.success, result.total) == (4, 4)
    for ts in tensors:
        for t in ts:
            fill_random(t)
    assert _call(cc, "load", sync, option, keys, values).success == 4
    for ts, os_ in zip(tensors, original):
        for t, o in zip(ts, os_):
            assert bytes_equal(t, o)
    assert cc.exists(keys).success == 4


@on_both_pools
def test_v0_value_loads_into_differently_split_buffers(cc):
    """A V0 value is its buffers' bytes concatenated: loading into another split of the same length works."""
    option = CcKvOption()
    key = [PrimaryKey("d", "a")]
    src = fill_random(torch.empty(64, dtype=torch.int8))
    assert cc.save(option, key, [[KvBufferWrapper(src.data_ptr(), 64)]]).success == 1
    dst = fill_random(torch.empty(120, dtype=torch.int8))
    before = dst.clone()
    parts = [KvBufferWrapper(dst.data_ptr() + 16, 10), KvBufferWrapper(dst.data_ptr() + 40, 54)]
    assert cc.load(option, key, [parts]).success == 1
    expected = before.clone()
    expected[16:26] = src[:10]
    expected[40:94] = src[10:64]
    assert bytes_equal(dst, expected)
    # a split of another total length is a different value: a miss, nothing written
    dst2 = fill_random(torch.empty(63, dtype=torch.int8))
    before2 = dst2.clone()
    assert cc.load(option, key, [[KvBufferWrapper(dst2.data_ptr(), 63)]]).success == 0
    assert bytes_equal(dst2, before2)


@pytest.mark.parametrize("backend", ["host", "torch", "memcpy"])
def test_forced_kernel_backends_roundtrip(backend):
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m"), pool_capacity="16MiB", kernel_backend=backend))
    cc = Ems.get_cc()
    cache = make_cache(layers=2, blocks=6, block_size=4, dtype=torch.bfloat16, interleaved=True)
    cc.register_kvcache(cache)
    assert cc.kernel_backend == backend
    slots = slots_of_blocks([4, 0, 2], 4, [4, 4, 1])
    original = snapshot(cache)
    assert cc.save(slots, [1, 2, 3], [4, 4, 1]).success == 3
    assert cc.save(hashes=[7, 8], chunk_descs=[[(0, 4), (10, 3)]]).success == 2
    poisoned = poison(cache)
    assert cc.load(slots, [1, 2, 3], [4, 4, 1]).success == 3
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots))
    poisoned = poison(cache)
    assert cc.load(hashes=[7, 8], chunk_descs=[[(0, 4), (10, 3)]]).success == 2
    assert_cache_equals(cache, expected_after_load(original, poisoned, [0, 1, 2, 3, 10, 11, 12]))


@on_both_pools
def test_same_block_saved_by_slot_mapping_loads_by_chunk_descs(cc):
    """Both V1 forms describe the same value for the same tokens: they share keys and bytes."""
    cache = make_cache(layers=2, blocks=4, block_size=4, dtype=torch.float32)
    cc.register_kvcache(cache)
    original = snapshot(cache)
    assert cc.save([4, 5, 6, 7], [99], [4]).success == 1
    poisoned = poison(cache)
    assert cc.load(hashes=[99], chunk_descs=[[(12, 4)]]).success == 1
    expected = [p.clone() for p in poisoned]
    for e, o in zip(expected, original):
        e[3] = o[1]
    assert_cache_equals(cache, expected)


@on_both_pools
def test_tensor_arguments_as_engines_pass_them(cc):
    """vLLM hands slot_mapping as an int tensor (int32 or int64); hashes and offsets may be numpy/torch too."""
    cache = make_cache(layers=2, blocks=6, block_size=4, dtype=torch.float16)
    cc.register_kvcache(cache)
    slots = [17, 16, 3, 2, 1, 0, 9]
    original = snapshot(cache)
    t32 = torch.tensor(slots, dtype=torch.int32)
    assert cc.save(t32, torch.tensor([5, 6, 7]), torch.tensor([2, 4, 1])).success == 3
    poisoned = poison(cache)
    import numpy as np

    assert cc.load(torch.tensor(slots, dtype=torch.int64), np.array([5, 6, 7]), np.array([2, 4, 1], np.int32)).success == 3
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots))


@on_both_pools
def test_store_block_size_larger_than_engine_block(cc):
    """A stored block may span several engine blocks (store_block_size 16 over engine blocks of 4)."""
    cache = make_cache(layers=2, blocks=8, block_size=4, dtype=torch.float32)
    cc.register_kvcache(cache, [StoreLayerGroupDesc(store_block_size=16, layer_ids=[0, 1])])
    slots = slots_of_blocks([7, 2, 5, 0], 4) + [12, 13, 14]
    original = snapshot(cache)
    assert cc.save(slots, [1, 2], [16, 3]).success == 2
    poisoned = poison(cache)
    assert cc.load(slots, [1, 2], [16, 3]).success == 2
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots))
    original = snapshot(cache)
    assert cc.save(hashes=[3], chunk_descs=[[(2, 16)]]).success == 1  # one run over five engine blocks
    poisoned = poison(cache)
    assert cc.load(hashes=[3], chunk_descs=[[(2, 16)]]).success == 1
    assert_cache_equals(cache, expected_after_load(original, poisoned, list(range(2, 18))))


@on_both_pools
def test_reregistering_replaces_the_layout(cc):
    a = make_cache(layers=1, blocks=4, block_size=4, dtype=torch.float16)
    cc.register_kvcache(a)
    assert cc.save([0, 1, 2, 3], [1], [4]).success == 1
    b = make_cache(layers=1, blocks=4, block_size=4, dtype=torch.float16)
    cc.register_kvcache(b)  # same shape: same namespace, the block is found and lands in the new tensors
    poisoned = poison(b)
    assert cc.load([4, 5, 6, 7], [1], [4]).success == 1
    assert bytes_equal(b[0][0][1], a[0][0][0]) and bytes_equal(b[0][1][1], a[0][1][0])
    assert bytes_equal(b[0][0][0], poisoned[0][0])


@pytest.mark.parametrize(
    "dtype",
    [torch.float64, torch.int32, torch.uint8, torch.int16, torch.float8_e4m3fn, torch.float8_e5m2],
    ids=str,
)
@on_both_pools
def test_other_kv_dtypes_roundtrip(cc, dtype):
    cache = make_cache(layers=2, blocks=4, block_size=4, heads=3, head_size=5, dtype=dtype)
    cc.register_kvcache(cache)
    slots = [3, 9, 4, 15, 0]
    original = snapshot(cache)
    assert cc.save(slots, [1, 2], [3, 2]).success == 2
    assert cc.save(hashes=[3], chunk_descs=[[(10, 3)]]).success == 1
    poisoned = poison(cache)
    assert cc.load(slots, [1, 2], [3, 2]).success == 2
    assert cc.load(hashes=[3], chunk_descs=[[(10, 3)]]).success == 1
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots + [10, 11, 12]))


@pytest.mark.parametrize("backend", ["auto", "memcpy"])
def test_strided_views_roundtrip(backend):
    """Views engines hand out: a head slice (slot stride > row), a block slice with a storage offset, padded blocks."""
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m"), pool_capacity="16MiB", kernel_backend=backend))
    cc = Ems.get_cc()
    base_k = fill_random(torch.empty(7, 4, 4, 8, dtype=torch.float16))
    base_v = fill_random(torch.empty(6, 5, 2, 8, dtype=torch.float16))
    k = base_k[1:, :, 1:3]  # storage offset, slot stride 32 elements, rows of 16
    v = base_v[:, :4]  # padded blocks: block stride 80, 4 slots used
    assert k.shape == v.shape == (6, 4, 2, 8)
    cache = [[k, v]]
    cc.register_kvcache(cache)
    slots = [23, 0, 5, 6, 12, 1]
    original = snapshot(cache)
    outside_k = base_k.clone()
    outside_v = base_v.clone()
    assert cc.save(slots, [1, 2], [4, 2]).success == 2
    poisoned = poison(cache)
    assert cc.load(slots, [1, 2], [4, 2]).success == 2
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots))
    # bytes outside the views were never touched
    assert bytes_equal(base_k[0], outside_k[0]) and bytes_equal(base_k[:, :, 0], outside_k[:, :, 0])
    assert bytes_equal(base_k[:, :, 3], outside_k[:, :, 3]) and bytes_equal(base_v[:, 4], outside_v[:, 4])


@pytest.mark.parametrize("backend", ["host", "torch", "memcpy"])
@pytest.mark.parametrize("mode", ["inference_mode", "requires_grad"])
def test_caches_allocated_as_engines_do_round_trip(mode, backend):
    """vLLM-style caches: allocated under torch.inference_mode(), or leaf tensors that require grad."""
    import torch
    from ems_testlib import embedded_cc

    from ems.store.kv_store import KvStore

    if mode == "inference_mode":
        with torch.inference_mode():
            kv = [[torch.randn(6, 4, 2, 8) for _ in range(2)] for _ in range(3)]
    else:
        kv = [[torch.randn(6, 4, 2, 8, requires_grad=True) for _ in range(2)] for _ in range(3)]
    cc = embedded_cc(KvStore(1 << 24), kernel_backend=backend)
    try:
        cc.register_kvcache(kv)
        slots = list(range(4, 12))
        with torch.no_grad():
            original = [[t[1:3].clone() for t in layer] for layer in kv]
        assert cc.save(slots, [11, 12], [4, 4]).success == 2
        with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
            for layer in kv:
                for t in layer:
                    t.fill_(-7.0)
        assert cc.load(slots, [11, 12], [4, 4]).success == 2
        for layer, want in zip(kv, original):
            for t, w in zip(layer, want):
                assert torch.equal(t.detach()[1:3], w)
    finally:
        cc.close()

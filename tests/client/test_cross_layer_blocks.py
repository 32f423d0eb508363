"""Cross-layer blocks through the public API: an engine whose storage keeps each block's layers together
(`[blocks, layers, 2, block_size, heads, head_size]`) registers it as the SDK's `[layers, 2, blocks, ...]` (one
tensor, or the list of its views); the layout is detected, a whole-block save or load is ONE copy per block on the
memcpy path (2 x layers copies per block otherwise), and the stored values are the same bytes as a per-layer
layout's: either engine loads what the other saved. Partial blocks and values through two blocks fall back to the
planes, still exact; layouts that are not one run per block are never taken for one.
"""

from __future__ import annotations

import pytest
import torch
from ems_testlib import fill_random
from hypothesis import given, settings
from hypothesis import strategies as st

from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsException, StoreLayerGroupDesc
from ems.kernels.base import KernelBackend
from ems.kernels.select import get_backend

OPTION = CcKvOption(timeout=5000)


def _init(backend: str = "memcpy") -> None:
    Ems.init(
        EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="cross"), kernel_backend=backend, pool_capacity="64MiB")
    )


def _block_major(layers: int, blocks: int, bs: int, heads: int, head_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Block-major storage `[blocks, layers, 2, bs, heads, head_size]` of random data, seen as `[layers, 2, ...]`."""
    store = fill_random(torch.empty(blocks, layers, 2, bs, heads, head_size, dtype=dtype))
    return store.permute(1, 2, 0, 3, 4, 5)


def _ops(backend: str = "memcpy") -> int:
    return get_backend(torch.device("cpu"), KernelBackend(backend)).ops_issued


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("form", ["tensor", "list"])
def test_block_major_registration_is_detected_and_moves_one_copy_per_block(form: str) -> None:
    _init()
    cc = Ems.get_cc()
    layers, blocks, bs = 3, 10, 4
    kv = _block_major(layers, blocks, bs, 2, 8, torch.bfloat16)
    cc.register_kvcache(kv if form == "tensor" else [[kv[layer][0], kv[layer][1]] for layer in range(layers)])
    assert [g.cross_layer for g in cc.layout.groups] == [True]
    chosen = [7, 2, 5, 0]
    slots = [b * bs + j for b in chosen for j in range(bs)]
    hashes = [101, 102, 103, 104]
    before = _ops()
    assert cc.save(slots, hashes, [bs] * 4, OPTION).success == 4
    assert _ops() - before == 4  # one copy per block
    saved = kv.clone()
    fill_random(kv)  # the engine reuses its blocks
    before = _ops()
    assert cc.load(slots, hashes, [bs] * 4, OPTION).success == 4
    assert _ops() - before == 4
    for b in range(blocks):
        assert torch.equal(_bytes(kv[:, :, b]), _bytes(saved[:, :, b])) == (b in chosen)

    # the same data as separate per-layer tensors: the same stored values (same layout signature), 2 x layers
    # copies per block, and it loads what the cross-layer engine saved
    separate = [[kv[layer, kvi].clone() for kvi in range(2)] for layer in range(layers)]
    cc.register_kvcache(separate)
    assert [g.cross_layer for g in cc.layout.groups] == [False]
    before = _ops()
    assert cc.load(slots, hashes, [bs] * 4, OPTION).success == 4
    assert _ops() - before == 4 * 2 * layers
    for layer in range(layers):
        for kvi in range(2):
            assert torch.equal(_bytes(separate[layer][kvi][chosen]), _bytes(saved[layer, kvi][chosen]))
    Ems.shutdown()


def test_partial_and_unaligned_values_fall_back_to_planes() -> None:
    """A partial last block and values through two blocks move plane by plane (still exact); whole-block requests
    in the same registration still move one copy per block."""
    _init()
    cc = Ems.get_cc()
    layers, blocks, bs = 2, 8, 4
    kv = _block_major(layers, blocks, bs, 1, 16, torch.float16)
    cc.register_kvcache(kv)
    saved = kv.clone()
    partial = list(range(8, 8 + bs + 3))  # block 2 whole, then 3 tokens of block 3
    before = _ops()
    assert cc.save(partial, [1, 2], [bs, 3], OPTION).success == 2
    assert _ops() - before == 2 * 2 * layers  # per plane: one piece each value
    through = list(range(18, 18 + 2 * bs))  # values of 4 tokens from mid-block: two pieces each
    assert cc.save(through, [3, 4], [bs, bs], OPTION).success == 2
    fill_random(kv)
    poisoned = kv.clone()
    assert cc.load(partial, [1, 2], [bs, 3], OPTION).success == 2
    assert cc.load(through, [3, 4], [bs, bs], OPTION).success == 2
    touched = set(partial) | set(through)
    for s in range(blocks * bs):
        b, j = divmod(s, bs)
        want = saved if s in touched else poisoned
        assert torch.equal(_bytes(kv[:, :, b, j]), _bytes(want[:, :, b, j])), s
    Ems.shutdown()


def test_layer_groups_of_block_major_storage() -> None:
    """A group of consecutive layers is one run per block (blocks further apart than the run); a group of layers
    that are not neighbours is not."""
    _init()
    cc = Ems.get_cc()
    kv = _block_major(4, 6, 2, 2, 4, torch.float16)
    cc.register_kvcache(kv, [StoreLayerGroupDesc(2, [0, 1]), StoreLayerGroupDesc(2, [2, 3])])
    assert [g.cross_layer for g in cc.layout.groups] == [True, True]
    before = _ops()
    assert cc.save([0, 1, 4, 5], [9, 8], [2, 2], OPTION).success == 2
    assert _ops() - before == 2 * 2  # one copy per (block, group)
    cc.register_kvcache(kv, [StoreLayerGroupDesc(2, [0, 2]), StoreLayerGroupDesc(2, [1, 3])])
    assert [g.cross_layer for g in cc.layout.groups] == [False, False]
    Ems.shutdown()


@pytest.mark.parametrize(
    "make",
    [
        lambda: [[fill_random(torch.empty(4, 2, 2, 8)) for _ in range(2)] for _ in range(2)],  # a tensor per plane
        lambda: [[t[:, 0], t[:, 1]] for t in [fill_random(torch.empty(4, 2, 2, 2, 8)) for _ in range(2)]],  # per layer
        lambda: fill_random(torch.empty(4, 2, 2, 2, 2, 8)).permute(2, 1, 0, 3, 4, 5),  # [blocks, 2, layers]: K.. V..
        lambda: fill_random(torch.empty(4, 2, 2, 2, 18))[..., :16].unflatten(-1, (2, 8)).permute(1, 2, 0, 3, 4, 5),
    ],
    ids=["per_plane", "per_layer", "kv_outer", "padded_slots"],
)
def test_other_layouts_are_not_taken_for_cross_layer_blocks(make) -> None:
    _init()
    cc = Ems.get_cc()
    kvcache = make()
    cc.register_kvcache(kvcache)
    assert [g.cross_layer for g in cc.layout.groups] == [False]
    saved = [[kvcache[layer][kv].clone() for kv in range(2)] for layer in range(2)]
    assert cc.save(list(range(4, 8)), [1, 2], [2, 2], OPTION).success == 2
    for layer in range(2):
        for kv in range(2):
            fill_random(kvcache[layer][kv])
    assert cc.load(list(range(4, 8)), [1, 2], [2, 2], OPTION).success == 2
    for layer in range(2):
        for kv in range(2):
            assert torch.equal(_bytes(kvcache[layer][kv][2:4]), _bytes(saved[layer][kv][2:4]))
    Ems.shutdown()


def test_a_six_dimensional_tensor_of_another_shape_is_refused() -> None:
    _init()
    cc = Ems.get_cc()
    for bad in (torch.zeros(2, 3, 4, 2, 2, 8), torch.zeros(2, 2, 4, 2, 8)):
        with pytest.raises(EmsException) as err:
            cc.register_kvcache(bad)
        assert "kvcache" in err.value.message()
    assert cc.layout is None
    Ems.shutdown()


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    backend=st.sampled_from(["host", "torch", "memcpy"]),
    layers=st.integers(1, 3),
    bs=st.sampled_from([1, 2, 4]),
    head_size=st.integers(1, 9),
    dtype=st.sampled_from([torch.float16, torch.float32, torch.int8]),
)
def test_property_random_calls_on_block_major_storage(
    data: st.DataObject, backend: str, layers: int, bs: int, head_size: int, dtype: torch.dtype
) -> None:
    """Random saves (whole blocks, partial blocks, runs through blocks) and loads into a poisoned block-major cache:
    every loaded token row is the saved one, every other byte unchanged, on every CPU backend."""
    blocks = 6
    _init(backend)
    try:
        cc = Ems.get_cc()
        kv = _block_major(layers, blocks, bs, 2, head_size, dtype)
        cc.register_kvcache(kv)
        assert [g.cross_layer for g in cc.layout.groups] == [layers * 2 > 1]
        saved = kv.clone()
        calls = []
        for call in range(data.draw(st.integers(1, 3))):
            start = data.draw(st.integers(0, blocks * bs - 1))
            counts = data.draw(st.lists(st.integers(1, bs), min_size=1, max_size=3))
            counts = counts[: next((i for i in range(len(counts)) if start + sum(counts[: i + 1]) > blocks * bs), len(counts))]
            if not counts:
                continue
            slots = list(range(start, start + sum(counts)))
            hashes = [1000 * call + i for i in range(len(counts))]
            assert cc.save(slots, hashes, counts, OPTION).success == len(counts)
            calls.append((slots, hashes, counts))
        fill_random(kv)
        poisoned = kv.clone()
        touched: set[int] = set()
        for slots, hashes, counts in calls:
            assert cc.load(slots, hashes, counts, OPTION).success == len(counts)
            touched |= set(slots)
        for s in range(blocks * bs):
            b, j = divmod(s, bs)
            want = saved if s in touched else poisoned
            assert torch.equal(_bytes(kv[:, :, b, j]), _bytes(want[:, :, b, j])), s
    finally:
        Ems.shutdown()


@pytest.mark.parametrize("masked", [0, 1, 4, 5, 11])
def test_a_token_form_load_into_cross_layer_blocks_never_writes_the_masked_prefix(masked: int) -> None:
    """The token form on block-major storage: a save of whole blocks moves one run per block; a load whose mask
    covers part of a block (block runs cannot lose tokens) writes exactly the mask-1 tokens, nothing before them."""
    _init()
    cc = Ems.get_cc()
    layers, blocks, bs = 2, 8, 4
    kv = _block_major(layers, blocks, bs, 2, 8, torch.float16)
    cc.register_kvcache(kv)
    assert [g.cross_layer for g in cc.layout.groups] == [True]
    chosen = [6, 1, 3]
    slots = [b * bs + j for b in chosen for j in range(bs)]
    tokens = [7000 + t for t in range(len(slots))]
    before = _ops()
    assert cc.save(slots, token_ids=tokens, mask=[1] * len(slots), option=OPTION).success == len(slots)
    assert _ops() - before == len(chosen)  # one run per block
    saved = kv.clone()
    fill_random(kv)
    poisoned = kv.clone()
    mask = [0] * masked + [1] * (len(slots) - masked)
    assert cc.load(slots, token_ids=tokens, mask=mask, option=OPTION).success == len(slots) - masked
    for i, slot in enumerate(slots):
        b, j = divmod(slot, bs)
        want = saved if i >= masked else poisoned
        assert torch.equal(kv[:, :, b, j], want[:, :, b, j]), (i, slot)
    Ems.shutdown()

"""kv_layouts: every engine layout's blocks, registered as whole-block planes, round-trip through the real
embedded pool byte for byte, on plain tensors of the shapes each backend uses."""

from __future__ import annotations

import random

import pytest
import torch

from ems import CcConfig, Ems, EmsConfig, EmsErrorCode, EmsException
from ems.integrations import kv_layouts
from ems.integrations.kv_layouts import KvLayoutKind

BLOCKS = 12


def _random(shape, dtype=torch.bfloat16, gen=None):
    return torch.randn(shape, generator=gen).to(dtype)


def cpu_layer(gen):  # vLLM CPU attention: [blocks, kv_heads, block_size, 2 * head_size]
    return _random((BLOCKS, 2, 32, 2 * 32), gen=gen)


def flash_layer(gen):  # CUDA flash-attention (vLLM 0.x): [2, blocks, block_size, heads, head_size]
    return _random((2, BLOCKS, 16, 4, 64), gen=gen)


def ascend_layer(gen):  # vllm-ascend: (K, V), each [blocks, block_size, heads, head_size]
    return (_random((BLOCKS, 128, 2, 128), gen=gen), _random((BLOCKS, 128, 2, 128), gen=gen))


def mla_layer(gen):  # MLA latent: [blocks, block_size, kv_lora_rank + rope_dim]
    return _random((BLOCKS, 64, 576), gen=gen)


def nhd_view_layer(gen):  # vLLM 0.3x logical [B, H, N, C] view over NHD memory ([B, N, H, C] physical)
    return _random((BLOCKS, 16, 4, 128), gen=gen).permute(0, 2, 1, 3)


def sliced_layer(gen):  # one layer of a block-outermost cross-layer buffer [B, L, H, N, C]
    return _random((BLOCKS, 3, 2, 32, 64), gen=gen)[:, 1]


LAYOUTS = {
    "cpu": cpu_layer,
    "flash_kv_first": flash_layer,
    "ascend_pair": ascend_layer,
    "mla": mla_layer,
    "nhd_view": nhd_view_layer,
    "cross_layer_slice": sliced_layer,
}


def block_bytes(layer, b: int) -> bytes:
    """The engine's own bytes of block b (what a load must restore), read through the engine's indexing."""
    kind = kv_layouts.detect_kind(layer)
    if kind == KvLayoutKind.KV_PAIR:
        parts = [layer[0][b], layer[1][b]]
    elif kind == KvLayoutKind.KV_FIRST:
        parts = [layer[0, b], layer[1, b]]
    else:
        parts = [layer[b]]
    return b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)


def tensors_of(layer):
    return list(layer) if isinstance(layer, tuple) else [layer]


@pytest.fixture
def cc():
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="layouts"), pool_capacity="256MiB"))
    yield Ems.get_cc()
    Ems.shutdown()


def test_kinds():
    gen = torch.Generator().manual_seed(0)
    assert kv_layouts.detect_kind(cpu_layer(gen)) == KvLayoutKind.BLOCK_FIRST
    assert kv_layouts.detect_kind(flash_layer(gen)) == KvLayoutKind.KV_FIRST
    assert kv_layouts.detect_kind(ascend_layer(gen)) == KvLayoutKind.KV_PAIR
    assert kv_layouts.detect_kind(mla_layer(gen)) == KvLayoutKind.BLOCK_FIRST


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_planes_cover_exactly_each_block(layout):
    gen = torch.Generator().manual_seed(1)
    layer = LAYOUTS[layout](gen)
    k, v = kv_layouts.block_planes(layer, BLOCKS)
    assert k.shape[:3] == (BLOCKS, 1, 1) and k.shape == v.shape
    for b in range(BLOCKS):
        rows = k[b].contiguous().view(torch.uint8).numpy().tobytes() + v[b].contiguous().view(torch.uint8).numpy().tobytes()
        assert sorted(rows) == sorted(block_bytes(layer, b))  # same bytes (order inside a block is the engine's)
    # planes alias the engine's memory: writing a row changes exactly that block
    before = [block_bytes(layer, b) for b in range(BLOCKS)]
    k[3].fill_(7)
    after = [block_bytes(layer, b) for b in range(BLOCKS)]
    assert [i for i in range(BLOCKS) if before[i] != after[i]] == [3]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_roundtrip_through_the_pool(cc, layout):
    """Register 3 layers of a layout, save random blocks, wipe the cache, load them into other blocks: each
    target block holds its source's bytes, every other block stays as it was."""
    gen = torch.Generator().manual_seed(2)
    rng = random.Random(layout)
    layers = [LAYOUTS[layout](gen) for _ in range(3)]
    planes = [kv_layouts.block_planes(layer, BLOCKS) for layer in layers]
    shapes = [kv_layouts.shape_of(p) for p in planes]
    cc.register_kvcache([list(p) for p in planes], kv_layouts.store_groups(shapes))
    for step in range(6):  # state carried between calls: overwrite, reload, new hashes each step
        src = rng.sample(range(BLOCKS), 4)
        hashes = [rng.getrandbits(100) for _ in src]
        original = {(i, b): block_bytes(layer, b) for i, layer in enumerate(layers) for b in src}
        assert cc.save(src, hashes, [1] * len(src)).success == len(src)
        for layer in layers:
            for t in tensors_of(layer):
                t.copy_(_random(t.shape, t.dtype, gen))
        dst = rng.sample(range(BLOCKS), 4)
        untouched = {(i, b): block_bytes(layer, b) for i, layer in enumerate(layers) for b in range(BLOCKS) if b not in dst}
        assert cc.load(dst, hashes, [1] * len(dst)).success == len(dst), step
        for i, layer in enumerate(layers):
            for s, d in zip(src, dst):
                assert block_bytes(layer, d) == original[(i, s)]
            for b in range(BLOCKS):
                if b not in dst:
                    assert block_bytes(layer, b) == untouched[(i, b)]


def test_shadow_layout_addresses_the_same_keys(cc):
    """A process holding no KV cache (vLLM's scheduler) registers the shadow built from sizes alone and sees the
    blocks a worker saved; a shadow of another shape sees nothing."""
    gen = torch.Generator().manual_seed(3)
    layers = [cpu_layer(gen) for _ in range(2)]
    planes = [kv_layouts.block_planes(layer, BLOCKS) for layer in layers]
    shapes = [kv_layouts.shape_of(p) for p in planes]
    page_bytes = layers[0][0].numel() * layers[0].element_size()  # vLLM's real_page_size_bytes of one layer
    assert shapes == [kv_layouts.plane_shape(page_bytes, torch.bfloat16)] * 2
    cc.register_kvcache([list(p) for p in planes], kv_layouts.store_groups(shapes))
    assert cc.save([0, 1, 2], [11, 12, 13], [1, 1, 1]).success == 3
    cc.register_kvcache(kv_layouts.shadow_kvcache(shapes), kv_layouts.store_groups(shapes))
    assert cc.exists([11, 12, 13, 14]).success == 3
    other = [kv_layouts.plane_shape(page_bytes * 2, torch.bfloat16)] * 2
    cc.register_kvcache(kv_layouts.shadow_kvcache(other), kv_layouts.store_groups(other))
    assert cc.exists([11, 12, 13]).success == 0


def test_layouts_that_cannot_move_whole_blocks_are_refused():
    gen = torch.Generator().manual_seed(4)
    heads_outer = _random((2, BLOCKS, 32, 64), gen=gen).transpose(0, 1)  # [B, H, N, C] over [H, B, N, C] memory
    with pytest.raises(EmsException) as info:
        kv_layouts.block_planes(heads_outer, BLOCKS)
    assert info.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    with pytest.raises(EmsException):
        kv_layouts.block_planes(cpu_layer(gen), BLOCKS + 1)  # wrong block count
    with pytest.raises(EmsException):
        kv_layouts.block_planes(_random((BLOCKS, 1, 1, 3), torch.float32, gen), BLOCKS)  # odd block
    with pytest.raises(EmsException):
        kv_layouts.block_planes((cpu_layer(gen), mla_layer(gen)), BLOCKS, KvLayoutKind.KV_PAIR)
    with pytest.raises(EmsException):
        kv_layouts.plane_shape(6, torch.bfloat16)


def test_store_groups_split_by_shape():
    a, b = kv_layouts.PlaneShape(64, torch.bfloat16), kv_layouts.PlaneShape(32, torch.bfloat16)
    groups = kv_layouts.store_groups([a, b, a, b, a])
    assert [g.layer_ids for g in groups] == [[0, 2, 4], [1, 3]]
    assert all(g.store_block_size == 1 for g in groups)


def test_block_outermost_buffer_registers_as_cross_layer_blocks():
    """vLLM's BLHNC cache (one `[blocks, layers, H, N, C]` buffer, each layer a `[B, H, N, C]` view, what the worker
    is handed with `cross_layer_blocks`): its layers' whole-block planes are detected as cross-layer blocks, so a
    save or load of whole engine blocks is ONE copy per block (the memcpy path counts them), byte for byte."""
    from ems import CcKvOption
    from ems.kernels.base import KernelBackend
    from ems.kernels.select import get_backend

    Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "blhnc"), kernel_backend="memcpy", pool_capacity="64MiB"))
    try:
        cc = Ems.get_cc()
        gen = torch.Generator().manual_seed(4)
        layers = 4
        buffer = _random((BLOCKS, layers, 2, 16, 64), gen=gen)  # [B, L, H, N, C]
        planes = [kv_layouts.block_planes(buffer[:, layer], BLOCKS) for layer in range(layers)]
        shapes = [kv_layouts.shape_of(p) for p in planes]
        cc.register_kvcache([list(p) for p in planes], kv_layouts.store_groups(shapes))
        assert [g.cross_layer for g in cc.layout.groups] == [True]
        memcpy = get_backend(torch.device("cpu"), KernelBackend.MEMCPY)
        blocks = [7, 1, 4]
        saved = buffer.clone()
        before = memcpy.ops_issued
        assert cc.save(blocks, [11, 12, 13], [1, 1, 1], CcKvOption()).success == 3  # a slot is an engine block
        assert memcpy.ops_issued - before == 3
        buffer.copy_(_random(buffer.shape, gen=gen))
        poisoned = buffer.clone()
        before = memcpy.ops_issued
        assert cc.load(blocks, [11, 12, 13], [1, 1, 1], CcKvOption()).success == 3
        assert memcpy.ops_issued - before == 3
        for b in range(BLOCKS):
            assert torch.equal(buffer[b], (saved if b in blocks else poisoned)[b])
        # one layer of such a buffer registered alone (LBHNC-like): its blocks are runs too, of one layer each
        cc.register_kvcache([list(planes[0])], kv_layouts.store_groups(shapes[:1]))
        assert [g.cross_layer for g in cc.layout.groups] == [True]
    finally:
        Ems.shutdown()

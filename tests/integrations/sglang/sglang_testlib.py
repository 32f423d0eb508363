"""Helpers of the SGLang HiCache tests: SGLang's own host KV pools on CPU, and the storage config SGLang builds."""

from __future__ import annotations

import json
from typing import Any

import torch

BUDGET = 4 << 30  # bytes of host memory the test pools are booked against
LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 8, 4
TOKENS = 64  # device tokens; the host pool holds twice as many


def host_pool(layout: str, dtype: torch.dtype = torch.bfloat16, page: int = PAGE, layers: int = LAYERS) -> Any:
    """SGLang's `MHATokenToKVPoolHost` over a CPU `MHATokenToKVPool` (as SGLang builds them; pinned memory off)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool(TOKENS, page, dtype, HEADS, HEAD_DIM, layers, "cpu", False, start_layer=0, end_layer=layers - 1)
    # SGLang checks the pool against the host's free memory less a fixed reserve; on this shared machine that
    # depends on whatever else runs, so the pool is booked against an explicit budget (SGLang's own scope)
    with host_memory_budget_scope(BUDGET):
        return MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            page,
            layout,
            pin_memory=False,
            device_capacity_tokens=TOKENS,
            start_layer=0,
            end_layer=layers - 1,
            write_back_staging=None,
        )


def mla_host_pool(layout: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    """SGLang's `MLATokenToKVPoolHost` (latent 16 + rope 8 per token) over a CPU `MLATokenToKVPool`."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    device = MLATokenToKVPool(TOKENS, PAGE, dtype, 16, 8, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS - 1)
    with host_memory_budget_scope(BUDGET):  # (as in host_pool)
        return MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            PAGE,
            layout,
            pin_memory=False,
            device_capacity_tokens=TOKENS,
            start_layer=0,
            end_layer=LAYERS - 1,
            target_layer_num=LAYERS,
        )


def fill(host: Any, seed: int) -> None:
    """Random bytes in the whole host pool."""
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8))


def extra(nodes: list[str], **more: Any) -> dict[str, Any]:
    """The extra config a user writes (`--hicache-storage-backend-extra-config`), as SGLang parses it (JSON)."""
    config = {
        "backend_name": "ems",
        "module_path": "ems.integrations.sglang",
        "class_name": "EmsHiCacheStorage",
        "interface_v1": 1,
        "pool_nodes": ",".join(nodes),
        "local_pool": "off",
        "timeout_ms": 2000,
        **more,
    }
    return json.loads(json.dumps(config))


def storage_config(
    extra_config: dict[str, Any] | None, tp_rank: int = 0, tp_size: int = 1, mla: bool = False, **more: Any
) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    fields = {
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": mla,
        "enable_storage_metrics": False,
        "is_page_first_layout": False,
        "model_name": "org/tiny-model",
        "extra_config": extra_config,
        **more,
    }
    return HiCacheStorageConfig(**fields)


def build(extra_config: dict[str, Any], host: Any, **config: Any) -> Any:
    """The backend as SGLang's cache controller builds and attaches it."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra_config, **config), host)
    backend.register_mem_pool_host(host)
    return backend


def page_indices(host: Any, pages: list[int]) -> torch.Tensor:
    """Host token indices of `pages` (page_size per page, in order), as SGLang passes `host_indices`."""
    page = host.page_size
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * page + torch.arange(page)[None, :]).reshape(-1)


def page_bytes(host: Any, index: int) -> torch.Tensor:
    """Page `index` of an MHA host pool as `[2, layers, page_size, heads, head_dim]` raw bytes (MLA: `[layers,
    page_size, 1, width]`), whatever its layout
    (the test's own reading of SGLang's `kv_buffer` shapes, independent of `ems.integrations.sglang.host_layout`)."""
    kv, page = host.kv_buffer, host.page_size
    if hasattr(host, "kv_lora_rank"):  # MLA: [layers, page_size, 1, latent + rope]
        if host.layout == "layer_first":
            return kv[:, index * page : (index + 1) * page].contiguous().view(torch.uint8).clone()
        if host.layout == "page_first":
            return kv[index * page : (index + 1) * page].permute(1, 0, 2, 3).contiguous().view(torch.uint8).clone()
        return kv[index].contiguous().view(torch.uint8).clone()
    if host.layout == "layer_first":
        canonical = kv[:, :, index * page : (index + 1) * page]
    elif host.layout == "page_first":
        canonical = kv[:, index * page : (index + 1) * page].permute(0, 2, 1, 3, 4)
    elif host.layout == "page_first_direct":
        canonical = kv[:, index]
    elif host.layout == "page_head":
        canonical = kv[:, index].permute(0, 3, 2, 1, 4)
    else:
        raise ValueError(host.layout)
    return canonical.contiguous().view(torch.uint8).clone()


def mamba_host_pool(layout: str = "page_first", slots: int = 16, side_state: bool = False) -> Any:
    """SGLang's `MambaPoolHost` over CPU state buffers (2 layers: temporal state float32 `[4, 8]`, conv state bf16
    `[6, 3]`; with `side_state`, a registered side state int32 `[5]` per slot), as SGLang's hybrid assembler builds it."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    layers = 2
    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, 4, 8, dtype=torch.float32),
        conv=(torch.zeros(layers, slots, 6, 3, dtype=torch.bfloat16),),
        extra_checkpoint_buffers=(torch.zeros(slots, 5, dtype=torch.int32),) if side_state else (),
    )
    with host_memory_budget_scope(BUDGET):  # (as in host_pool)
        return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, layout=layout)


def fill_mamba(host: Any, seed: int) -> None:
    """Random bytes in every state buffer of a Mamba host pool."""
    generator = torch.Generator().manual_seed(seed)
    for buf in (host.temporal_buffer, *host.conv_buffer, *host.slot_state_buffers):
        raw = buf.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=generator, dtype=torch.uint8))


def hybrid_group(kv: Any, **side_pools: Any) -> Any:
    """SGLang's `HostPoolGroup`: the KV pool as the anchor, then the side pools by `PoolName` value."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry

    entries = [
        PoolEntry(name=PoolName.KV, host_pool=kv, device_pool=None, layer_mapper=lambda i: i, is_primary_index_anchor=True)
    ]
    entries += [
        PoolEntry(name=PoolName(name), host_pool=host, device_pool=None, layer_mapper=lambda i: i)
        for name, host in side_pools.items()
    ]
    return HostPoolGroup(entries)


def build_hybrid(extra_config: dict[str, Any], group: Any, **config: Any) -> Any:
    """The backend as SGLang's `HybridCacheController.attach_storage_backend` builds and attaches it: the anchor
    through `register_mem_pool_host`, then every entry of the group through `register_mem_host_pool_v2`."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    anchor = group.anchor_entry.host_pool
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra_config, **config), anchor)
    backend.register_mem_pool_host(anchor)
    for entry in group.entries:
        backend.register_mem_host_pool_v2(entry.host_pool, entry.name)
    backend.on_host_pools_registered()
    return backend


def dsa_pools(layout: str, page: int = 64) -> tuple[Any, Any]:
    """SGLang's DSA (DeepSeek sparse attention) pools on CPU: the MLA host pool of a CPU `DSATokenToKVPool` (the
    anchor: latent 16 + rope 8) and its `DSAIndexerPoolHost` (index keys of head size 128, one buffer row per page),
    as SGLang's hybrid assembler declares it (`make_dsa_indexer_pool_decl`). The device pool reads the attention DCP
    width from SGLang's runtime context, which a process that built no process groups does not have: set to 1 with
    SGLang's own override."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.runtime_context import get_parallel

    tokens = 4 * page
    with get_parallel().override(attn_dcp_size=1):
        device = DSATokenToKVPool(
            tokens, page, 16, torch.bfloat16, 8, LAYERS, "cpu", 128, False, 24, start_layer=0, end_layer=LAYERS - 1
        )
    with host_memory_budget_scope(BUDGET):
        anchor = MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            page,
            layout,
            pin_memory=False,
            device_capacity_tokens=tokens,
            start_layer=0,
            end_layer=LAYERS - 1,
            target_layer_num=LAYERS,
        )
        indexer = DSAIndexerPoolHost(make_dsa_indexer_pool_decl(device), anchor, pin_memory=False)
    return anchor, indexer

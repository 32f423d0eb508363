"""The key namespace of one SGLang rank: every field of `HiCacheStorageConfig` that decides which bytes a page holds.

Contract (no SGLang imports; `storage_config` is read by attribute): `storage_identity(storage_config, model_id)`
returns the `CcConfig_v1` this rank passes to `Ems.init`. What it puts in the pool's key namespace
(`ems.datapath.keys.namespace` digests the CcConfig):

* the TP rank and size (`rank_in_tp_group`, `tp_world_size`), except for a rank-replicated model (`is_mla_model`:
  MLA, and SGLang's compressed MLA pools), whose TP ranks hold the same bytes and share one copy
  (`kvcache_type=MLA`: the namespace says "shared");
* the PP rank and size (`rank_in_pp_group`, `pp_world_size`): each stage holds its own layers;
* in the model id (`derive_model_id`: the model name's tail plus a digest of every part): the model name SGLang gives
  (it already carries the host pool's storage format tag), attention context parallelism (`attn_cp_rank/size`: each
  CP rank holds a disjoint slice of every page), decode context parallelism (`dcp_rank/size`: each DCP rank of an MLA
  model holds a slice of the page's tokens), and SGLang's head splitting (`should_split_heads`, `tp_lcm_size`). A
  `model_id` in the extra config replaces the derived one (TP, PP stay in the CcConfig).

A hybrid model's side pool (SGLang's v2: Mamba state, SWA, draft pools) gets a model id of its own,
`pool_model_id(storage_config, model_id, pool)`: this rank's KV model id (above) with the pool's name, the TP rank
(or "shared", as for the MLA KV, except for the Mamba state, which SGLang shards by TP rank even for an MLA model)
and the PP rank in its digest, so two pools never share a key, whatever their geometry.

Left out, on purpose: the data-parallel rank (replicas hold the same bytes), the host pool's layout (the stored value
is the same for `layer_first`, `page_first` and `page_first_direct`: `backend.host_planes`), and the geometry (heads,
head size, dtype, layers: the registered layout's signature is part of the namespace; a page size that differs gives
values of another length, which a load refuses as a miss).
"""

from __future__ import annotations

from typing import Any

from ems.config import CcConfig_v1
from ems.integrations.connector_config import derive_model_id

ENGINE = "sglang"


def namespace_parts(storage_config: Any) -> dict[str, str]:
    """The model-id parts of `storage_config` (a `HiCacheStorageConfig`): name -> canonical text."""
    parts = {
        "engine": ENGINE,
        "attn_cp": f"{int(storage_config.attn_cp_rank)}/{int(storage_config.attn_cp_size)}",
        "dcp": f"{int(getattr(storage_config, 'dcp_rank', 0))}/{int(getattr(storage_config, 'dcp_size', 1))}",
        "rank_replicated": str(bool(storage_config.is_mla_model)),
    }
    if getattr(storage_config, "should_split_heads", False):
        parts["split_heads"] = f"tp_lcm_size={storage_config.tp_lcm_size}"
    return parts


def storage_identity(storage_config: Any, model_id: str | None) -> CcConfig_v1:
    """The `CcConfig_v1` of this rank (see the module contract)."""
    tp_rank, tp_size = int(storage_config.tp_rank), int(storage_config.tp_size)
    pp_rank, pp_size = int(storage_config.pp_rank), int(storage_config.pp_size)
    name = storage_config.model_name or "model"
    return CcConfig_v1(
        rank_id=pp_rank * tp_size + tp_rank,
        device_id=0,
        model_id=model_id or derive_model_id(str(name), namespace_parts(storage_config)),
        tp_world_size=tp_size,
        pp_world_size=pp_size,
        rank_in_tp_group=tp_rank,
        rank_in_pp_group=pp_rank,
        llm_engine=ENGINE,
        kvcache_type="MLA" if storage_config.is_mla_model else "MHA",
    )


RANK_SHARDED_POOLS = ("mamba",)  # side pools SGLang shards by TP rank even when the model's MLA KV is replicated


def pool_model_id(storage_config: Any, model_id: str | None, pool: str) -> str:
    """The model id of side pool `pool` (its name, e.g. "mamba", "swa") of this rank (see the module contract)."""
    base = storage_identity(storage_config, model_id)
    shared = bool(storage_config.is_mla_model) and pool not in RANK_SHARDED_POOLS
    parts = {
        "engine": ENGINE,
        "pool": pool,
        "tp": "shared" if shared else f"{base.rank_in_tp_group}/{base.tp_world_size}",
        "pp": f"{base.rank_in_pp_group}/{base.pp_world_size}",
    }
    return derive_model_id(base.model_id, parts)

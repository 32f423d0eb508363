"""What both halves of `EmsConnector` share: the engine's settings as the connector reads them, and the SDK client.

Contract:
* `ConnectorContext.from_vllm(vllm_config, kv_cache_config)` reads the connector's settings
  (`connector_config.ConnectorConfig`, refused where bad), refuses what the connector does not support
  (`engine_checks.check_supported`), derives the key namespace (`namespace`), resolves the pool (the host's local
  node, configured nodes, etcd or Mooncake) and initialises the process's SDK client (`Ems.init`; every process of
  one engine passes an equal config, so a process that hosts both halves initialises once), logs the start-up
  warning of a configuration that can never share blocks (`engine_checks.sharing_warning`) and describes the
  namespace to the client's record (`ContextCaching.describe_namespace`: the model path, `namespace_parts`, the
  TP size and the prefix hashing; `ems.client.namespaces`). The scheduler half
  (`scheduler.EmsScheduler`) and the worker half (`worker.EmsWorker`) each take one.
* `role` is vLLM's `kv_role` (`connector_config.KvRole`): the scheduler half never asks the pool for a producer's
  requests and never sends a consumer's blocks to it.
* KV cache groups (`groups`, one `engine_checks.GroupKind` per vLLM group): a hybrid model (several groups, vLLM's
  hybrid memory allocator) shares one block pool and one KV cache allocation among its groups: layer `i` of every
  group views the same pages, and block id `b` is owned by one group at a time. So the connector registers one
  "layer" per aliased page (`layer_names` names group 0's layer there; `shared_layers` the others, which must view
  the same memory: checked when the worker registers), and moving engine block `b` moves exactly the bytes of its
  owning group's layers. With one group every layer is registered, as before.
* The context holds no per-request state and starts no thread; its fields never change.
* Registration (`register_shadow`, `register_worker`): what this process registered with its process-wide
  `ContextCaching`: a worker's real KV cache, or the scheduler's one-block shadow of the same layout (the scheduler
  holds no KV cache, and `exists` needs a layout). A worker always registers (replacing a shadow); the scheduler
  only when nothing is registered yet, so it never replaces a worker's cache in a process that hosts both.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ems import CcKvOption, ContextCaching, Ems
from ems.integrations import kv_layouts
from ems.integrations.connector_config import ConnectorConfig, KvRole, ResolvedPool, TransferGranularity, derive_model_id
from ems.integrations.transfer_stats import StatsSink
from ems.integrations.vllm.engine_checks import GroupKind, check_supported, group_kind, prefix_hash_part, sharing_warning
from ems.integrations.vllm.namespace import namespace_parts, predicted_backend

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("ems.integrations.vllm")
_registered_lock = threading.Lock()
_registered: tuple[weakref.ref[ContextCaching], str] | None = None  # the client, and "shadow" or "worker"


@dataclass(frozen=True)
class ConnectorContext:
    """The engine as the connector sees it (see the module contract)."""

    config: ConnectorConfig
    block_size: int  # tokens per engine block (= one pool value per rank)
    hash_stride: int  # vLLM block hashes per engine block (block size / hash block size)
    tp_size: int
    mla: bool  # one shared latent KV per block for every TP rank
    num_blocks: int
    layer_names: tuple[str, ...]  # in layer order (a hybrid model: group 0's layer of each aliased page)
    shapes: tuple[kv_layouts.PlaneShape, ...]  # each layer's planes, from vLLM's KV cache spec
    backend: str  # the attention backend the namespace names
    model_id: str
    pool: ResolvedPool
    cc: ContextCaching
    stats: StatsSink  # what this connector counted (scheduler lookups, worker transfers)
    role: KvRole = KvRole.BOTH  # vLLM's kv_role: a producer never loads, a consumer never saves
    groups: tuple[GroupKind, ...] = (GroupKind.FULL,)  # vLLM's KV cache groups, in vLLM's order
    shared_layers: tuple[tuple[str, ...], ...] = ()  # per `layer_names` entry, the other layers on its tensor
    windows: tuple[int | None, ...] = (None,)  # per group, a sliding window's tokens (None: full attention)

    @property
    def hybrid(self) -> bool:
        """Several KV cache groups: every key names its group (`engine_keys.group_hashes`)."""
        return len(self.groups) > 1

    @property
    def option(self) -> CcKvOption:
        """The option of every load and save."""
        return CcKvOption(timeout=self.config.timeout_ms)

    @property
    def block_bytes(self) -> int:
        return sum(s.block_bytes for s in self.shapes)

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> ConnectorContext:
        transfer = vllm_config.kv_transfer_config
        if transfer is None:
            raise ValueError("EmsConnector needs vLLM's kv_transfer_config")
        config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config, vllm_config.device_config.device_type)
        role = KvRole.of(transfer.kv_role)
        check_supported(vllm_config, kv_cache_config)
        block_size = int(vllm_config.cache_config.block_size)
        hash_block_size = int(kv_cache_config.hash_block_size or block_size)
        mla = bool(vllm_config.model_config.use_mla)
        groups = tuple(group_kind(g.kv_cache_spec) or GroupKind.FULL for g in kv_cache_config.kv_cache_groups)
        if len(groups) > 1 and config.transfer_granularity is TransferGranularity.LAYER:
            raise ValueError(
                "EmsConnector: kv_connector_extra_config.transfer_granularity 'layer' is not supported with several "
                "KV cache groups (a hybrid model): use 'step'"
            )
        if len(groups) > 1:  # one registered layer per aliased page: the bytes of a block id, whichever group owns it
            layer_names, shared = _aliased_layers(kv_cache_config)
        else:
            layer_names = tuple(sorted({n for t in kv_cache_config.kv_cache_tensors for n in t.layers}, key=_layer_order))
            shared = tuple(() for _ in layer_names)
        shapes = tuple(_tensor_shape(kv_cache_config, (name, *others)) for name, others in zip(layer_names, shared))
        parts = namespace_parts(vllm_config, kv_cache_config)
        model_id = config.model_id or derive_model_id(str(vllm_config.model_config.model), parts)
        warning = sharing_warning(vllm_config)
        if warning is not None:
            logger.warning("%s", warning)
        pool = config.resolve_pool()
        Ems.init(config.ems_config(model_id, "MLA" if mla else "MHA", pool))
        cc = Ems.get_cc()
        if cc is None:
            raise RuntimeError("Ems.init gave no ContextCaching")
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        record_parts = {
            **parts,
            "tp_size": "shared (MLA)" if mla else str(tp_size),
            "prefix_hash": prefix_hash_part(vllm_config),
        }
        if config.model_id:
            record_parts["model_id"] = model_id  # set by hand: it alone decides the namespace
        cc.describe_namespace(model=str(vllm_config.model_config.model), parts=record_parts)
        return cls(
            config=config,
            block_size=block_size,
            hash_stride=block_size // hash_block_size,
            tp_size=tp_size,
            mla=mla,
            num_blocks=int(kv_cache_config.num_blocks),
            layer_names=layer_names,
            shapes=shapes,
            backend=predicted_backend(vllm_config, kv_cache_config),
            model_id=model_id,
            pool=pool,
            cc=cc,
            stats=StatsSink(),
            role=role,
            groups=groups,
            shared_layers=shared,
            windows=tuple(
                int(g.kv_cache_spec.sliding_window) if kind is GroupKind.SLIDING else None
                for g, kind in zip(kv_cache_config.kv_cache_groups, groups)
            ),
        )

    def register_shadow(self) -> None:
        """Register the one-block shadow of the layout, unless this process registered anything already."""
        global _registered
        with _registered_lock:
            if _registered is None or _registered[0]() is not self.cc:  # (a client of an earlier `Ems.init`: gone)
                self.cc.register_kvcache(kv_layouts.shadow_kvcache(list(self.shapes)), kv_layouts.store_groups(list(self.shapes)))
                _registered = (weakref.ref(self.cc), "shadow")

    def register_worker(self, planes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Register a worker's KV cache (each layer's two planes), replacing a shadow."""
        global _registered
        with _registered_lock:
            self.cc.register_kvcache([list(p) for p in planes], kv_layouts.store_groups(list(self.shapes)))
            _registered = (weakref.ref(self.cc), "worker")


def _spec_shape(kv_cache_config: KVCacheConfig, layer: str) -> kv_layouts.PlaneShape:
    groups = kv_cache_config.kv_cache_groups
    spec = next((g.kv_cache_spec for g in groups if layer in g.layer_names), groups[0].kv_cache_spec)
    per_layer = getattr(spec, "kv_cache_specs", None)
    if per_layer is not None:
        spec = per_layer[layer]
    return kv_layouts.plane_shape(int(spec.real_page_size_bytes), spec.dtype)


def _aliased_layers(kv_cache_config: KVCacheConfig) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """A hybrid model's layers by the bytes they view: vLLM lays every group's layers over one allocation from byte 0
    (`KVCacheTensor`: layer `i` of a group at `offset + i * layer_stride`), so layer `i` of every group views the same
    pages (a block id is one group's at a time). Returns the first layer of each index and the others on it; groups
    laid out otherwise (unequal pages: their layers overlap only in part) are refused."""
    tensors = kv_cache_config.kv_cache_tensors
    strides = {(int(t.offset), int(t.layer_stride), int(t.block_stride)) for t in tensors}
    if len(strides) != 1 or next(iter(strides))[0] != 0:
        raise ValueError(
            "EmsConnector: this hybrid model's KV cache groups are laid out with different pages "
            f"(offset, layer stride, block stride: {sorted(strides)}), so one group's block is not another's: "
            "not supported"
        )
    depth = max(len(t.layers) for t in tensors)
    at_index = [tuple(t.layers[i] for t in tensors if i < len(t.layers)) for i in range(depth)]
    return tuple(layers[0] for layers in at_index), tuple(layers[1:] for layers in at_index)


def _tensor_shape(kv_cache_config: KVCacheConfig, layers: tuple[str, ...]) -> kv_layouts.PlaneShape:
    """The plane of aliased layers: every one must hold a block in the same bytes (a hybrid model whose
    groups pad their pages differently would leave some of a block's bytes unmoved: refused)."""
    shapes = {_spec_shape(kv_cache_config, layer) for layer in layers}
    if len(shapes) != 1:
        raise ValueError(
            f"EmsConnector: the layers {list(layers)} view the same pages but hold a block in different bytes "
            f"({sorted(shapes, key=repr)}): not supported"
        )
    return shapes.pop()


def _layer_order(name: str) -> tuple[int, str]:
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return extract_layer_index(name), name
    # a name without a layer index: order by name after the indexed ones
    except (ImportError, ValueError, IndexError, AttributeError):
        return 1 << 30, name

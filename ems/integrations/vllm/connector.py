"""`EmsConnector`: vLLM's `KVConnectorBase_V1` over the EMS pool (written against vLLM 0.32's interface).

Load it with
`--kv-transfer-config '{"kv_connector":"EmsConnector","kv_connector_module_path":"ems.integrations.vllm",
"kv_role":"kv_both","kv_connector_extra_config":{...}}'` (keys: `ems.integrations.connector_config`).

Contract:
* Namespace: the `model_id` is derived from everything that decides a block's bytes (`namespace`), so engines
  that differ there never share a block; within it, every key is hashed with the model's current epoch
  (`ems.integrations.epoch`, a record in the pool). `reset_cache` (vLLM's `reset_prefix_cache(reset_connector=
  True)`) writes a new epoch: every earlier block misses from then on, for this engine at once and for every other
  engine of the model within `epoch_refresh_s` (the scheduler re-reads the record on a daemon thread). Requests
  admitted before a reset save nothing more.
* Refused at start (`engine_checks`): pipeline or context parallelism, several KV cache groups, non-full-attention
  caches. A load that comes up short (a node died) recomputes its blocks where vLLM's top-level
  `kv_load_failure_policy` says vLLM's default; requests fail on it only where the extra config's
  `load_failure_policy` says "fail" (`engine_checks.apply_failure_policy`).
* Scheduler side: `get_num_new_matched_tokens` never asks the pool on the scheduler's thread: it records a lookup
  (the request's full prompt blocks after the local prefix-cache hit, by vLLM's own `request.block_hashes`; never
  the block holding the last prompt token, vLLM must compute at least one token) and answers None ("ask again next
  step"); `build_connector_meta` hands the step's lookups to `lookup_batcher` (one batch, a background thread,
  `exists` per distinct prefix with the lookup timeout and circuit breaker), and the next step takes the answer.
  The pool leases the blocks a lookup reports to the load that follows (`lease_ms`), so eviction cannot turn a
  reported hit into a failed load; a load reads the epoch its lookup found the blocks in.
  A hit loads asynchronously: the request waits while others run. `update_state_after_alloc` records the load,
  `build_connector_meta` sends the loads and the full prompt blocks computed by this step (each block once per
  request, again when vLLM recomputes blocks after a failed load) to the workers.
* Worker side: `register_kv_caches` registers each layer's tensor as two planes whose rows are whole vLLM blocks
  (`kv_layouts`) and checks that the layers use the attention backend the namespace names; `start_load_kv`
  starts loads; `wait_for_save` queues the step's saves on `save_copier`'s thread and returns: the copy-out of the
  blocks runs off the step. A finished request with saves sent keeps its blocks (`request_finished` True) until
  every worker reports it in `get_finished`'s finished_sending, once its copy-outs have ended; a request preempted
  with copy-outs pending makes `handle_preemptions` wait for them before the forward that may reuse its blocks.
  Blocks promised but not loaded are reported by `get_block_ids_with_load_errors` (vLLM recomputes them or fails
  the request, by its policy), and nothing the request computed in that step is saved: never a wrong prefix, in
  the engine or in the pool.
* TP: each rank saves its shard under rank-tagged keys; a lookup hits only where every rank has the block. MLA:
  one shared key per block, saved by rank 0.
* `get_kv_connector_stats`: `EmsConnectorStats` (lookup hits/misses from the scheduler; blocks, bytes, seconds
  loaded and saved from the workers; `reduce()` adds GB/s).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ems import CcKvOption, Ems
from ems.integrations import kv_layouts
from ems.integrations.block_transfer import BlockMover, PendingLoad, StatsSink, TransferStats
from ems.integrations.connector_config import ConnectorConfig, derive_model_id
from ems.integrations.epoch import EpochRecord
from ems.integrations.lookup_batcher import LookupBatcher
from ems.integrations.lookup_breaker import LookupBreaker
from ems.integrations.save_copier import SaveCopier
from ems.integrations.vllm.engine_checks import apply_failure_policy, check_supported
from ems.integrations.vllm.namespace import namespace_parts, predicted_backend
from ems.integrations.vllm.observability import EmsPromMetrics, KvEventLog

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("ems.integrations.vllm")

# What this process registered with its (process-wide) ContextCaching: a worker's real KV cache, or the scheduler's
# one-block shadow of the same layout. A worker always registers (replacing a shadow); the scheduler only when
# nothing is registered yet, so that it never replaces a worker's cache in a process that hosts both.
_registered_lock = threading.Lock()
_registered: str | None = None


@dataclass
class BlockTransfer:
    req_id: str
    block_ids: list[int]
    hashes: list[bytes]
    epoch: bytes = b""  # the namespace epoch the request was admitted in (`ems.integrations.epoch`)
    cancelled: bool = False  # a load promised before a reset: reported failed, never loaded


@dataclass
class EmsConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    idle: bool = False  # nothing scheduled this step (every request waits, e.g. for its load)
    # requests with saves sent, preempted by this step's schedule: their blocks may be handed to other requests
    # and written by this step's forward, so their copy-outs must end first (`handle_preemptions`)
    preempted: set[str] = field(default_factory=set)


# With nothing scheduled, vLLM's engine loop calls the workers again at once; a worker whose loads or copy-outs are
# still running waits this long for one to end instead of spinning (which would take the CPU and the GIL from them).
IDLE_WAIT_S = 0.01
# A scheduler that could not read the namespace epoch (a private one meanwhile: only misses) asks again this soon.
EPOCH_RETRY_S = 0.5
# A preemption waits for the preempted requests' copy-outs (never skipped: their blocks are about to be reused); a
# copy-out that takes this long is said in the log.
PREEMPTION_WARN_S = 5.0


def _step_end_event(device: torch.device) -> Callable[[], Callable[[], None]] | None:
    """On an accelerator, a factory of "the step's kernels have written the blocks" waits for the copier (an event
    recorded on the current stream at `wait_for_save`); None on CPU, where the forward has finished when vLLM calls
    `wait_for_save`."""
    if device.type == "cpu":
        return None

    def record() -> Callable[[], None]:
        event = torch.Event(device=device)
        event.record()
        return event.synchronize

    return record


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


@dataclass
class _RequestState:
    request: Request
    block_ids: list[int]
    next_save: int  # index of the first prompt block not yet saved (or known to be in the pool)
    epoch: bytes  # the epoch it was admitted in: after a reset its blocks (old KV) are never saved


@dataclass(frozen=True)
class _Lookup:
    start: int  # first block asked for
    hits: int
    asked: int
    epoch: bytes
    at: float  # time.monotonic() of the answer

    def fresh(self, start: int, asked: int, epoch: bytes, now: float, max_age_s: float) -> bool:
        return (self.start, self.asked, self.epoch) == (start, asked, epoch) and now - self.at <= max_age_s


class _EpochWatch:
    """The scheduler's view of the namespace epoch: read at start, on reset, and every `refresh_s` seconds by a
    daemon thread (never on the scheduler's step), so that a reset by another engine reaches this one."""

    def __init__(self, record: EpochRecord, refresh_s: float) -> None:
        self._record = record
        self._lock = threading.Lock()
        first = record.current()
        self._epoch, self._ok = first.epoch, first.ok  # not ok: a private epoch until a read succeeds (soon)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(refresh_s,), name="ems-epoch", daemon=True)
        self._thread.start()

    @property
    def epoch(self) -> bytes:
        with self._lock:
            return self._epoch

    def _run(self, refresh_s: float) -> None:
        ok = self._ok
        while not self._stop.wait(refresh_s if ok else min(refresh_s, EPOCH_RETRY_S)):
            read = self._record.current()
            ok = read.ok
            if read.ok:
                with self._lock:
                    if read.epoch != self._epoch:
                        logger.info("EmsConnector: the namespace epoch changed (a reset): earlier blocks now miss")
                    self._epoch = read.epoch

    def reset(self) -> bool:
        epoch = self._record.reset()
        if epoch is None:
            return False
        with self._lock:
            self._epoch = epoch
        return True

    def close(self) -> None:
        self._stop.set()


def _layer_order(name: str) -> tuple[int, str]:
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return extract_layer_index(name), name
    # a name without a layer index: order by name after the indexed ones
    except (ImportError, ValueError, IndexError, AttributeError):
        return 1 << 30, name


class EmsConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("EmsConnector needs vLLM's kv_cache_config (vLLM >= 0.11)")
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._config = ConnectorConfig.from_extra(extra)
        check_supported(vllm_config, kv_cache_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        hash_block_size = int(kv_cache_config.hash_block_size or self._block_size)
        self._hash_stride = self._block_size // hash_block_size
        self._tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self._mla = bool(vllm_config.model_config.use_mla)
        self._option = CcKvOption(timeout=self._config.timeout_ms)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._layer_names = sorted({n for t in kv_cache_config.kv_cache_tensors for n in t.layers}, key=_layer_order)
        self._shapes = [self._spec_shape(name) for name in self._layer_names]
        self._stats = StatsSink()
        self._backend = predicted_backend(vllm_config, kv_cache_config)
        model_id = self._config.model_id or derive_model_id(
            str(vllm_config.model_config.model), namespace_parts(vllm_config, kv_cache_config)
        )
        self.model_id = model_id
        pool = self._config.resolve_pool()
        self._ems_config = self._config.ems_config(model_id, "MLA" if self._mla else "MHA", pool)
        Ems.init(self._ems_config)
        cc = Ems.get_cc()
        if cc is None:
            raise RuntimeError("Ems.init gave no ContextCaching")
        self._cc = cc
        # scheduler state
        self._lookups: dict[str, _Lookup] = {}
        self._requests: dict[str, _RequestState] = {}
        self._loads: dict[str, BlockTransfer] = {}
        # requests with saves sent to the workers since they were last admitted: when one finishes, vLLM keeps its
        # blocks until every worker has copied them out (`request_finished` True, the workers' finished_sending)
        self._saving: set[str] = set()
        self._epoch_watch: _EpochWatch | None = None
        self._events = KvEventLog()
        # worker state
        self._mover: BlockMover | None = None
        self._load_errors: set[int] = set()
        self._queued_loads: list[BlockTransfer] = []  # not started yet (in-flight budget)
        self._inflight_loads: dict[str, PendingLoad] = {}
        self._done_loads: set[str] = set()  # finished without a transfer (cancelled)
        self._load_ended = threading.Event()
        self._copier: SaveCopier | None = None
        self._ready_event: Callable[[], Callable[[], None]] | None = None
        self._save_requests: set[str] = set()  # requests this worker was sent saves for (the scheduler's _saving)
        if role == KVConnectorRole.SCHEDULER:
            apply_failure_policy(self._kv_transfer_config, self._config.load_failure_policy)
            self._epoch_watch = _EpochWatch(EpochRecord(cc, self._config.timeout_ms), self._config.epoch_refresh_s)
        self._breaker = LookupBreaker(
            cc,
            self._tp_size,
            self._mla,
            self._config.lookup_timeout_ms,
            self._config.breaker_cooldown_s,
            self._stats,
            self._config.lease_ms,
        )
        self._batcher = LookupBatcher(self._breaker)
        self._asking: dict[str, tuple[int, int, bytes]] = {}  # request -> (start, blocks, epoch) asked, unanswered
        logger.info(
            "EmsConnector (%s): pool %s%s, model_id %s, %d layers, block %d tokens, %d B/block, tp %d%s, "
            "attention %s, load failures: %s",
            role.name,
            ",".join(pool.nodes) or "embedded",
            " (local node, this user's key)" if pool.local else "",
            model_id,
            len(self._layer_names),
            self._block_size,
            sum(s.block_bytes for s in self._shapes),
            self._tp_size,
            ", MLA" if self._mla else "",
            self._backend,
            self._kv_transfer_config.kv_load_failure_policy,
        )

    def _spec_shape(self, layer: str) -> kv_layouts.PlaneShape:
        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)
        if per_layer is not None:
            spec = per_layer[layer]
        return kv_layouts.plane_shape(int(spec.real_page_size_bytes), spec.dtype)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    # ------------------------------------------------------------------ scheduler side

    def _hashes(self, request: Request) -> list[bytes]:
        hashes = request.block_hashes
        if self._hash_stride == 1:
            return list(hashes)
        return list(hashes[self._hash_stride - 1 :: self._hash_stride])

    def _ensure_lookup_layout(self) -> None:
        global _registered
        with _registered_lock:
            if _registered is None:
                self._cc.register_kvcache(kv_layouts.shadow_kvcache(self._shapes), kv_layouts.store_groups(self._shapes))
                _registered = "shadow"

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Pool blocks past the local hit, never asked on this thread: the lookup goes to the batcher (one batch per
        step, `build_connector_meta`) and vLLM is told None ("ask again next step") until it is answered. A hit is
        loaded asynchronously (the request waits, others run)."""
        rid = request.request_id
        full = min((request.num_prompt_tokens - 1) // self._block_size, len(request.block_hashes) // self._hash_stride)
        start = num_computed_tokens // self._block_size
        if full <= start:
            self._lookups[rid] = _Lookup(start, 0, 0, b"", 0.0)  # nothing to ask; saves start after the local hit
            return 0, False
        epoch = self._current_epoch()
        now = time.monotonic()
        cached = self._lookups.get(rid)
        # a request vLLM could not admit yet is asked again every step: the answer is reused for a while
        if cached is not None and cached.fresh(start, full - start, epoch, now, self._config.lookup_cache_s):
            return cached.hits * self._block_size, cached.hits > 0
        wanted = (start, full - start, epoch)
        asked = self._asking.get(rid)
        hits = self._batcher.answer(rid)
        if asked == wanted and hits is None and self._batcher.asked(rid):
            return None, False  # still being asked
        if asked != wanted or hits is None:  # not asked yet (or asked for other blocks, before a reset)
            hashes = self._hashes(request)[start:full]
            if not self._breaker.is_open():
                self._ensure_lookup_layout()
                self._batcher.ask(rid, hashes, epoch)
                self._asking[rid] = wanted
                return None, False
            hits = self._breaker.lookup(hashes, epoch)  # the pool counts as down: 0 at once, no network
        self._asking.pop(rid, None)
        self._lookups[rid] = _Lookup(start, hits, full - start, epoch, now)
        return hits * self._block_size, hits > 0

    def _current_epoch(self) -> bytes:
        return self._epoch_watch.epoch if self._epoch_watch is not None else b""

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        found = self._lookups.pop(rid, None)
        start, asked = (found.start, found.asked) if found else (request.num_computed_tokens // self._block_size, 0)
        loaded = num_external_tokens // self._block_size
        if asked:
            self._stats.add(lookup_hit_blocks=loaded, lookup_miss_blocks=asked - loaded)
        block_ids = list(blocks.get_block_ids()[0])
        # a load reads the epoch its lookup found (and leased) the blocks in; the request saves only while that is
        # still the epoch (a reset in between: its KV may be the old weights')
        epoch = found.epoch if found is not None and loaded > 0 else self._current_epoch()
        if loaded > 0:
            hashes = self._hashes(request)
            self._loads[rid] = BlockTransfer(rid, block_ids[start : start + loaded], hashes[start : start + loaded], epoch)
        self._requests[rid] = _RequestState(request, block_ids, start + loaded, epoch)

    def _add_saves(
        self, meta: EmsConnectorMetadata, state: _RequestState, computed_before: int, computed_after_step: int
    ) -> None:
        request = state.request
        # fewer tokens computed than saved: a load failed and vLLM recomputes them (or a preemption): save again
        state.next_save = min(state.next_save, computed_before // self._block_size)
        if state.epoch != self._current_epoch():  # admitted before a reset: its KV may be the old weights' KV
            return
        upto = min(
            computed_after_step // self._block_size,
            request.num_prompt_tokens // self._block_size,
            len(request.block_hashes) // self._hash_stride,
            len(state.block_ids),
        )
        if upto > state.next_save:
            all_hashes = self._hashes(request)
            hashes = all_hashes[state.next_save : upto]
            meta.saves.append(BlockTransfer(request.request_id, state.block_ids[state.next_save : upto], hashes, state.epoch))
            self._saving.add(request.request_id)
            self._events.stored(
                hashes,
                all_hashes[state.next_save - 1] if state.next_save > 0 else None,
                list(request.all_token_ids[state.next_save * self._block_size : upto * self._block_size]),
                self._block_size,
            )
            state.next_save = upto

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = EmsConnectorMetadata()
        # (a request may be preempted and admitted again in one schedule, e.g. reset_running_requests: its new
        # saves are added below, after this, and the workers wait for the old ones before the forward)
        for rid in scheduler_output.preempted_req_ids or ():
            if rid in self._saving:
                meta.preempted.add(rid)
                self._saving.discard(rid)  # the workers forget it too once its copy-outs have ended
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            self._add_saves(meta, state, new.num_computed_tokens, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self._requests.get(rid)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids and new_ids is not None:
                state.block_ids = list(new_ids[0])
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            computed = cached.num_computed_tokens[i]
            self._add_saves(meta, state, computed, computed + scheduled.get(rid, 0))
        # asynchronous loads: their requests wait (not scheduled) until the workers report them in get_finished
        meta.loads.extend(self._loads.values())
        self._loads.clear()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        # this step's lookups, one batch, off this thread; a step with nothing to run waits a little for them
        self._batcher.dispatch()
        if meta.idle and self._batcher.pending():
            self._batcher.wait(IDLE_WAIT_S)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._requests.pop(rid, None)
        self._lookups.pop(rid, None)
        if self._asking.pop(rid, None) is not None:
            self._batcher.forget(rid)
        # a load not sent yet still goes to the workers: vLLM frees the blocks once they report it finished.
        # Saves copy their blocks out after the step, off it: vLLM keeps them until every worker reports the request
        # in finished_sending (each worker knows the same requests from the metadata: `_save_requests`).
        held = rid in self._saving
        self._saving.discard(rid)
        return held, None

    def reset_cache(self) -> bool:
        """`llm.reset_prefix_cache(reset_connector=True)`: a new namespace epoch in the pool, so every block saved
        before is a miss from now on for this engine and, within `epoch_refresh_s`, every other engine of the
        model. Requests admitted before the reset save nothing more. False when the pool did not take it."""
        if self._epoch_watch is None:
            return False
        if not self._epoch_watch.reset():
            logger.warning("EmsConnector reset_cache: the pool did not take the new epoch; nothing was reset")
            return False
        for load in self._loads.values():  # promised in the old epoch: recomputed, not loaded
            load.cancelled = True
        self._events.cleared()
        self._lookups.clear()
        logger.info("EmsConnector reset_cache: new namespace epoch; every earlier block now misses")
        return True

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        global _registered
        missing = [n for n in self._layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"register_kv_caches: no tensor for layers {missing[:4]}")
        planes = [kv_layouts.block_planes(kv_caches[n], self._num_blocks, name=n) for n in self._layer_names]
        shapes = [kv_layouts.shape_of(p) for p in planes]
        if shapes != self._shapes:
            raise ValueError(
                f"KV cache tensors ({shapes[0]}, ...) do not match vLLM's KV cache spec ({self._shapes[0]}, ...): "
                "the scheduler could not address this worker's blocks"
            )
        self._check_backend()
        with _registered_lock:
            self._cc.register_kvcache([list(p) for p in planes], kv_layouts.store_groups(shapes))
            _registered = "worker"
        tp_rank = 0
        if self._tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        if self._copier is not None:  # registered again: the earlier mover's copy-outs end first
            self._copier.close()
        self._mover = BlockMover(
            self._cc,
            sum(s.block_bytes for s in shapes),
            tp_rank=tp_rank,
            tp_size=self._tp_size,
            shared=self._mla,
            option=self._option,
            stats=self._stats,
            inflight_budget=self._config.max_inflight,
        )
        self._copier = SaveCopier(self._mover)
        self._ready_event = _step_end_event(planes[0][0].device)

    def _check_backend(self) -> None:
        """The namespace names the backend predicted from the KV cache spec (the scheduler holds no layers): the
        layers must really use it, or blocks would be shared between engines whose bytes differ."""
        context = self._vllm_config.compilation_config.static_forward_context
        used = {
            str(layer.attn_backend.get_name())
            for name in self._layer_names
            if (layer := context.get(name)) is not None and getattr(layer, "attn_backend", None) is not None
        }
        if used and used != {self._backend}:
            raise ValueError(
                f"EmsConnector: the attention layers use {sorted(used)}, but the KV cache spec predicts "
                f"{self._backend!r} (the key namespace names it): set attention_config.backend explicitly"
            )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads (asynchronous: each request waits in vLLM until `get_finished` names it)."""
        if self._mover is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, EmsConnectorMetadata):
            self._queued_loads.extend(meta.loads)
        self._start_queued_loads()

    def _start_queued_loads(self) -> None:
        if self._mover is None:
            return
        waiting: list[BlockTransfer] = []
        for load in self._queued_loads:
            if load.cancelled:  # promised before a reset: never loaded, reported failed (vLLM recomputes)
                self._load_errors.update(load.block_ids)
                self._done_loads.add(load.req_id)
                continue
            pending = self._mover.start_load(load.block_ids, load.hashes, load.epoch)
            if pending is None:  # in-flight budget used up (a slow pool): started on a later step
                waiting.append(load)
            else:
                self._inflight_loads[load.req_id] = pending
                if pending.future is not None:
                    pending.future.add_done_callback(lambda _: self._load_ended.set())
        self._queued_loads = waiting

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests whose saves have been copied out, requests whose load has finished): never blocks
        (but for a step with nothing scheduled: see IDLE_WAIT_S); failed blocks go to
        `get_block_ids_with_load_errors` in the same step."""
        held = finished_req_ids & self._save_requests  # vLLM keeps their blocks until we name them here
        self._save_requests -= finished_req_ids
        copier = self._copier
        if copier is None:  # never registered: nothing was copied, nothing to hold
            return held or None, None
        copier.release_when_copied(held)
        self._start_queued_loads()
        done, self._done_loads = self._done_loads, set()
        done |= self._poll_loads()
        sent = copier.take_released()
        if not done and not sent and self._idle_step():  # nothing else to run: sleep until something ends, not spin
            if self._inflight_loads:
                self._load_ended.wait(IDLE_WAIT_S)
                done |= self._poll_loads()
            else:
                copier.wait_released(IDLE_WAIT_S)
            sent = copier.take_released()
        return sent or None, done or None

    def _poll_loads(self) -> set[str]:
        self._load_ended.clear()
        done: set[str] = set()
        mover = self._mover
        if mover is None:  # loads start only once the mover exists
            return done
        for rid, pending in list(self._inflight_loads.items()):
            outcome = mover.poll_load(pending)
            if outcome is not None:
                del self._inflight_loads[rid]
                self._load_errors.update(outcome.failed_block_ids)
                done.add(rid)
        return done

    def _idle_step(self) -> bool:
        if not self.has_connector_metadata():
            return False
        meta = self._get_connector_metadata()
        return isinstance(meta, EmsConnectorMetadata) and meta.idle

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous and whole-block: a request computes only once its load has finished

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # whole blocks of every layer are saved at once in wait_for_save

    def wait_for_save(self) -> None:
        """Queue this step's saves and return: their copy-out runs on the copier's thread, off the step (vLLM keeps
        the blocks of a finished request until `get_finished` reports its copy-outs done, and a preempted one's
        wait in `handle_preemptions`). A save that finds the in-flight budget used up (a slow pool) is dropped."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, EmsConnectorMetadata) or not meta.saves:
            return
        self._save_requests.update(save.req_id for save in meta.saves)
        if self._copier is None:
            return
        ready = self._ready_event() if self._ready_event is not None else None
        for save in meta.saves:
            self._copier.submit(save.req_id, save.block_ids, save.hashes, save.epoch, ready)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before a step's forward: requests preempted by its schedule give their blocks back, and the forward may
        write them for other requests, so their copy-outs must have ended (a copy never waits for the network)."""
        if not isinstance(kv_connector_metadata, EmsConnectorMetadata) or not kv_connector_metadata.preempted:
            return
        preempted = kv_connector_metadata.preempted
        self._save_requests -= preempted  # the scheduler forgot their saves too (`_saving`)
        if self._copier is None:
            return
        while not self._copier.wait_copied(preempted, PREEMPTION_WARN_S):
            logger.warning("EmsConnector: preempted requests' copy-outs still running after %.0f s", PREEMPTION_WARN_S)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = self._stats.drain()
        return None if stats.is_empty() else EmsConnectorStats(data=stats.to_dict())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return EmsConnectorStats(data=dict(data)) if data is not None else EmsConnectorStats(data=TransferStats().to_dict())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV events for KV-aware routers: blocks sent to the pool (`BlockStored`, medium "EMS"), resets."""
        return self._events.take()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return EmsPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def wait_saves(self, timeout_s: float = 30.0) -> bool:
        """Wait until every save of this worker has been copied out and sent (True), or `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        while self._copier is not None and not self._copier.idle():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return self._mover is None or self._mover.wait(max(0.0, deadline - time.monotonic()))

    def totals(self) -> TransferStats:
        """Everything this connector counted since it started (this package's addition, for tests and tools)."""
        return self._stats.totals()

    def shutdown(self) -> None:
        if self._epoch_watch is not None:
            self._epoch_watch.close()
        self._batcher.close()
        self._breaker.close()
        if self._copier is not None and not self._copier.close(30.0):
            logger.warning("EmsConnector shutdown: copy-outs still running after 30 s")
        if self._mover is not None and not self._mover.wait(timeout=30.0):
            logger.warning("EmsConnector shutdown: %d saves still pending after 30 s", self._mover.pending())

"""The worker half of `EmsConnector`: moves the blocks the scheduler half named between vLLM's KV cache and the pool.

Contract (no vLLM imports; `connector.EmsConnector` forwards vLLM's worker-side calls here with the step's
`metadata.EmsConnectorMetadata`):
* `register_kv_caches(kv_caches, tp_rank, used_backends)` registers each layer's tensor as two planes whose rows
  are whole vLLM blocks (`kv_layouts`), after checking that they match vLLM's KV cache spec (the scheduler addresses
  the same keys from it) and that the layers really use the attention backend the namespace names.
* Loads: `start_load_kv(meta)` starts the step's loads (`BlockMover.start_load`, asynchronous): a load that names its
  chain position (`BlockTransfer.chain_prefix`: its keys are placed by placement units) is a call of its own (a call
  carries one chain position); the others (a hybrid model's) go as **one call** (every request's blocks one after the
  other; one call per epoch), so requests admitted together take one in-flight slot; a call beyond the in-flight
  budget starts on a later step; a load cancelled by a reset finishes at once, its blocks failed. A call comes back
  with the count of blocks loaded from the first (the API's `success`): the request it stopped in keeps its leading
  blocks (the rest recomputed); the requests after it were not read, and are asked for once more on the next step when
  the call loaded anything (else they are recomputed: a pool that served nothing is not asked again). Loads the step
  policy placed in the step (`BlockTransfer.in_step`: vLLM's synchronous path, the request is computed in this step)
  run in `start_load_kv` itself, before the forward, their calls started together and waited for under the policy's
  bound (`in_step_ms` as their timeout): blocks they did not load go to `get_block_ids_with_load_errors` in this step
  (vLLM recomputes them); they are never named in `get_finished`. One that ran out of its bound is counted
  (`load_late_bytes`, `load_late_seconds`) for the scheduler's policy, which then loads asynchronously. `get_finished`
  names each request whose load has finished (never blocks, but for a step with nothing scheduled: `IDLE_WAIT_S`);
  blocks that did not arrive go to `get_block_ids_with_load_errors` in that same step (vLLM recomputes them, or fails
  the request, by its policy: `engine_checks.apply_failure_policy`); a hybrid model's request with blocks that did not
  arrive goes to `take_failed_loads` instead (vLLM's failed receives: it recomputes the whole request, or fails it, by
  the same policy).
* Saves (`worker_saves.WorkerSaves`, `saves`): `wait_for_save(meta)` queues the step's saves for copy-out off the
  step (a producer that responds after its saves then waits for the pool's acknowledgements, within
  `producer_wait_ms`); a finished request with saves sent is named in `get_finished`'s finished_sending once its
  copy-outs have ended (vLLM keeps its blocks until then); `handle_preemptions(meta)` waits for the copy-outs of the
  requests the step preempted. A save that finds the in-flight budget used up (a slow pool) is dropped: a later miss.
* `steps`: the per-step record (`steps.WorkerStep`: loads started, queued and finished, copy-outs queued, a
  producer's wait for its saves, the seconds the connector's calls took on the step and waited).
* `wait_saves(timeout_s)` waits until every save has been copied out and sent; `shutdown()` lets them finish.
* Layer-wise (`transfer_granularity` "layer", `layer_transfers`): the worker registers a host mirror of
  `layer_buffer_mb` (the engine's plane shapes: the same keys and values) instead of the KV cache, and every
  transfer passes through it. An in-step load starts in `start_load_kv` into a run of the mirror; the layer copier
  then waits for it and copies it into the cache layer by layer, and `wait_for_layer_load(layer)` (before that
  layer's attention) waits only for that layer's copy. Blocks the load did not bring, and every block of a load
  whose layer copy failed, go to `get_block_ids_with_load_errors` in the same step, as in step mode (settled in
  `wait_for_save`, or `get_finished`). An asynchronous load goes into a run of the mirror and is copied into the
  cache, every layer, once it has finished; one that finds no free run waits a step (as for the in-flight budget).
  An in-step load that finds no free run is recomputed. Saves: `worker_saves`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter

import torch

from ems import CcKvOption, EmsException
from ems.integrations import kv_layouts
from ems.integrations.block_transfer import BlockMover, LoadOutcome, PendingLoad
from ems.integrations.connector_config import TransferGranularity
from ems.integrations.vllm.context import ConnectorContext
from ems.integrations.vllm.layer_transfers import CopyDone, HostMirror, LayerCopyQueue, LayerStage
from ems.integrations.vllm.lookups.breaker import SLOW_FRACTION
from ems.integrations.vllm.metadata import IDLE_WAIT_S, BlockTransfer, EmsConnectorMetadata
from ems.integrations.vllm.steps import StepLog, WorkerStep
from ems.integrations.vllm.worker_saves import WorkerSaves

logger = logging.getLogger("ems.integrations.vllm")


@dataclass
class _LoadCall:
    """One `async_load` of a step's loads: each distinct block hash once (into the block of the first request that
    names it), then copied in the KV cache into the other requests' blocks with that hash (requests admitted together
    that share a prefix each load it: one key may appear once in a call, and is read once)."""

    loads: list[BlockTransfer]
    block_ids: list[int]  # the call's blocks, one per distinct hash
    hashes: list[bytes]  # (BlockTransfer's: vLLM's block hashes)
    positions: list[tuple[int, ...]]  # per load: each of its blocks' index in the call
    pending: PendingLoad | None = None
    mirror_start: int | None = None  # layer-wise: `block_ids` are the mirror's rows from here, not the cache's
    chain_prefix: list[bytes] | None = None  # a call of one load whose keys are placed by their chain's units

    @classmethod
    def calls(cls, loads: list[BlockTransfer]) -> list[_LoadCall]:
        """A step's loads (of one epoch) as calls: a load whose keys are placed by their chain (`chain_prefix`) is a
        call of its own (one call carries one chain position); the others go together in one call."""
        calls = []
        for load in loads:
            if load.chain_prefix is not None:
                call = cls.plan([load])
                call.chain_prefix = load.chain_prefix
                calls.append(call)
        rest = [load for load in loads if load.chain_prefix is None]
        return calls + [cls.plan(rest)] if rest else calls

    @classmethod
    def plan(cls, loads: list[BlockTransfer]) -> _LoadCall:
        every = list(chain.from_iterable(load.hashes for load in loads))
        ids = list(chain.from_iterable(load.block_ids for load in loads))
        first = dict(zip(reversed(every), reversed(ids)))  # hash -> the block of its first request
        hashes = list(dict.fromkeys(every))  # distinct, in first-seen order
        index = {h: i for i, h in enumerate(hashes)}
        where = itemgetter(*every)(index) if len(every) > 1 else tuple(index[h] for h in every)
        positions, offset = [], 0
        for load in loads:
            positions.append(tuple(where[offset : offset + len(load.hashes)]))
            offset += len(load.hashes)
        block_ids = list(itemgetter(*hashes)(first)) if len(hashes) > 1 else [first[h] for h in hashes]
        return cls(loads, block_ids, hashes, positions)

    def copies(self, loaded: int) -> tuple[list[int], list[int]]:
        """(the call's blocks, each request's blocks) to copy when the call loaded its first `loaded` blocks and
        every request keeps its leading blocks that arrived (no retry: an in-step load)."""
        src: list[int] = []
        dst: list[int] = []
        for load, position in zip(self.loads, self.positions):
            got = self.loaded_blocks(position, loaded)
            src.extend(self.block_ids[p] for p in position[:got])
            dst.extend(load.block_ids[:got])
        return src, dst

    def loaded_blocks(self, position: tuple[int, ...], loaded: int) -> int:
        """How many leading blocks of a load with these positions the call's first `loaded` blocks gave it."""
        if loaded >= len(self.hashes):
            return len(position)
        return next((k for k, p in enumerate(position) if p >= loaded), len(position))


@dataclass
class _LayerLoad:
    """An in-step load copied into the cache layer by layer: the copier's tasks, one per layer, and what the first
    found (`loaded`: blocks from the call's first; its (mirror row, engine block) pairs)."""

    call: _LoadCall
    copies: list[CopyDone]
    loaded: int = 0
    src: torch.Tensor | None = None
    dst: torch.Tensor | None = None


class EmsWorker:
    """See the module contract."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self._ctx = ctx
        self._mover: BlockMover | None = None
        self.saves = WorkerSaves(ctx)
        self._load_errors: set[int] = set()
        self._queued_loads: list[BlockTransfer] = []  # not started yet (in-flight budget)
        self._inflight_loads: list[_LoadCall] = []  # one per call: a step's loads (of one epoch) together
        self._done_loads: set[str] = set()  # finished without a transfer (cancelled)
        # a hybrid model's requests whose load came up short: vLLM takes no block-level errors for several KV cache
        # groups (block ids are per group), so the request is reported failed (`take_failed_loads`) and recomputed
        self._failed_loads: set[str] = set()
        self._load_ended = threading.Event()
        self._planes: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # each layer's planes (rows: blocks)
        self._stage: LayerStage | None = None  # layer-wise: the mirror, the layer copier
        self._layer_loads: list[_LayerLoad] = []  # layer-wise: this step's in-step loads
        self._retried: set[str] = set()  # requests whose load is asked for a second time (after a short call)
        self.steps: StepLog[WorkerStep] = StepLog()  # the per-step record, closed at get_finished
        self._step = WorkerStep()
        # an in-step load holds the step: it waits at most the step policy's bound
        self._in_step_option = CcKvOption(
            write_rcache=ctx.option.write_rcache,
            read_local_only=ctx.option.read_local_only,
            timeout=max(1, ctx.config.in_step_ms),
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], tp_rank: int, used_backends: set[str]) -> None:
        ctx = self._ctx
        missing = [n for n in ctx.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"register_kv_caches: no tensor for layers {missing[:4]}")
        planes = [kv_layouts.block_planes(kv_caches[n], ctx.num_blocks, name=n) for n in ctx.layer_names]
        for name, layer_planes, others in zip(ctx.layer_names, planes, ctx.shared_layers):
            for other in others:  # a hybrid model: the other groups' layers on these pages must view the same bytes
                other_planes = kv_layouts.block_planes(kv_caches[other], ctx.num_blocks, name=other)
                if [(p.data_ptr(), p.stride(), p.shape) for p in other_planes] != [
                    (p.data_ptr(), p.stride(), p.shape) for p in layer_planes
                ]:
                    raise ValueError(
                        f"EmsConnector: layers {name} and {other} view the same pages in vLLM's config but their "
                        "caches do not hold a block in the same bytes: not supported"
                    )
        shapes = tuple(kv_layouts.shape_of(p) for p in planes)
        if shapes != ctx.shapes:
            raise ValueError(
                f"KV cache tensors ({shapes[0]}, ...) do not match vLLM's KV cache spec ({ctx.shapes[0]}, ...): "
                "the scheduler could not address this worker's blocks"
            )
        # the namespace names the backend predicted from the KV cache spec (the scheduler holds no layers): the layers
        # must really use it, or blocks would be shared between engines whose bytes differ
        if used_backends and used_backends != {ctx.backend}:
            raise ValueError(
                f"EmsConnector: the attention layers use {sorted(used_backends)}, but the KV cache spec predicts "
                f"{ctx.backend!r} (the key namespace names it): set attention_config.backend explicitly"
            )
        device = planes[0][0].device
        if ctx.config.transfer_granularity is TransferGranularity.LAYER:
            # the SDK moves values through a host mirror of the engine's planes: the same layout signature, keys and
            # values as registering the cache itself (a step-wise engine shares them)
            capacity = max(1, min(ctx.num_blocks, (ctx.config.layer_buffer_mb << 20) // ctx.block_bytes))
            if self._stage is not None:
                self._stage.close()
            self._stage = LayerStage(
                HostMirror.build(list(shapes), capacity, device),
                LayerCopyQueue(device),
                planes,
                {name: i for i, name in enumerate(ctx.layer_names)},
            )
            ctx.register_worker(self._stage.mirror.planes)
            logger.info("EmsConnector: layer-wise transfers through a host mirror of %d blocks", capacity)
        else:
            ctx.register_worker(planes)
        self._planes = planes
        layout = ctx.cc.layout
        cross = layout is not None and all(g.cross_layer for g in layout.groups)
        asked = ctx.config.cross_layer_blocks
        (logger.warning if asked and not cross else logger.info)(
            "EmsConnector: registered KV cache: %s",
            "cross-layer blocks (a block's save or load is one copy)"
            if cross
            else "a copy per block and layer" + (" (cross_layer_blocks was asked for)" if asked else ""),
        )
        self._mover = BlockMover(
            ctx.cc,
            ctx.block_bytes,
            tp_rank=tp_rank,
            tp_size=ctx.tp_size,
            shared=ctx.mla,
            option=ctx.option,
            stats=ctx.stats,
            inflight_budget=ctx.config.max_inflight,
        )
        self.saves.attach(self._mover, device, self._stage)

    # ---- loads ----

    def start_load_kv(self, meta: EmsConnectorMetadata | None) -> None:
        """Start this step's loads (asynchronous: each request waits in vLLM until `get_finished` names it)."""
        if self._mover is None or meta is None:
            return
        started = time.perf_counter()
        in_step = [load for load in meta.loads if load.in_step]
        self._queued_loads.extend(load for load in meta.loads if not load.in_step)
        if in_step and self._stage is not None:
            self._load_in_layers(in_step, self._stage)
            self._step.in_step_load_s += time.perf_counter() - started
        elif in_step:
            self._load_in_step(in_step)
            self._step.in_step_load_s += time.perf_counter() - started
        self._start_queued_loads()
        self._step.call_s += time.perf_counter() - started

    def _load_in_step(self, loads: list[BlockTransfer]) -> None:
        """The step's in-step loads, one call per epoch, waited for under the policy's bound; what did not arrive is
        reported failed in this step."""
        if self._mover is None:
            return
        by_epoch: dict[bytes, list[BlockTransfer]] = {}
        for load in loads:
            if load.cancelled:  # promised before a reset: never loaded (vLLM recomputes)
                self._load_errors.update(load.block_ids)
            else:
                by_epoch.setdefault(load.epoch, []).append(load)
        calls = [(epoch, call) for epoch, group in by_epoch.items() for call in _LoadCall.calls(group)]
        started = time.perf_counter()
        if len(calls) > 1:  # loads placed by their chains, a call each: all started at once, then waited for
            for epoch, call in calls:
                call.pending = self._mover.start_load(call.block_ids, call.hashes, epoch, self._in_step_option, call.chain_prefix)
        for epoch, call in calls:
            pending = call.pending
            if pending is None:  # one call, or no in-flight slot left for this one: loaded here
                outcome = self._mover.load(call.block_ids, call.hashes, epoch, self._in_step_option, call.chain_prefix)
            else:
                if pending.future is not None:
                    try:
                        pending.future.result()
                    except EmsException:  # logged by poll_load: nothing arrived
                        pass
                polled = self._mover.poll_load(pending)
                outcome = polled if polled is not None else LoadOutcome(0, list(call.block_ids))
                call.pending = None
            took = time.perf_counter() - started
            if outcome.loaded < len(call.block_ids) and took >= SLOW_FRACTION * self._in_step_option.timeout / 1000:
                # ran out of its bound (a busy host, a slow pool): the scheduler's policy learns the rate it showed
                self._ctx.stats.add(load_late_bytes=len(call.block_ids) * self._ctx.block_bytes, load_late_seconds=took)
            self._step.in_step_loads += len(call.loads)
            self._step.in_step_load_blocks += len(call.block_ids)
            self._settle(call, outcome.loaded, retry=False)

    def _load_in_layers(self, loads: list[BlockTransfer], stage: LayerStage) -> None:
        """Layer-wise: the step's in-step loads, one call per epoch into a run of the mirror; the layer copier waits
        for each and copies it into the cache layer by layer (`wait_for_layer_load`); settled in
        `_settle_layer_loads`."""
        mover = self._mover
        if mover is None:
            return
        by_epoch: dict[bytes, list[BlockTransfer]] = {}
        for load in loads:
            if load.cancelled:
                self._load_errors.update(load.block_ids)
            else:
                by_epoch.setdefault(load.epoch, []).append(load)
        for epoch, loads_of_epoch in by_epoch.items():
            for call in _LoadCall.calls(loads_of_epoch):
                self._load_call_in_layers(call, epoch, stage)

    def _load_call_in_layers(self, call: _LoadCall, epoch: bytes, stage: LayerStage) -> None:
        group = call.loads
        self._step.in_step_loads += len(group)
        self._step.in_step_load_blocks += len(call.block_ids)
        pending = self._start_mirrored(call, epoch, stage, self._in_step_option)
        if pending is None:  # no free run of the mirror, or no in-flight slot: recomputed
            logger.warning(
                "EmsConnector (transfer_granularity layer): no room for an in-step load of %d blocks "
                "(layer_buffer_mb, max_inflight): recomputed",
                len(call.block_ids),
            )
            self._settle(call, 0, retry=False)
            return
        state = _LayerLoad(call, [])
        state.copies = [stage.copier.submit(self._layer_in(state, layer, stage)) for layer in range(len(stage.planes))]
        self._step.layer_copies += len(state.copies)
        self._layer_loads.append(state)

    def _start_mirrored(
        self, call: _LoadCall, epoch: bytes, stage: LayerStage, option: CcKvOption | None = None
    ) -> PendingLoad | None:
        """Layer-wise: start `call` into a run of the mirror (its `block_ids` become the run's rows); None when no run
        or no in-flight slot is free (nothing started, the call unchanged)."""
        if self._mover is None:
            return None
        n = len(call.block_ids)
        start = stage.mirror.take(n)
        if start is None:
            return None
        rows = list(range(start, start + n))
        pending = self._mover.start_load(rows, call.hashes, epoch, option, call.chain_prefix)
        if pending is None:
            stage.mirror.give(start, n)
            return None
        call.block_ids, call.mirror_start, call.pending = rows, start, pending
        return pending

    def _layer_in(self, state: _LayerLoad, layer: int, stage: LayerStage) -> Callable[[], None]:
        """The copier's task for one layer of an in-step load (the first also waits for the load itself)."""

        def run() -> None:
            if layer == 0:
                pending = state.call.pending
                future = pending.future if pending is not None else None
                loaded = 0
                if future is not None:
                    try:
                        loaded = min(future.result().success, len(state.call.block_ids))
                    except EmsException:  # logged where the outcome is taken (`poll_load`): nothing arrived
                        loaded = 0
                src, dst = state.call.copies(loaded)
                state.loaded = loaded
                state.src = torch.tensor(src, dtype=torch.long)
                state.dst = stage.ids(dst)
            if state.src is not None and state.dst is not None and state.src.numel():
                stage.copy_in(layer, state.src, state.dst)

        return run

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise: before layer `layer_name`'s attention, wait for that layer of the step's in-step loads."""
        if not self._layer_loads or self._stage is None:
            return
        layer = self._stage.index.get(layer_name)
        if layer is None:
            return
        started = time.perf_counter()
        for state in self._layer_loads:
            state.copies[layer].wait()
        self._step.layer_load_wait_s += time.perf_counter() - started

    def save_kv_layer(self, layer_name: str, meta: EmsConnectorMetadata | None) -> None:
        """Layer-wise: the forward has written layer `layer_name`: copy it out of the step's saved blocks."""
        if self._stage is None:
            return
        layer = self._stage.index.get(layer_name)
        if layer is not None:
            self.saves.save_layer(meta, layer, self._step)

    def _settle_layer_loads(self) -> None:
        """Layer-wise: the step's in-step loads, once every layer of them is in place: each request keeps its leading
        blocks that arrived; the rest (all of a load whose layer copy failed) go to the load errors."""
        states, self._layer_loads = self._layer_loads, []
        for state in states:
            for done in state.copies:
                done.synchronize()
            call = state.call
            loaded = state.loaded if all(done.ok for done in state.copies) else 0
            if call.pending is not None and self._mover is not None:
                self._mover.poll_load(call.pending)  # the load has ended: its in-flight slot and its statistics
            self._settle(call, loaded, retry=False, copy=False)
            if call.mirror_start is not None and self._stage is not None:
                self._stage.mirror.give(call.mirror_start, len(call.block_ids))

    def _start_queued_loads(self) -> None:
        if self._mover is None:
            return
        by_epoch: dict[bytes, list[BlockTransfer]] = {}
        for load in self._queued_loads:
            if load.cancelled:  # promised before a reset: never loaded, reported failed (vLLM recomputes)
                self._fail_blocks(load, load.block_ids)
                self._done_loads.add(load.req_id)
            else:
                by_epoch.setdefault(load.epoch, []).append(load)
        waiting: list[BlockTransfer] = []
        # every load of the step in one call (one per epoch: almost always one), but for loads placed by their chain:
        # one call each
        calls = [(epoch, call) for epoch, loads in by_epoch.items() for call in _LoadCall.calls(loads)]
        for epoch, call in calls:
            if self._stage is not None:  # layer-wise: into a run of the mirror
                pending = self._start_mirrored(call, epoch, self._stage)
            else:
                pending = self._mover.start_load(call.block_ids, call.hashes, epoch, chain_prefix=call.chain_prefix)
            if pending is None:  # in-flight budget (or the mirror) used up (a slow pool): started on a later step
                waiting.extend(call.loads)
                continue
            call.pending = pending
            self._step.loads_started += len(call.loads)
            self._step.load_calls += 1
            self._inflight_loads.append(call)
            if pending.future is not None:
                pending.future.add_done_callback(lambda _: self._load_ended.set())
        self._queued_loads = waiting
        self._step.loads_queued = len(waiting)

    def get_finished(
        self, finished_req_ids: set[str], meta: EmsConnectorMetadata | None
    ) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests whose saves have been copied out, requests whose load has finished): never blocks
        (but for a step with nothing scheduled: see IDLE_WAIT_S); failed blocks go to
        `get_block_ids_with_load_errors` in the same step."""
        started = time.perf_counter()
        try:
            return self._get_finished(finished_req_ids, meta)
        finally:
            step, self._step = self._step, WorkerStep()
            step.call_s += time.perf_counter() - started
            step.inflight = self._mover.inflight() if self._mover is not None else 0
            self.steps.append(step)

    def _get_finished(
        self, finished_req_ids: set[str], meta: EmsConnectorMetadata | None
    ) -> tuple[set[str] | None, set[str] | None]:
        if self._layer_loads:  # (vLLM deferred wait_for_save)
            self._settle_layer_loads()
        released = self.saves.hold_finished(finished_req_ids)
        if self._mover is None:  # never registered: nothing was copied, nothing to hold
            return released or None, None
        self._start_queued_loads()
        done, self._done_loads = self._done_loads, set()
        done |= self._poll_loads()
        sent = self.saves.take_released()
        if not done and not sent and meta is not None and meta.idle:  # nothing else to run: sleep, not spin
            waited = time.perf_counter()
            if self._inflight_loads:
                self._load_ended.wait(IDLE_WAIT_S)
                done |= self._poll_loads()
            else:
                self.saves.wait_released(IDLE_WAIT_S)
            sent = self.saves.take_released()
            self._step.wait_s += time.perf_counter() - waited
        return sent or None, done or None

    def _poll_loads(self) -> set[str]:
        self._load_ended.clear()
        done: set[str] = set()
        mover = self._mover
        if mover is None:  # loads start only once the mover exists
            return done
        for call in list(self._inflight_loads):
            if call.pending is None:
                continue
            outcome = mover.poll_load(call.pending)
            if outcome is None:
                continue
            self._inflight_loads.remove(call)
            self._step.load_s += time.perf_counter() - call.pending.started
            done |= self._settle(call, outcome.loaded, retry=True)
            if call.mirror_start is not None and self._stage is not None:
                self._stage.mirror.give(call.mirror_start, len(call.block_ids))
        return done

    def _settle(self, call: _LoadCall, loaded: int, retry: bool, copy: bool = True) -> set[str]:
        """A finished call's requests: each gets its leading blocks the call loaded (copied into its own blocks where
        another request's block was read for it, or from the mirror: layer-wise; not with `copy` False, done
        already), the rest go to the load errors; returns the requests done."""
        # a load's `success` counts the call's blocks from the first: a request gets its leading blocks the call
        # loaded (the rest is recomputed) unless its first missing block was never read (the call stopped earlier,
        # at another request's block; its lease holds): then, with `retry` (an asynchronous load) and when the call
        # loaded anything (the pool is up), it is asked for once more on the next step instead of being recomputed
        done: set[str] = set()
        src: list[int] = []
        dst: list[int] = []
        for load, position in zip(call.loads, call.positions):
            got = call.loaded_blocks(position, loaded)
            if retry and got < len(position) and position[got] > loaded and loaded > 0 and load.req_id not in self._retried:
                self._retried.add(load.req_id)
                self._queued_loads.append(load)
                continue
            self._retried.discard(load.req_id)
            self._fail_blocks(load, load.block_ids[got:])
            done.add(load.req_id)
            src.extend(itemgetter(*position[:got])(call.block_ids) if got > 1 else [call.block_ids[p] for p in position[:got]])
            dst.extend(load.block_ids[:got])
        if retry:
            self._step.loads_done += len(done)
        if not copy:
            return done
        if call.mirror_start is not None:
            self._copy_from_mirror(src, dst)
        else:
            self._copy_blocks(src, dst)
        return done

    def _copy_from_mirror(self, src: list[int], dst: list[int]) -> None:
        """Layer-wise: mirror rows `src` into KV cache blocks `dst`, every layer (an asynchronous load that ended)."""
        stage = self._stage
        if not src or stage is None:
            return
        src_t, dst_t = torch.tensor(src, dtype=torch.long), stage.ids(dst)
        for layer in range(len(stage.planes)):
            stage.copy_in(layer, src_t, dst_t)
        if stage.device.type != "cpu":  # vLLM runs the request once it is reported: its blocks must be written
            torch.accelerator.synchronize(stage.device)

    def _copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy KV cache blocks `src` into `dst`, every layer (blocks the step's call loaded once for requests that
        share them)."""
        if not src or self._planes is None:
            return
        src_t, dst_t = torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)
        moved = src_t != dst_t
        if not bool(moved.any()):
            return
        device = self._planes[0][0].device
        src_t, dst_t = src_t[moved].to(device), dst_t[moved].to(device)
        for planes in self._planes:
            for plane in planes:
                plane.index_copy_(0, dst_t, plane.index_select(0, src_t))
        self._step.copied_blocks += int(moved.sum())

    def _fail_blocks(self, load: BlockTransfer, block_ids: list[int]) -> None:
        """Blocks of a load that did not arrive: vLLM recomputes them (one group), or the request (several)."""
        if not block_ids:
            return
        if self._ctx.hybrid:
            self._failed_loads.add(load.req_id)
        else:
            self._load_errors.update(block_ids)

    def take_failed_loads(self) -> set[str]:
        """A hybrid model's requests whose load came up short since the last call (named in the same step as in
        `get_finished`'s finished loads)."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- saves (`saves`: worker_saves.WorkerSaves) ----

    def wait_for_save(self, meta: EmsConnectorMetadata | None) -> None:
        if self._layer_loads:
            self._settle_layer_loads()
        self.saves.wait_for_save(meta, self._step)

    def handle_preemptions(self, meta: EmsConnectorMetadata) -> None:
        self.saves.handle_preemptions(meta, self._step)

    def wait_saves(self, timeout_s: float = 30.0) -> bool:
        return self.saves.wait_saves(timeout_s)

    def shutdown(self) -> None:
        self.saves.close()
        if self._stage is not None:
            self._stage.close()

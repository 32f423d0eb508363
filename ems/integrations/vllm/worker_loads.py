"""The worker half's loads: the step's loads started, waited for (in the step) or polled (asynchronous), and
settled into vLLM's KV cache.

Contract (no vLLM imports; `worker.EmsWorker` owns one, `loads`, and forwards vLLM's load-side calls to it; `step`
is the worker's record of the step under way, `steps.WorkerStep`):
* `attach(mover, planes, stage)`: the `BlockMover` the loads go through, the KV cache's planes (rows: blocks) and,
  layer-wise, the host mirror and layer copier, once the worker has registered its KV cache.
* `start_load_kv(meta)` starts the step's loads (`BlockMover.start_load`, asynchronous), as calls (`load_plan`:
  one call per chain position, the rest together, one call per epoch); a call beyond the in-flight budget starts
  on a later step (`start_queued_loads`); a load cancelled by a reset finishes at once, its blocks failed. A
  request a call stopped in keeps its leading blocks (the rest recomputed); the requests after it were not read,
  and are asked for once more on the next step when the call loaded anything (else they are recomputed: a pool that
  served nothing is not asked again). Loads the step policy placed in the step (`BlockTransfer.in_step`: vLLM's
  synchronous path, the request is computed in this step) run in `start_load_kv` itself, before the forward, their
  calls started together and waited for: planned within the policy's bound (`in_step_ms`), each may run to
  `IN_STEP_LOAD_GRACE` times it (its timeout) rather than have its blocks recomputed; blocks they did not load go to
  `get_block_ids_with_load_errors` in this step (vLLM recomputes them); they are never named as finished. One that
  ran out of its timeout is counted (`load_late_bytes`, `load_late_seconds`) for the scheduler's policy, which then
  loads asynchronously; the step's record counts every one that ran past the bound. The step's in-step phase (the
  blocks it loaded, the seconds from its start to its last call's end) is counted too (`load_in_step_bytes`,
  `load_in_step_seconds`): the policy's rate.
* `take_done()` names each request whose load has finished (never blocks; `wait_done(timeout_s)` waits for one
  in flight); blocks that did not arrive go to `get_block_ids_with_load_errors` in that same step (vLLM recomputes
  them, or fails the request, by its policy: `engine_checks.apply_failure_policy`); a hybrid model's request with
  blocks that did not arrive goes to `take_failed_loads` instead (vLLM's failed receives: it recomputes the whole
  request, or fails it, by the same policy).
* Layer-wise (`transfer_granularity` "layer", `layer_transfers`): an in-step load starts in `start_load_kv` into a
  run of the mirror; the layer copier then waits for it and copies it into the cache layer by layer, and
  `wait_for_layer_load(layer)` (before that layer's attention) waits only for that layer's copy. Blocks the load did
  not bring, and every block of a load whose layer copy failed, go to `get_block_ids_with_load_errors` in the same
  step, as in step mode (`settle_layer_loads`). An asynchronous load goes into a run of the mirror and is copied
  into the cache, every layer, once it has finished; one that finds no free run waits a step (as for the in-flight
  budget). An in-step load that finds no free run is recomputed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from operator import itemgetter

import torch

from ems import CcKvOption, EmsException
from ems.integrations.block_transfer import BlockMover, LoadOutcome, PendingLoad
from ems.integrations.connector_config import IN_STEP_LOAD_GRACE
from ems.integrations.vllm.context import ConnectorContext
from ems.integrations.vllm.layer_transfers import LayerStage
from ems.integrations.vllm.load_plan import LayerLoad, LoadCall, copy_blocks, copy_from_mirror
from ems.integrations.vllm.metadata import BlockTransfer, EmsConnectorMetadata
from ems.integrations.vllm.steps import WorkerStep

logger = logging.getLogger("ems.integrations.vllm")


class WorkerLoads:
    """See the module contract."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self._ctx = ctx
        self._mover: BlockMover | None = None
        self._planes: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # each layer's planes (rows: blocks)
        self._stage: LayerStage | None = None  # layer-wise: the mirror, the layer copier
        self.step = WorkerStep()  # the step under way (the worker's record: `EmsWorker.get_finished` rotates it)
        self._load_errors: set[int] = set()
        self._queued_loads: list[BlockTransfer] = []  # not started yet (in-flight budget)
        self._inflight_loads: list[LoadCall] = []  # one per call: a step's loads (of one epoch) together
        self._done_loads: set[str] = set()  # finished without a transfer (cancelled)
        # a hybrid model's requests whose load came up short: vLLM takes no block-level errors for several KV cache
        # groups (block ids are per group), so the request is reported failed (`take_failed_loads`) and recomputed
        self._failed_loads: set[str] = set()
        self._load_ended = threading.Event()
        self._layer_loads: list[LayerLoad] = []  # layer-wise: this step's in-step loads
        self._retried: set[str] = set()  # requests whose load is asked for a second time (after a short call)
        # an in-step load holds the step: planned within the step policy's bound, it may run to IN_STEP_LOAD_GRACE
        # times it (a late load's blocks are recomputed, which costs far more than the wait)
        self._in_step_bound_s = ctx.config.in_step_ms / 1000
        self._in_step_option = CcKvOption(
            write_rcache=ctx.option.write_rcache,
            read_local_only=ctx.option.read_local_only,
            timeout=max(1, IN_STEP_LOAD_GRACE * ctx.config.in_step_ms),
        )

    def attach(self, mover: BlockMover, planes: list[tuple[torch.Tensor, torch.Tensor]], stage: LayerStage | None) -> None:
        """The mover, the KV cache's planes and (layer-wise) the stage, once the worker has registered its KV cache."""
        self._mover, self._planes, self._stage = mover, planes, stage

    def take_done(self) -> set[str]:
        """The requests whose load has finished since the last call (never blocks)."""
        done, self._done_loads = self._done_loads, set()
        return done | self._poll_loads()

    def has_inflight(self) -> bool:
        """Some call is in flight."""
        return bool(self._inflight_loads)

    def wait_done(self, timeout_s: float) -> set[str]:
        """Wait up to `timeout_s` for a call in flight to end; the requests whose load has finished."""
        self._load_ended.wait(timeout_s)
        return self._poll_loads()

    def start_load_kv(self, meta: EmsConnectorMetadata | None) -> None:
        """Start this step's loads (asynchronous: each request waits in vLLM until `get_finished` names it)."""
        if self._mover is None or meta is None:
            return
        started = time.perf_counter()
        in_step = [load for load in meta.loads if load.in_step]
        self._queued_loads.extend(load for load in meta.loads if not load.in_step)
        if in_step and self._stage is not None:
            self._load_in_layers(in_step, self._stage)
            self.step.in_step_load_s += time.perf_counter() - started
        elif in_step:
            self._load_in_step(in_step)
            self.step.in_step_load_s += time.perf_counter() - started
        self.start_queued_loads()
        self.step.call_s += time.perf_counter() - started

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
        calls = [(epoch, call) for epoch, group in by_epoch.items() for call in LoadCall.calls(group)]
        started = time.perf_counter()
        loaded = 0
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
            if took > self._in_step_bound_s:  # ran past the bound it was planned within: a busy host, a slow pool
                self.step.in_step_loads_late += len(call.loads)
                self.step.in_step_late_blocks += len(call.block_ids) - outcome.loaded
                if outcome.loaded < len(call.block_ids):
                    # and past its grace: its blocks are recomputed, and the scheduler's policy learns the rate it
                    # showed at once (one that arrived is measured as every load job is)
                    self._ctx.stats.add(load_late_bytes=len(call.block_ids) * self._ctx.block_bytes, load_late_seconds=took)
            self.step.in_step_loads += len(call.loads)
            self.step.in_step_load_blocks += len(call.block_ids)
            loaded += outcome.loaded
            self._settle(call, outcome.loaded, retry=False)
        if loaded:  # the phase's bytes over its seconds: what the step policy predicts an in-step load by
            self._ctx.stats.add(
                load_in_step_bytes=loaded * self._ctx.block_bytes, load_in_step_seconds=time.perf_counter() - started
            )

    def _load_in_layers(self, loads: list[BlockTransfer], stage: LayerStage) -> None:
        """Layer-wise: the step's in-step loads, one call per epoch into a run of the mirror; the layer copier waits
        for each and copies it into the cache layer by layer (`wait_for_layer_load`); settled in
        `settle_layer_loads`."""
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
            for call in LoadCall.calls(loads_of_epoch):
                self._load_call_in_layers(call, epoch, stage)

    def _load_call_in_layers(self, call: LoadCall, epoch: bytes, stage: LayerStage) -> None:
        group = call.loads
        self.step.in_step_loads += len(group)
        self.step.in_step_load_blocks += len(call.block_ids)
        pending = self._start_mirrored(call, epoch, stage, self._in_step_option)
        if pending is None:  # no free run of the mirror, or no in-flight slot: recomputed
            logger.warning(
                "EmsConnector (transfer_granularity layer): no room for an in-step load of %d blocks "
                "(layer_buffer_mb, max_inflight): recomputed",
                len(call.block_ids),
            )
            self._settle(call, 0, retry=False)
            return
        state = LayerLoad(call, [])
        state.copies = [stage.copier.submit(self._layer_in(state, layer, stage)) for layer in range(len(stage.planes))]
        self.step.layer_copies += len(state.copies)
        self._layer_loads.append(state)

    def _start_mirrored(
        self, call: LoadCall, epoch: bytes, stage: LayerStage, option: CcKvOption | None = None
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

    def _layer_in(self, state: LayerLoad, layer: int, stage: LayerStage) -> Callable[[], None]:
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
        self.step.layer_load_wait_s += time.perf_counter() - started

    def settle_layer_loads(self) -> None:
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

    def start_queued_loads(self) -> None:
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
        calls = [(epoch, call) for epoch, loads in by_epoch.items() for call in LoadCall.calls(loads)]
        for epoch, call in calls:
            if self._stage is not None:  # layer-wise: into a run of the mirror
                pending = self._start_mirrored(call, epoch, self._stage)
            else:
                pending = self._mover.start_load(call.block_ids, call.hashes, epoch, chain_prefix=call.chain_prefix)
            if pending is None:  # in-flight budget (or the mirror) used up (a slow pool): started on a later step
                waiting.extend(call.loads)
                continue
            call.pending = pending
            self.step.loads_started += len(call.loads)
            self.step.load_calls += 1
            self._inflight_loads.append(call)
            if pending.future is not None:
                pending.future.add_done_callback(lambda _: self._load_ended.set())
        self._queued_loads = waiting
        self.step.loads_queued = len(waiting)

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
            self.step.load_s += time.perf_counter() - call.pending.started
            done |= self._settle(call, outcome.loaded, retry=True)
            if call.mirror_start is not None and self._stage is not None:
                self._stage.mirror.give(call.mirror_start, len(call.block_ids))
        return done

    def _settle(self, call: LoadCall, loaded: int, retry: bool, copy: bool = True) -> set[str]:
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
            self.step.loads_done += len(done)
        if not copy:
            return done
        if call.mirror_start is not None:
            if self._stage is not None:
                copy_from_mirror(self._stage, src, dst)
        elif self._planes is not None:
            self.step.copied_blocks += copy_blocks(self._planes, src, dst)
        return done

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

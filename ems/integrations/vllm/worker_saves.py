"""The worker half's saves: the copy-outs of the blocks a step computed, the hold on their blocks, and a producer's
wait for the pool.

Contract (no vLLM imports; `worker.EmsWorker` owns one and forwards vLLM's save-side calls to it, with the step's
record `steps.WorkerStep`):
* `attach(mover, device)`: the `BlockMover` the saves go through, once the worker has registered its KV cache (again:
  the earlier copier's copy-outs end first). Until then a save is only remembered (its request's hold).
* `wait_for_save(meta, step)` queues the step's saves on the copier's thread (`off_step_saves.OffStepSaves`): the
  copy-out runs off the step. A producer (`kv_role` `kv_producer`) with `producer_response` "after_save" then
  waits until the pool has acknowledged the saves this step sent (each ended: stored, failed, or dropped by the
  in-flight budget), at most `producer_wait_ms`: vLLM calls `wait_for_save` after the forward and before the step's
  outputs go back, so a finished request's response leaves with its blocks in the pool, and the consumer's first
  lookup finds them. A wait that runs out of its bound (a slow or hung pool) lets the step go on (the consumer's
  wait covers the rest), and the later steps do not wait at all until those saves have ended (a hung pool: they
  fail at `timeout_ms`), so a hung pool costs a producer one bound per `timeout_ms`, never each step. Every other
  engine (`kv_both`, or "immediate") returns at once. `step.save_wait_s` counts the wait, `step.save_waits_late`
  the waits that ran out of their bound.
* The hold: a finished request with saves sent (`hold_finished`) is released by `take_released` once its
  copy-outs have ended (vLLM's finished_sending; vLLM keeps its blocks until then); `wait_released` waits a little
  for one (a step with nothing else to run). `handle_preemptions(meta, step)` waits, before the forward, for the
  copy-outs of the requests the step preempted (their blocks may be written by this step's forward), and of a
  hybrid model's sliding-window saves of the previous step (`meta.flush`).
* `wait_saves(timeout_s)` waits until every save has been copied out and sent; `close()` lets them finish.
* Layer-wise (`transfer_granularity` "layer", `attach(..., stage)`): `save_layer(meta, layer, step)` (vLLM's
  `save_kv_layer`, as the forward has written the layer) copies that layer of the step's saved blocks into a run of
  the host mirror, on the layer copier's thread (`layer_transfers`); `wait_for_save` copies the layers no
  `save_kv_layer` named, then queues each save from its mirror rows (its copy-out waits for the layer copies; a
  failed layer copy drops the save: a later miss, never a wrong block) and frees the run once every save of it has
  been copied out. A step whose saves do not fit the mirror saves nothing (counted failed: later misses).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ems.integrations.block_transfer import BlockMover
from ems.integrations.connector_config import KvRole, ProducerResponse
from ems.integrations.off_step_saves import OffStepSaves
from ems.integrations.vllm.context import ConnectorContext
from ems.integrations.vllm.layer_transfers import CopyDone, LayerStage
from ems.integrations.vllm.metadata import EmsConnectorMetadata
from ems.integrations.vllm.steps import WorkerStep

logger = logging.getLogger("ems.integrations.vllm")

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


@dataclass
class _LayerRun:
    """A step's saves in the host mirror: rows `start ..` (`start` None: they did not fit, nothing is saved)."""

    meta: EmsConnectorMetadata  # the step's
    start: int | None
    n: int
    ids: torch.Tensor | None
    copies: list[CopyDone] = field(default_factory=list)
    layers: set[int] = field(default_factory=set)
    users: int = 0  # saves of the run not copied out yet
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ready(self) -> None:
        """The copy-out's wait: every layer copy in place, or raise (the save is dropped)."""
        for done in self.copies:
            done.synchronize()
        if not all(done.ok for done in self.copies):
            raise RuntimeError("a layer copy of this save failed")


class WorkerSaves:
    """See the module contract."""

    def __init__(self, ctx: ConnectorContext) -> None:
        config = ctx.config
        self._after_save = ctx.role is KvRole.PRODUCER and config.producer_response is ProducerResponse.AFTER_SAVE
        self._wait_s = config.producer_wait_ms / 1000
        self._mover: BlockMover | None = None
        self._copier: OffStepSaves | None = None
        self._ready_event: Callable[[], Callable[[], None]] | None = None
        self._requests: set[str] = set()  # requests this worker was sent saves for (the scheduler's _saving)
        self._late: list[int] = []  # the saves a producer's step stopped waiting for at its bound, until they end
        self._stage: LayerStage | None = None  # layer-wise: the mirror and the layer copier
        self._run: _LayerRun | None = None  # layer-wise: this step's saves in the mirror

    def attach(self, mover: BlockMover, device: torch.device, stage: LayerStage | None = None) -> None:
        if self._copier is not None:  # registered again: the earlier mover's copy-outs end first
            self._copier.close()
        self._mover = mover
        self._copier = OffStepSaves(mover)
        self._ready_event = _step_end_event(device)
        self._stage = stage
        self._run = None

    def _layer_run(self, meta: EmsConnectorMetadata) -> _LayerRun | None:
        """This step's run in the mirror, taken at its first layer."""
        stage = self._stage
        if stage is None or not meta.saves or self._copier is None:
            return None
        stale = self._run
        if stale is not None and stale.meta is not meta:  # an earlier step's, never sent (no wait_for_save came)
            self._run = None
            for done in stale.copies:
                done.synchronize()
            if stale.start is not None:
                stage.mirror.give(stale.start, stale.n)
        if self._run is None:
            ids = [b for save in meta.saves for b in save.block_ids]
            start = stage.mirror.take(len(ids)) if ids else None
            if start is None and ids:
                logger.warning(
                    "EmsConnector (transfer_granularity layer): a step's %d blocks to save do not fit the free "
                    "layer buffer (layer_buffer_mb): not saved (later misses)",
                    len(ids),
                )
            self._run = _LayerRun(meta, start, len(ids), stage.ids(ids) if start is not None else None)
        return self._run

    def save_layer(self, meta: EmsConnectorMetadata | None, layer: int, step: WorkerStep) -> None:
        """vLLM's `save_kv_layer`: copy layer `layer` of the step's saves into the mirror, off the forward thread."""
        stage = self._stage
        if stage is None or meta is None:
            return
        run = self._layer_run(meta)
        if run is None or run.start is None or run.ids is None or layer in run.layers:
            return
        run.layers.add(layer)
        run.copies.append(stage.copier.submit(stage.copy_out(layer, run.ids, run.start), stage.copier.after_forward()))
        step.layer_copies += 1

    def wait_for_save(self, meta: EmsConnectorMetadata | None, step: WorkerStep) -> None:
        """Queue this step's saves (their copy-out runs on the copier's thread, off the step); a producer that
        responds after its saves then waits for the pool's acknowledgements, within `producer_wait_ms`."""
        if meta is None or not meta.saves:
            return
        self._requests.update(save.req_id for save in meta.saves)
        copier = self._copier
        if copier is None:
            return
        started = time.perf_counter()
        if self._stage is not None:
            tickets = self._submit_layer_saves(meta, copier, step)
        else:
            ready = self._ready_event() if self._ready_event is not None else None
            tickets = []
            for save in meta.saves:
                tickets.append(
                    copier.submit(save.req_id, save.block_ids, save.hashes, save.epoch, ready, chain_prefix=save.chain_prefix)
                )
                step.save_blocks += len(save.block_ids)
        if self._after_save:
            self._wait_settled(copier, tickets, step)
        step.call_s += time.perf_counter() - started

    def _submit_layer_saves(self, meta: EmsConnectorMetadata, copier: OffStepSaves, step: WorkerStep) -> list[int]:
        """Layer-wise: the layers not copied yet, then each save from its mirror rows."""
        stage = self._stage
        run, self._run = self._layer_run(meta), None
        if stage is None or run is None:
            return []
        start = run.start
        if start is None or run.ids is None:  # did not fit: nothing saved
            if self._mover is not None:
                self._mover.stats.add(save_failed_blocks=run.n)
            return []
        after = stage.copier.after_forward()
        for layer in range(len(stage.planes)):
            if layer not in run.layers:
                run.copies.append(stage.copier.submit(stage.copy_out(layer, run.ids, start), after))
                step.layer_copies += 1
                step.late_layer_copies += 1
        mirror = stage.mirror
        run.users = len(meta.saves)

        def copied() -> None:
            with run.lock:
                run.users -= 1
                last = run.users == 0
            if last:
                mirror.give(start, run.n)

        tickets, offset = [], start
        for save in meta.saves:
            n = len(save.block_ids)
            rows = list(range(offset, offset + n))
            offset += n
            tickets.append(copier.submit(save.req_id, rows, save.hashes, save.epoch, run.ready, copied, save.chain_prefix))
            step.save_blocks += n
        return tickets

    def _wait_settled(self, copier: OffStepSaves, tickets: list[int], step: WorkerStep) -> None:
        if self._late and not copier.settled(self._late):  # the pool has not answered the saves of a late wait yet
            return
        self._late = []
        started = time.perf_counter()
        if not copier.wait_settled(tickets, self._wait_s):
            self._late = tickets
            step.save_waits_late += 1
            logger.warning(
                "EmsConnector (kv_producer): the pool did not acknowledge a step's saves within producer_wait_ms "
                "(%d ms): the step goes on, the consumer's lookup waits for the rest",
                round(self._wait_s * 1000),
            )
        waited = time.perf_counter() - started
        step.save_wait_s += waited
        step.wait_s += waited

    def hold_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests: those with saves sent are held until their copy-outs end (`take_released`); returns
        those to release at once (never registered: nothing was copied)."""
        held = finished_req_ids & self._requests  # vLLM keeps their blocks until they are named in finished_sending
        self._requests -= finished_req_ids
        if self._copier is None:
            return held
        self._copier.release_when_copied(held)
        return set()

    def take_released(self) -> set[str]:
        return self._copier.take_released() if self._copier is not None else set()

    def wait_released(self, timeout_s: float) -> None:
        if self._copier is not None:
            self._copier.wait_released(timeout_s)

    def handle_preemptions(self, meta: EmsConnectorMetadata, step: WorkerStep) -> None:
        """Before a step's forward: requests preempted by its schedule give their blocks back, and the forward may
        write them for other requests, so their copy-outs must have ended (a copy never waits for the network)."""
        preempted = meta.preempted
        if not preempted and not meta.flush:
            return
        self._requests -= preempted  # the scheduler forgot their saves too
        if self._copier is None:
            return
        started = time.perf_counter()
        # (and a hybrid model's sliding-window saves of the previous step: the window may have freed their blocks)
        while not self._copier.wait_copied(preempted | meta.flush, PREEMPTION_WARN_S):
            logger.warning("EmsConnector: preempted requests' copy-outs still running after %.0f s", PREEMPTION_WARN_S)
        waited = time.perf_counter() - started
        step.wait_s += waited
        step.call_s += waited

    def copying(self, req_id: str) -> bool:
        """Whether a copy-out of the request's blocks is queued or running."""
        return self._copier is not None and self._copier.copying(req_id)

    def wait_saves(self, timeout_s: float = 30.0) -> bool:
        """Wait until every save has been copied out and sent (True), or `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        while self._copier is not None and not self._copier.idle():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return self._mover is None or self._mover.wait(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self._copier is not None and not self._copier.close(30.0):
            logger.warning("EmsConnector shutdown: copy-outs still running after 30 s")
        if self._mover is not None and not self._mover.wait(timeout=30.0):
            logger.warning("EmsConnector shutdown: %d saves still pending after 30 s", self._mover.pending())

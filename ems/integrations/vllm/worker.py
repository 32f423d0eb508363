"""The worker half of `EmsConnector`: moves the blocks the scheduler half named between vLLM's KV cache and the pool.

Contract (no vLLM imports; `connector.EmsConnector` forwards vLLM's worker-side calls here with the step's
`metadata.EmsConnectorMetadata`):
* `register_kv_caches(kv_caches, tp_rank, used_backends)` registers each layer's tensor as two planes whose rows
  are whole vLLM blocks (`kv_layouts`), after checking that they match vLLM's KV cache spec (the scheduler addresses
  the same keys from it) and that the layers really use the attention backend the namespace names.
* Loads (`worker_loads.WorkerLoads`, `loads`): `start_load_kv(meta)` starts the step's loads (asynchronous, as calls:
  `load_plan`), or runs the step policy's in-step loads before the forward; `get_finished` names each request whose
  load has finished (never blocks, but for a step with nothing scheduled: `IDLE_WAIT_S`); blocks that did not
  arrive go to `get_block_ids_with_load_errors` in that same step, a hybrid model's request to `take_failed_loads`.
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
  transfer passes through it (loads: `worker_loads`, `wait_for_layer_load`; saves: `worker_saves`, `save_kv_layer`).
"""

from __future__ import annotations

import logging
import time

import torch

from ems.integrations import kv_layouts
from ems.integrations.block_transfer import BlockMover
from ems.integrations.connector_config import TransferGranularity
from ems.integrations.vllm.context import ConnectorContext
from ems.integrations.vllm.layer_transfers import HostMirror, LayerCopyQueue, LayerStage
from ems.integrations.vllm.metadata import IDLE_WAIT_S, EmsConnectorMetadata
from ems.integrations.vllm.steps import StepLog, WorkerStep
from ems.integrations.vllm.worker_loads import WorkerLoads
from ems.integrations.vllm.worker_saves import WorkerSaves

logger = logging.getLogger("ems.integrations.vllm")


class EmsWorker:
    """See the module contract."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self._ctx = ctx
        self._mover: BlockMover | None = None
        self.saves = WorkerSaves(ctx)
        self.loads = WorkerLoads(ctx)
        self._stage: LayerStage | None = None  # layer-wise: the mirror, the layer copier
        self.steps: StepLog[WorkerStep] = StepLog()  # the per-step record, closed at get_finished

    @property
    def _step(self) -> WorkerStep:
        """The record of the step under way (the loads fill it too: `WorkerLoads.step`)."""
        return self.loads.step

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
        self.loads.attach(self._mover, planes, self._stage)

    # ---- loads (`loads`: worker_loads.WorkerLoads) ----

    def start_load_kv(self, meta: EmsConnectorMetadata | None) -> None:
        """Start this step's loads (asynchronous: each request waits in vLLM until `get_finished` names it)."""
        self.loads.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise: before layer `layer_name`'s attention, wait for that layer of the step's in-step loads."""
        self.loads.wait_for_layer_load(layer_name)

    def take_failed_loads(self) -> set[str]:
        """A hybrid model's requests whose load came up short since the last call (named in the same step as in
        `get_finished`'s finished loads)."""
        return self.loads.take_failed_loads()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.loads.get_block_ids_with_load_errors()

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
            step, self.loads.step = self.loads.step, WorkerStep()
            step.call_s += time.perf_counter() - started
            step.inflight = self._mover.inflight() if self._mover is not None else 0
            self.steps.append(step)

    def _get_finished(
        self, finished_req_ids: set[str], meta: EmsConnectorMetadata | None
    ) -> tuple[set[str] | None, set[str] | None]:
        self.loads.settle_layer_loads()  # (layer-wise, where vLLM deferred wait_for_save)
        released = self.saves.hold_finished(finished_req_ids)
        if self._mover is None:  # never registered: nothing was copied, nothing to hold
            return released or None, None
        self.loads.start_queued_loads()
        done = self.loads.take_done()
        sent = self.saves.take_released()
        if not done and not sent and meta is not None and meta.idle:  # nothing else to run: sleep, not spin
            waited = time.perf_counter()
            if self.loads.has_inflight():
                done |= self.loads.wait_done(IDLE_WAIT_S)
            else:
                self.saves.wait_released(IDLE_WAIT_S)
            sent = self.saves.take_released()
            self._step.wait_s += time.perf_counter() - waited
        return sent or None, done or None

    # ---- saves (`saves`: worker_saves.WorkerSaves) ----

    def save_kv_layer(self, layer_name: str, meta: EmsConnectorMetadata | None) -> None:
        """Layer-wise: the forward has written layer `layer_name`: copy it out of the step's saved blocks."""
        if self._stage is None:
            return
        layer = self._stage.index.get(layer_name)
        if layer is not None:
            self.saves.save_layer(meta, layer, self._step)

    def wait_for_save(self, meta: EmsConnectorMetadata | None) -> None:
        self.loads.settle_layer_loads()  # (layer-wise: the step's in-step loads)
        self.saves.wait_for_save(meta, self._step)

    def handle_preemptions(self, meta: EmsConnectorMetadata) -> None:
        self.saves.handle_preemptions(meta, self._step)

    def wait_saves(self, timeout_s: float = 30.0) -> bool:
        return self.saves.wait_saves(timeout_s)

    def shutdown(self) -> None:
        self.saves.close()
        if self._stage is not None:
            self._stage.close()

"""Save and load jobs: one call's data path as explicit stages, each recorded (`ems.records`).

A save runs gather → encode → send, a load receive → verify → scatter (plus `copy` between device and host staging
on accelerators). A call is one `Transfer` (its plan, device, copier, option and record: `transfer.py`) along its
client's `JobContext` (pool, staging, chunk size); the copies are its copier's (`ems.datapath.copier`: fused or
separate, chosen once per job by `copier_for`). `save_job` / `load_job` pick the job for the call's path (never the
caller), one module per path:

* `embedded.py` (`EmbeddedSave`, `EmbeddedLoad`): a pool that lends its values (`PoolBackend.in_place`: the embedded
  pool) with CPU tensors, one pass straight between the cache and the store's own buffers;
* `pipelined.py` (`PipelinedSave`, `PipelinedLoad`): remote pools, accelerators: through staging, chunk by chunk
  (cutting, in-flight bounds, fencing, merging);
* `staged.py` (`StagedLoad`): V0 loads from pool nodes (staging without room for the headers);
* `transfer.py`: the descriptors, the jobs' contract (`SaveJob`, `LoadJob`) and the job of no values.

Failure semantics are `ContextCaching`'s: a job never writes a block it did not verify, nor one after the first
miss, and gives back every buffer and lease on every path.
"""

from __future__ import annotations

from ems.backends.base import InPlaceValues, PoolBackend
from ems.datapath.jobs.embedded import EmbeddedLoad, EmbeddedSave
from ems.datapath.jobs.pipelined import FENCE_GRACE_S, PIPELINE_DEPTH, PipelinedLoad, PipelinedSave, plan_chunks
from ems.datapath.jobs.staged import StagedLoad
from ems.datapath.jobs.transfer import JobContext, Loaded, LoadJob, NothingToMove, SaveJob, Transfer
from ems.datapath.planning import BlockPlan

__all__ = [
    "FENCE_GRACE_S",
    "PIPELINE_DEPTH",
    "EmbeddedLoad",
    "EmbeddedSave",
    "JobContext",
    "LoadJob",
    "Loaded",
    "SaveJob",
    "Transfer",
    "load_job",
    "plan_chunks",
    "save_job",
]


def _in_place(pool: PoolBackend, transfer: Transfer) -> InPlaceValues | None:
    """The values a call's job works on directly (the one-pass path): the pool's own, where it lends them
    (`PoolBackend.in_place`: the embedded pool), for CPU tensors."""
    return pool.in_place if transfer.device.type == "cpu" else None


def save_job(transfer: Transfer, context: JobContext) -> SaveJob:
    """The save job for this call's path: embedded (CPU tensors, the embedded pool) or pipelined (or, for no values,
    nothing)."""
    if transfer.plan.total == 0:
        return NothingToMove(transfer.record)
    values = _in_place(context.pool, transfer)
    if values is not None:
        return EmbeddedSave(transfer, values)
    return PipelinedSave(transfer, context)


def load_job(transfer: Transfer, context: JobContext) -> LoadJob:
    """The load job for this call's path: embedded, pipelined (V1) or staged (V0 from pool nodes) (or, for no values,
    nothing)."""
    if transfer.plan.total == 0:
        return NothingToMove(transfer.record)
    values = _in_place(context.pool, transfer)
    if values is not None:
        return EmbeddedLoad(transfer, values)
    if isinstance(transfer.plan, BlockPlan):
        return PipelinedLoad(transfer, context)
    return StagedLoad(transfer, context)

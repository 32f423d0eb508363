"""Save and load jobs: one call's data path as explicit stages, each recorded (`ems.records`).

A save runs gather → encode → send, a load receive → verify → scatter (plus `copy` between device and host staging
on accelerators). A call is one `Transfer` (its plan, device, copier, option and record: `transfer.py`) along its
client's `JobContext` (pool, staging, chunk size); the copies are its copier's (`ems.datapath.copier`: fused or
separate, chosen once per device by `copier_for`). `job_path(pool, device)` picks, once per device, the path its
calls take (never the caller); the path's `save_job` / `load_job` build each call's job, one module per path:

* `embedded.py` (`EmbeddedSave`, `EmbeddedLoad`): a pool that lends its values (`PoolBackend.in_place`: the embedded
  pool) with CPU tensors, one pass straight between the cache and the store's own buffers;
* `pipelined.py` (`PipelinedSave`, `PipelinedLoad`): remote pools, accelerators: through staging, chunk by chunk
  (cutting, in-flight bounds, fencing, merging);
* `staged.py` (`StagedLoad`): V0 loads from pool nodes (staging without room for the headers);
* `transfer.py`: the descriptors, the jobs' contract (`SaveJob`, `LoadJob`, `JobPath`) and the job of no values.

Failure semantics are `ContextCaching`'s: a job never writes a block it did not verify, nor one after the first
miss, and gives back every buffer and lease on every path.
"""

from __future__ import annotations

import torch

from ems.backends.base import PoolBackend
from ems.datapath.jobs.embedded import EmbeddedLoad, EmbeddedPath, EmbeddedSave
from ems.datapath.jobs.pipelined import FENCE_GRACE_S, PIPELINE_DEPTH, PipelinedPath, plan_chunks
from ems.datapath.jobs.transfer import JobContext, JobPath, Loaded, LoadJob, SaveJob, Transfer

__all__ = [
    "FENCE_GRACE_S",
    "PIPELINE_DEPTH",
    "EmbeddedLoad",
    "EmbeddedSave",
    "JobContext",
    "JobPath",
    "LoadJob",
    "Loaded",
    "SaveJob",
    "Transfer",
    "job_path",
    "plan_chunks",
]


def job_path(pool: PoolBackend, device: torch.device) -> JobPath:
    """The path a client's calls on `device` take, chosen once per device: the one-pass jobs where the pool lends
    its values (`PoolBackend.in_place`: the embedded pool) and the tensors are CPU tensors; staging otherwise
    (pipelined, or staged for V0 loads)."""
    values = pool.in_place if device.type == "cpu" else None
    return EmbeddedPath(values) if values is not None else PipelinedPath()

"""The per-step record of `EmsConnector`: what each engine step asked of the pool and what the connector's calls
cost it, for tools and benchmarks (`EmsConnector.step_records()`, `perf/bench_vllm.py --round`).

Contract (no vLLM imports): each half keeps its last `STEP_LOG_LEN` steps in a `StepLog` (thread-safe; appending
is one deque append, so the record costs a step nothing measurable):
* the scheduler half one `SchedulerStep` per `build_connector_meta`: tokens and requests the step scheduled, the
  lookups it dispatched (requests, in one batch), requests still waiting for a lookup's answer (and of those, for
  another request's load of their prefix), the loads and
  saves it sent (requests, blocks), the lookup batches answered since the previous step and their seconds on the
  lookup thread, the seconds the step itself waited for lookups (only a step with nothing else to run waits), and
  the step policy's in-step lookups (with their seconds) and in-step loads (requests, blocks), and its estimates at
  the step's end (the load rate and one lookup's latency: why a hit went one way or the other);
* the worker half one `WorkerStep` per step, closed at `get_finished` (vLLM's last connector call of a step): the
  loads it started (requests, and the calls they took), left queued (the in-flight budget), and saw finish (with
  their seconds from start to end), the blocks it queued for copy-out, the seconds its calls took on the step
  (`call_s`: start_load_kv, wait_for_save, handle_preemptions, get_finished) and of those the seconds spent waiting
  (`wait_s`: an idle step's wait for a load, a preemption's wait for copy-outs, a producer's for its saves), its
  async calls in flight at the end of the step, the in-step loads it ran before the forward (requests, blocks,
  seconds; the requests whose load ran past the bound and the blocks vLLM recomputes for them), and a
  producer's wait for the pool to acknowledge the step's saves (seconds, and whether it ran out of its bound).
`records()` returns them as dicts, oldest first, each with `at_s` (time.monotonic() at the record's end).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

STEP_LOG_LEN = 4096


@dataclass
class SchedulerStep:
    at_s: float = 0.0
    scheduled_tokens: int = 0
    scheduled_reqs: int = 0
    lookups_sent: int = 0  # requests whose lookup this step dispatched (one batch)
    lookups_waiting: int = 0  # requests told "ask again next step" during this step
    load_waits: int = 0  # of which waiting for another request's load of their prefix (asynchronous or put off)
    loads_deferred: int = 0  # of which hits the step policy put off to the next step (room held there)
    lookup_batches: int = 0  # batches answered since the previous step
    lookup_s: float = 0.0  # their seconds on the lookup thread
    loads_sent: int = 0
    load_blocks: int = 0
    save_blocks: int = 0
    wait_s: float = 0.0  # the step's own wait for lookups (a step with nothing else to run)
    in_step_lookups: int = 0  # lookups asked inside the step (the step policy: a fast pool)
    in_step_lookup_s: float = 0.0  # their seconds on the step
    in_step_loads: int = 0  # requests whose load runs before this step's forward (vLLM's synchronous path)
    in_step_load_blocks: int = 0
    # the step policy's estimates at the step's end (0 until measured): what its next decisions rest on
    policy_load_Bps: float = 0.0
    policy_lookup_s: float = 0.0


@dataclass
class WorkerStep:
    at_s: float = 0.0
    loads_started: int = 0  # requests
    load_calls: int = 0  # async_load calls they took (a step's loads go in one)
    loads_queued: int = 0  # not started: the in-flight budget was used up
    loads_done: int = 0
    load_s: float = 0.0  # seconds, from start to end, of the load calls that finished in this step (summed)
    copied_blocks: int = 0  # blocks a call loaded once and copied into other requests' blocks (a shared prefix)
    save_blocks: int = 0  # queued for copy-out
    call_s: float = 0.0  # the connector's worker calls of this step
    wait_s: float = 0.0  # of which waiting (an idle step's wait for a load; a preemption's for copy-outs; a producer's
    # for its saves)
    inflight: int = 0  # async calls of this worker in flight at the end of the step
    in_step_loads: int = 0  # requests loaded before the forward (the step policy's in-step loads)
    in_step_load_blocks: int = 0  # blocks they asked for (each distinct block read once)
    in_step_load_s: float = 0.0  # the seconds those loads held the step (part of call_s)
    in_step_loads_late: int = 0  # of those requests, the ones whose load ran past the bound (`in_step_ms`)
    in_step_late_blocks: int = 0  # the blocks those did not bring: vLLM recomputes them
    save_wait_s: float = 0.0  # a producer's wait for the pool to acknowledge the step's saves (part of wait_s)
    save_waits_late: int = 0  # of those waits, the ones that ran out of `producer_wait_ms`
    layer_copies: int = 0  # layer-wise: copies of one layer between the KV cache and the mirror (saves and loads)
    late_layer_copies: int = 0  # of those, saved layers no `save_kv_layer` named (copied at `wait_for_save`)
    layer_load_wait_s: float = 0.0  # layer-wise: the forward's waits for a layer's load (`wait_for_layer_load`)


Record = TypeVar("Record", SchedulerStep, WorkerStep)


@dataclass
class StepLog(Generic[Record]):
    records_: collections.deque[Record] = field(default_factory=lambda: collections.deque(maxlen=STEP_LOG_LEN))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def append(self, record: Record) -> None:
        record.at_s = time.monotonic()
        with self.lock:
            self.records_.append(record)

    def records(self) -> list[dict[str, Any]]:
        with self.lock:
            return [asdict(r) for r in self.records_]

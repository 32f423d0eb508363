"""Save and load jobs: one request's data path as explicit stages over chunks of blocks, each stage recorded.

A `SaveJob` runs gather → encode → send, a `LoadJob` receive → verify → scatter (plus `copy` between device and
host staging on accelerators). Each job keeps a `JobRecord`: per stage the bytes it moved, the seconds it took and
how many times it ran (once per chunk). Pipelined stages overlap, so their seconds may add up to more than the
job's wall time (`JobRecord.seconds`); `stage_table` prints both. That record is the one account of where a
request's time went: the benchmarks print it, `ENABLE_CC_PROFILING=1` logs it (logger `ems.profile`), and a
`JobLedger` sums records for metrics (per operation: calls, blocks, bytes and seconds per stage).

Two ways through the stages (chosen by `ContextCaching`, not by the caller):
* **One pass** (the embedded pool on CPU): chunk = one value. Gather writes the value's payload straight into a
  buffer from the store's arena, encode checksums it while it is still in cache and writes its header in place,
  send hands the buffer to the store (`put_owned`: no copy). A load receives the stored buffers, and per value
  verifies (header and checksum) then scatters straight from the stored bytes, stopping at the first miss.
* **Pipelined** (remote pools, accelerators): the request's staging is one lease, cut into chunks of consecutive
  values (`plan_chunks`: about `EMS_CHUNK_BYTES`, default 32 MiB, and within the pool's request limits). A save
  gathers chunk k into its range of staging (one backend call per layer group; then device → host on
  accelerators) and starts its encode (checksum, headers in place) and put on the pool client's pipeline threads
  (`PoolClient.start`), then gathers chunk k+1 while k is encoded and on the wire; `begin` returns once every
  chunk is gathered, `finish` waits for the puts and merges their outcomes. A load runs each chunk's receive
  (`PoolClient.get_into`: values land in their places in staging) and its verification on the pipeline threads,
  and scatters chunk k's verified prefix while later chunks arrive, stopping at the first miss. V0 loads (whose
  staging has no room for the headers) receive one batch, verify, copy into staging and scatter.
  `EMS_CHUNK_BYTES=0` makes the request one chunk (the same code, nothing overlapped: for comparisons). A request
  of one chunk has nothing to overlap, so its put (in `finish`) and its receive run on the calling thread.
  In flight: a job keeps at most `PIPELINE_DEPTH` chunk requests on the wire (a save's chunk k is sent once chunk
  k - depth has returned; a load starts chunk k + depth once chunk k verified), and at most `PIPELINE_THREADS`
  chunk calls run at once per client (the rest queue, in order).
  Fencing: the lease is released only when every chunk call has returned (queued ones are cancelled), each
  bounded by the request's deadline; a chunk whose call failed or timed out may leave UCX touching its buffer a
  moment longer (the endpoint is aborted, not awaited), so then the lease is retired, never reused
  (`StagingPool.retire`).

Failure semantics are `ContextCaching`'s: a job never writes a block it did not verify, nor one after the first
miss, and gives back every buffer and lease on every path.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

profile_logger = logging.getLogger("ems.profile")


class Stage(str, enum.Enum):
    """The stages of a job, in the order they run."""

    PLAN = "plan"  # check arguments, keys, piece tables
    GATHER = "gather"  # engine cache → staging or the store's buffer
    COPY = "copy"  # device ↔ host staging (accelerators only)
    ENCODE = "encode"  # checksum and header per value
    SEND = "send"  # to the pool (the embedded store's index, or the wire)
    RECEIVE = "receive"  # from the pool
    VERIFY = "verify"  # header and checksum per value, up to the first miss
    SCATTER = "scatter"  # staging or the stored value → engine cache


class JobKind(str, enum.Enum):
    SAVE = "save"
    LOAD = "load"


@dataclass
class StageRecord:
    """What one stage did over a job (or, in a ledger, over many)."""

    nbytes: int = 0
    seconds: float = 0.0
    runs: int = 0

    def add(self, other: "StageRecord") -> None:
        self.nbytes += other.nbytes
        self.seconds += other.seconds
        self.runs += other.runs

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class JobRecord:
    """One job's account: blocks done of total, bytes moved, and per stage bytes, seconds and runs."""

    kind: JobKind
    path: str = ""  # "one-pass", "pipelined" or (V0 loads from pool nodes) "staged"
    blocks_ok: int = 0
    blocks_total: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    stages: Dict[Stage, StageRecord] = field(default_factory=dict)
    _started: float = field(default_factory=time.perf_counter, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def stage(self, stage: Stage, nbytes: int = 0) -> "StageTimer":
        """Time the body of a `with` as (one run of) `stage`, moving `nbytes`."""
        return StageTimer(self, stage, nbytes)

    def add(self, stage: Stage, nbytes: int, seconds: float) -> None:
        """One run of `stage` (thread-safe: a pipelined job's chunks run stages on several threads)."""
        with self._lock:
            record = self.stages.get(stage)
            if record is None:
                record = self.stages[stage] = StageRecord()
            record.seconds += seconds
            record.nbytes += nbytes
            record.runs += 1

    @property
    def stage_seconds(self) -> float:
        """The stages' seconds added up (more than `seconds` where they overlapped)."""
        return sum(r.seconds for r in self.stages.values())

    def finish(self, blocks_ok: int, blocks_total: int, nbytes: int) -> "JobRecord":
        self.blocks_ok, self.blocks_total, self.nbytes = blocks_ok, blocks_total, nbytes
        self.seconds = time.perf_counter() - self._started
        if profiling_enabled():
            profile_logger.info("%s", self.summary())
        return self

    def summary(self) -> str:
        stages = ", ".join(
            f"{s.value} {1e3 * r.seconds:.2f} ms/{r.nbytes} B" for s, r in sorted(self.stages.items(), key=_order)
        )
        return (f"{self.kind.value} {self.blocks_ok}/{self.blocks_total} blocks, {self.nbytes} bytes, "
                f"{1e3 * self.seconds:.2f} ms ({self.path}): {stages}")


class StageTimer:
    """`with record.stage(...)`: adds the body's time, bytes and one run to the record's stage, on every exit path.
    (A plain class: a generator-based context manager costs several µs, and a small call runs about ten stages.)"""

    __slots__ = ("_record", "_stage", "_nbytes", "_start")

    def __init__(self, record: JobRecord, stage: Stage, nbytes: int) -> None:
        self._record, self._stage, self._nbytes, self._start = record, stage, nbytes, 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._record.add(self._stage, self._nbytes, time.perf_counter() - self._start)


def _order(item: tuple[Stage, StageRecord]) -> int:
    return list(Stage).index(item[0])


def profiling_enabled() -> bool:
    """ENABLE_CC_PROFILING=1 in the environment (read at each job: tests and tools may flip it)."""
    return os.environ.get("ENABLE_CC_PROFILING") == "1"


@dataclass
class KindTotals:
    """A ledger's sums for one kind of job."""

    jobs: int = 0
    blocks_ok: int = 0
    blocks_total: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    stages: Dict[Stage, StageRecord] = field(default_factory=dict)


class JobLedger:
    """Thread-safe sums of job records per kind, and the last record of each kind (what metrics read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: Dict[JobKind, KindTotals] = {k: KindTotals() for k in JobKind}
        self._last: Dict[JobKind, Optional[JobRecord]] = {k: None for k in JobKind}

    def add(self, record: JobRecord) -> None:
        with self._lock:
            totals = self._totals[record.kind]
            totals.jobs += 1
            totals.blocks_ok += record.blocks_ok
            totals.blocks_total += record.blocks_total
            totals.nbytes += record.nbytes
            totals.seconds += record.seconds
            for stage, stage_record in record.stages.items():
                totals.stages.setdefault(stage, StageRecord()).add(stage_record)
            self._last[record.kind] = record

    def totals(self, kind: JobKind) -> KindTotals:
        """A copy of the sums for `kind`."""
        with self._lock:
            t = self._totals[kind]
            return KindTotals(t.jobs, t.blocks_ok, t.blocks_total, t.nbytes, t.seconds,
                              {s: StageRecord(r.nbytes, r.seconds, r.runs) for s, r in t.stages.items()})

    def last(self, kind: JobKind) -> Optional[JobRecord]:
        with self._lock:
            return self._last[kind]

    def reset(self) -> None:
        with self._lock:
            self._totals = {k: KindTotals() for k in JobKind}
            self._last = {k: None for k in JobKind}


def stage_table(records: List[JobRecord]) -> str:
    """A markdown table of the stages of `records` (one row per job and stage): bytes, ms, GB/s, share of the job."""
    lines = ["| job | path | stage | runs | MiB | ms | GB/s | share of job |", "|---|---|---|---|---|---|---|---|"]
    for record in records:
        for stage, r in sorted(record.stages.items(), key=_order):
            share = r.seconds / record.seconds if record.seconds > 0 else 0.0
            lines.append(f"| {record.kind.value} | {record.path} | {stage.value} | {r.runs} | {r.nbytes / 2**20:.1f} "
                         f"| {1e3 * r.seconds:.2f} | {r.gbps:.2f} | {share:.0%} |")
        # the job's wall time; its share is the stages' seconds over it (above 100%: the stages overlapped)
        overlap = record.stage_seconds / record.seconds if record.seconds > 0 else 0.0
        lines.append(f"| {record.kind.value} | {record.path} | **wall** | 1 | {record.nbytes / 2**20:.1f} "
                     f"| {1e3 * record.seconds:.2f} | {record.nbytes / record.seconds / 1e9 if record.seconds > 0 else 0.0:.2f} "
                     f"| stages {overlap:.0%} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- the jobs
# (imports here: the record types above import nothing of ems, so metrics code can use them without the data path)

import concurrent.futures  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ems.config import parse_size  # noqa: E402
from ems.devices import side_stream  # noqa: E402
from ems.errors import EmsErrorCode  # noqa: E402
from ems.kernels import CopyBackend  # noqa: E402
from ems.planning import BlockPlan, Plan, RawPlan, encode_range  # noqa: E402
from ems.pool_client import PUT_META_PER_KEY, PoolClient, PoolOutcome, RequestLimits, deadline_of, split_batches  # noqa: E402
from ems.staging import StagingLease, StagingPool  # noqa: E402
from ems.store import KvStore  # noqa: E402
from ems.transport.base import TransportError  # noqa: E402
from ems.types import CcKvOption  # noqa: E402
from ems.buffers import Buffer  # noqa: E402
from ems.value_format import HEADER_SIZE, build_headers, checksum, matches, valid_prefix  # noqa: E402

CHUNK_ENV = "EMS_CHUNK_BYTES"
# perf/RESULTS.md (API over UCX): on a CPU-only host one chunk is fastest (the copies compete with the wire for the
# same cores) and small chunks lose to per-request costs; 32 MiB keeps typical requests one chunk, and
# PIPELINE_DEPTH x 32 MiB stays within the smallest default in-flight budget of a node (64 MiB: a chunk never waits)
DEFAULT_CHUNK_BYTES = 32 << 20
PIPELINE_DEPTH = 2  # chunk requests of one job on the wire at once (see perf/RESULTS.md, API over UCX)
FENCE_GRACE_S = 2.0  # past the request's deadline, how long a job waits for a chunk call that bounds itself anyway


def chunk_bytes() -> int:
    """The pipelined path's chunk size: `EMS_CHUNK_BYTES` (a size: "4MiB", "1048576"; 0: one chunk per request),
    read at each job like ENABLE_CC_PROFILING; `DEFAULT_CHUNK_BYTES` when unset."""
    text = os.environ.get(CHUNK_ENV, "").strip()
    return parse_size(CHUNK_ENV, text) if text else DEFAULT_CHUNK_BYTES


def plan_chunks(plan: Plan, limits: RequestLimits, target: int) -> list[tuple[int, int]]:
    """The request's chunks, (first value, end) in order: consecutive values of at most `target` payload bytes each
    (a larger value is a chunk alone), within `limits` (keys, meta, frames; data bytes: the pool client splits a
    chunk whose headers take it over) so that a chunk is one request to a node; `target` 0: the whole request as
    one chunk (the pool client then splits it at the limits itself)."""
    if target <= 0 or plan.total == 0:
        return [(0, plan.total)]
    parts = 1 if plan.header_in_staging else 2  # data frames per value: the value, or its header and payload
    meta = np.fromiter((len(k) for k in plan.keys), dtype=np.int64, count=plan.total) + PUT_META_PER_KEY + 8 * parts
    frames = np.full(plan.total, parts, dtype=np.int64)
    caps = dataclasses.replace(limits, max_data_bytes=min(limits.max_data_bytes, target))
    return [(s.start, s.stop) for s in split_batches(caps, plan.expected.payload_len, meta, frames)]


def merge_outcomes(outcomes: List[PoolOutcome], total: int) -> PoolOutcome:
    """One outcome for a request from its chunks' (in order): results concatenated (keys of chunks that never ran:
    False), every error kept; nodes contacted add up, so the request is unreachable exactly when every chunk that
    ran found every node it needed failed."""
    results: list = [r for o in outcomes for r in o.results]
    results += [False] * (total - len(results))
    merged: PoolOutcome = PoolOutcome(results)
    for o in outcomes:
        merged.errors.extend(o.errors)
        merged.nodes_contacted += o.nodes_contacted
    merged.verified = bool(outcomes) and all(o.verified for o in outcomes)
    return merged


def _failed_chunk(count: int, code: EmsErrorCode, message: str) -> PoolOutcome:
    """A chunk whose call did not give an outcome: none of its keys done, the failure as its one error."""
    return PoolOutcome([False] * count, [TransportError(code, message)], nodes_contacted=1)


def _fence_wait_s(deadline: float) -> float:
    """How long a job still waits for a chunk call: until the request's deadline plus the grace."""
    return max(0.0, deadline + FENCE_GRACE_S - time.monotonic())


def _chunk_outcome(future: "concurrent.futures.Future", count: int, deadline: float) -> Any:
    """A chunk call's result, waiting at most until `deadline` (+ grace); a call that raised or did not return is
    a failed chunk."""
    try:
        return future.result(timeout=_fence_wait_s(deadline))
    except concurrent.futures.TimeoutError:
        return _failed_chunk(count, EmsErrorCode.EMS_IO_TIMEOUT, "chunk: no answer in time")
    except concurrent.futures.CancelledError:
        return PoolOutcome([False] * count)
    except Exception as error:  # a bug below must not become a wrong block: the chunk's keys fail
        return _failed_chunk(count, EmsErrorCode.EMS_IO_ERROR, f"chunk failed: {error!r}")


def run_now(call: Callable[[], Any]) -> "concurrent.futures.Future":
    """Run `call` in this thread; its result or exception as a finished future (what `fence` and `_chunk_outcome`
    read). An interrupt is recorded too (the transfer may still touch its buffer: `fence` then says so), then
    raised."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        future.set_result(call())
    except BaseException as error:
        future.set_exception(error)
        if not isinstance(error, Exception):
            raise
    return future


def fence(futures: List["concurrent.futures.Future"], deadline: float) -> bool:
    """Stop a request's chunk calls: cancel those not started, wait (bounded by `deadline` + grace) for the others.
    True when none can touch the request's buffers any more: every call was cancelled, or returned an outcome
    without errors (a failed or timed-out transfer is aborted on its endpoint, not awaited)."""
    for future in futures:
        future.cancel()
    _, not_done = concurrent.futures.wait(futures, timeout=_fence_wait_s(deadline))
    if not_done:
        return False
    for future in futures:
        if future.cancelled():
            continue
        if future.exception() is not None:
            return False
        result = future.result()
        outcome = result[0] if isinstance(result, tuple) else result
        if outcome.errors:
            return False
    return True


def readable_tensor(value: Buffer) -> torch.Tensor:
    """A uint8 tensor over a stored value's bytes, for reading (a scatter never writes its source). No copy for the
    store's own buffers (a read-only view of a numpy array); a copy for anything torch cannot view."""
    owner = value.obj if isinstance(value, memoryview) else value
    if isinstance(owner, np.ndarray) and owner.dtype == np.uint8 and owner.ndim == 1 and owner.nbytes == len(value):
        if owner.flags.writeable:
            return torch.from_numpy(owner)
    if isinstance(owner, bytearray) and len(owner) == len(value):
        return torch.frombuffer(owner, dtype=torch.uint8)
    return torch.frombuffer(bytearray(value), dtype=torch.uint8)


class SaveJob:
    """One save: `begin()` takes every byte out of the engine's cache (then the engine may overwrite it),
    `finish()` stores them and returns the consecutive acknowledged prefix; `abandon()` gives everything back
    when `finish` will never run. See the module docstring for the two paths."""

    def __init__(self, plan: Plan, device: torch.device, backend: CopyBackend, pool: PoolClient,
                 staging: StagingPool, option: CcKvOption, record: JobRecord) -> None:
        self.plan, self.device, self.backend, self.pool = plan, device, backend, pool
        self.staging, self.option, self.record = staging, option, record
        self.store: Optional[KvStore] = pool.local_store if device.type == "cpu" else None
        self.record.path = "one-pass" if self.store is not None else "pipelined"
        self._buffers: List[np.ndarray] = []
        self._reserved: List[int] = []  # the store's reservation for each buffer
        self._lease: Optional[StagingLease] = None
        self._chunks: List[tuple[int, int]] = []
        self._sends: List[concurrent.futures.Future] = []  # each chunk's encode + put, in order
        self._stop = threading.Event()  # set: chunks not yet sent are not sent (an earlier one failed, or abandon)
        self._deadline = 0.0
        self._lone: Optional[Callable[[], PoolOutcome]] = None  # a one-chunk save's send, run by `finish`

    def begin(self) -> None:
        try:
            if self.store is not None:
                self._begin_one_pass(self.store)
            else:
                self._begin_staged()
        except BaseException:  # interrupts included: nothing leaks
            self.abandon()
            raise

    def _begin_one_pass(self, store: KvStore) -> None:
        plan, record = self.plan, self.record
        checksums = []
        for i in range(plan.total):  # chunk = one value: gathered and checksummed while in cache
            nbytes = plan.value_len(i)
            reserve = store.charge_of(len(plan.keys[i]), nbytes)
            if reserve > store.capacity_bytes:  # refused like any value larger than the pool: not gathered
                break
            buffer = store.allocate(nbytes, reserve)
            self._buffers.append(buffer)
            self._reserved.append(reserve)
            with record.stage(Stage.GATHER, nbytes - HEADER_SIZE):
                plan.gather_value(self.backend, i, torch.from_numpy(buffer))
            with record.stage(Stage.ENCODE, nbytes - HEADER_SIZE):
                checksums.append(checksum([memoryview(buffer)[HEADER_SIZE:]]))
        with record.stage(Stage.ENCODE):
            for buffer, header in zip(self._buffers, build_headers(plan.expected, checksums)):
                buffer[:HEADER_SIZE] = np.frombuffer(header, dtype=np.uint8)

    def _begin_staged(self) -> None:
        """Per chunk: gather into its range of staging (then to host), start its encode + put; next chunk."""
        plan, record = self.plan, self.record
        self._deadline = deadline_of(self.option)
        self._lease = lease = self.staging.acquire(plan.staging_bytes, self.device)
        host = lease.host_view()
        self._chunks = plan_chunks(plan, self.pool.limits, chunk_bytes())
        for a, b in self._chunks:
            lo, hi = int(plan.value_start[a]), int(plan.value_start[b])
            with side_stream(self.device):  # waits for the chunk's device work at the end
                with record.stage(Stage.GATHER, int(plan.expected.payload_len[a:b].sum())):
                    plan.gather_range(self.backend, lease.device, a, b)
                if lease.host is not lease.device:
                    with record.stage(Stage.COPY, hi - lo):
                        lease.host[lo:hi].copy_(lease.device[lo:hi], non_blocking=True)
            if len(self._chunks) == 1:  # nothing to overlap: `finish` sends it on its own thread (no thread hop)
                self._lone = functools.partial(self._send_chunk, host, a, b, None)
                return
            ahead = self._sends[-PIPELINE_DEPTH] if len(self._sends) >= PIPELINE_DEPTH else None
            self._sends.append(self.pool.start(functools.partial(self._send_chunk, host, a, b, ahead)))

    def _send_chunk(self, host: memoryview, a: int, b: int, ahead: Optional[concurrent.futures.Future]) -> PoolOutcome:
        """On a pipeline thread: checksum and header values a..b-1 in place, then, once the chunk `PIPELINE_DEPTH`
        places ahead (`ahead`, started earlier: running or done) has returned, put them (by the request's
        deadline)."""
        plan, record = self.plan, self.record
        if self._stop.is_set():  # the save's prefix already ends before this chunk: not sent
            return PoolOutcome([False] * (b - a))
        try:
            start = time.perf_counter()
            values = encode_range(plan, host, a, b)
            record.add(Stage.ENCODE, int(plan.expected.payload_len[a:b].sum()), time.perf_counter() - start)
            if ahead is not None:
                concurrent.futures.wait([ahead], timeout=max(0.0, self._deadline - time.monotonic()))
            if self._stop.is_set() or time.monotonic() >= self._deadline:
                return PoolOutcome([False] * (b - a))
            sent = time.perf_counter()
            value_lens = plan.expected.payload_len[a:b] + HEADER_SIZE
            outcome = self.pool.put(plan.route_keys[a:b], plan.keys[a:b], values, self.option, value_lens,
                                    deadline=self._deadline)
            record.add(Stage.SEND, int(value_lens.sum()), time.perf_counter() - sent)
        except BaseException:
            self._stop.set()
            raise
        if not all(outcome.results):
            self._stop.set()
        return outcome

    def finish(self) -> PoolOutcome:
        """Store the values; the outcome's results say which keys were acknowledged."""
        plan, record = self.plan, self.record
        try:
            if self.store is not None:
                with record.stage(Stage.SEND, int(plan.expected.payload_len.sum()) + HEADER_SIZE * plan.total):
                    buffers, reserved = self._buffers, self._reserved
                    self._buffers, self._reserved = [], []  # the store owns them now (reservations released)
                    results = [self.store.put_owned(k, b, r) for k, b, r in zip(plan.keys, buffers, reserved)]
                    results += [False] * (plan.total - len(results))  # values larger than the pool
                    del buffers
                outcome = PoolOutcome(results)
                outcome.nodes_contacted = 1
                return outcome
            if self._lease is None:
                raise RuntimeError("SaveJob.finish() before begin()")
            lone, self._lone = self._lone, None
            if lone is not None:
                self._sends.append(run_now(lone))
            outcomes = [_chunk_outcome(f, b - a, self._deadline) for f, (a, b) in zip(self._sends, self._chunks)]
            return merge_outcomes(outcomes, plan.total)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Give back the staging lease and any buffer not handed to the store (idempotent). Chunks not yet sent are
        not sent; the lease goes back only once no put in flight can read it any more (`fence`)."""
        self._stop.set()
        sends, self._sends = self._sends, []
        clean = fence(sends, self._deadline) if sends else True
        lease, self._lease = self._lease, None
        if lease is not None:
            (self.staging.release if clean else self.staging.retire)(lease)
        buffers, self._buffers = self._buffers, []
        reserved, self._reserved = self._reserved, []
        if self.store is not None:
            for buffer, reserve in zip(buffers, reserved):
                self.store.recycle(buffer, reserve)


class LoadJob:
    """One load: receive → verify → scatter, writing only the verified prefix (see the module docstring)."""

    def __init__(self, plan: Plan, device: torch.device, backend: CopyBackend, pool: PoolClient,
                 staging: StagingPool, option: CcKvOption, record: JobRecord) -> None:
        self.plan, self.device, self.backend, self.pool = plan, device, backend, pool
        self.staging, self.option, self.record = staging, option, record
        self.one_pass = device.type == "cpu" and pool.local_store is not None
        self.record.path = "one-pass" if self.one_pass else "pipelined" if isinstance(plan, BlockPlan) else "staged"

    def run(self) -> tuple[int, PoolOutcome]:
        """(blocks written, the pool's outcome)."""
        plan, record = self.plan, self.record
        if self.one_pass:
            with record.stage(Stage.RECEIVE):
                store = self.pool.local_store
                if store is not None:  # the embedded store itself: no routing, batching or deadlines to apply
                    outcome = PoolOutcome(store.get_many(plan.keys), nodes_contacted=1)
                else:
                    outcome = self.pool.get(plan.route_keys, plan.keys, self.option, plan.expected)
            return self._verify_and_scatter_each(outcome.results), outcome
        if isinstance(plan, BlockPlan):
            return self._run_pipelined(plan)
        return self._receive_copy_scatter(plan)

    def _receive_copy_scatter(self, plan: RawPlan) -> tuple[int, PoolOutcome]:
        """V0 (its staging has no room for the headers): receive, verify the prefix, copy it into staging, scatter."""
        record = self.record
        with record.stage(Stage.RECEIVE):
            outcome = self.pool.get(plan.route_keys, plan.keys, self.option, plan.expected)
        with record.stage(Stage.VERIFY, int(plan.expected.payload_len.sum())):
            if outcome.verified:  # the pool checked every value it returned (replicas: to fall back on damage)
                hits = next((i for i, v in enumerate(outcome.results) if v is None), len(outcome.results))
            else:
                hits = valid_prefix(outcome.results, plan.expected)
        if hits:
            nbytes = int(plan.value_start[hits])
            lease = self.staging.acquire(nbytes, self.device)
            try:
                with record.stage(Stage.COPY, nbytes):
                    plan.fill_from_values(lease.host_array(), outcome.results, hits)  # type: ignore[arg-type]  # the first `hits` are present
                    with side_stream(self.device):
                        if lease.host is not lease.device:
                            lease.device[:nbytes].copy_(lease.host[:nbytes], non_blocking=True)
                with record.stage(Stage.SCATTER, int(plan.expected.payload_len[:hits].sum())):
                    with side_stream(self.device):
                        plan.scatter_range(self.backend, lease.device, 0, hits)
            finally:
                self.staging.release(lease)
        return hits, outcome

    def _run_pipelined(self, plan: BlockPlan) -> tuple[int, PoolOutcome]:
        """Chunks' receive + verify run on the pipeline threads, `PIPELINE_DEPTH` at once; scatter chunk k's
        verified prefix while later chunks arrive; stop at the first miss (nothing after it is written)."""
        record = self.record
        deadline = deadline_of(self.option)
        chunks = plan_chunks(plan, self.pool.limits, chunk_bytes())
        stop = threading.Event()
        lease = self.staging.acquire(plan.staging_bytes, self.device)
        host = lease.host_view()
        receives: List[concurrent.futures.Future] = []

        def start(k: int) -> None:
            if k < len(chunks):
                a, b = chunks[k]
                call = functools.partial(self._receive_chunk, plan, host, a, b, deadline, stop)
                # one chunk: nothing to overlap, so it runs here (no thread hop); else on the pipeline threads
                receives.append(run_now(call) if len(chunks) == 1 else self.pool.start(call))

        outcomes: List[PoolOutcome] = []
        hits = 0
        clean = False
        try:
            for k in range(PIPELINE_DEPTH):
                start(k)
            for k, (a, b) in enumerate(chunks):
                got = _chunk_outcome(receives[k], b - a, deadline)
                outcome, valid = got if isinstance(got, tuple) else (got, 0)
                outcomes.append(outcome)
                if valid == b - a:
                    start(k + PIPELINE_DEPTH)  # before the scatter: chunk k + depth arrives while chunk k is written
                if valid:
                    lo, hi = int(plan.value_start[a]), int(plan.value_start[a + valid])
                    with side_stream(self.device):
                        if lease.host is not lease.device:
                            with record.stage(Stage.COPY, hi - lo):
                                lease.device[lo:hi].copy_(lease.host[lo:hi], non_blocking=True)
                        with record.stage(Stage.SCATTER, int(plan.expected.payload_len[a : a + valid].sum())):
                            plan.scatter_range(self.backend, lease.device, a, a + valid)
                    hits = a + valid
                if valid < b - a:
                    break
        finally:
            stop.set()
            clean = fence(receives, deadline)
            (self.staging.release if clean else self.staging.retire)(lease)
        return hits, merge_outcomes(outcomes, plan.total)

    def _receive_chunk(self, plan: BlockPlan, host: memoryview, a: int, b: int, deadline: float,
                       stop: threading.Event) -> tuple[PoolOutcome, int]:
        """On a pipeline thread: values a..b-1 straight into their places in staging, then how many of them, from
        the first, are exactly the expected values."""
        record = self.record
        if stop.is_set():  # the load already stopped before this chunk
            return PoolOutcome([False] * (b - a)), 0
        expected = plan.expected.range(a, b)
        start = time.perf_counter()
        outs = plan.value_views(host, a, b)
        outcome = self.pool.get_into(plan.route_keys[a:b], plan.keys[a:b], outs, self.option, expected, deadline)
        received = time.perf_counter()
        placed = next((i for i, ok in enumerate(outcome.results) if not ok), b - a)
        record.add(Stage.RECEIVE, int(expected.payload_len[:placed].sum()) + HEADER_SIZE * placed, received - start)
        if outcome.verified:  # the pool checked each value it placed (replicas: to fall back on damage)
            valid = placed
        else:
            valid = valid_prefix(outs[:placed], expected)
        record.add(Stage.VERIFY, int(expected.payload_len[:placed].sum()), time.perf_counter() - received)
        return outcome, valid

    def _verify_and_scatter_each(self, values: List[Optional[Buffer]]) -> int:
        """Per value: verify (header, checksum: the bytes come into cache), then scatter it while they are there."""
        plan, record = self.plan, self.record
        for i, value in enumerate(values):
            nbytes = int(plan.expected.payload_len[i])
            with record.stage(Stage.VERIFY, nbytes):
                ok = matches(value, plan.expected, i)
            if not ok:
                return i
            with record.stage(Stage.SCATTER, nbytes):
                plan.scatter_value(self.backend, i, readable_tensor(value))  # type: ignore[arg-type]
        return len(values)

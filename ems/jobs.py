"""Save and load jobs: one request's data path as explicit stages over chunks of blocks, each stage recorded.

A `SaveJob` runs gather → encode → send, a `LoadJob` receive → verify → scatter (plus `copy` between device and
host staging on accelerators). Each job keeps a `JobRecord`: per stage the bytes it moved, the seconds it took and
how many times it ran (once per chunk). That record is the one account of where a request's time went: the
benchmarks print it, `ENABLE_CC_PROFILING=1` logs it (logger `ems.profile`), and a `JobLedger` sums records for
metrics (per operation: calls, blocks, bytes and seconds per stage).

Two ways through the stages (chosen by `ContextCaching`, not by the caller):
* **One pass** (the embedded pool on CPU): chunk = one value. Gather writes the value's payload straight into a
  buffer from the store's arena, encode checksums it while it is still in cache and writes its header in place,
  send hands the buffer to the store (`put_owned`: no copy). A load receives the stored buffers, and per value
  verifies (header and checksum) then scatters straight from the stored bytes, stopping at the first miss.
* **Staged** (remote pools, accelerators): chunk = the request. Gather into staging (one backend call per layer
  group, headers' places left free), copy to host, encode every value, one batched put; a load gets, verifies the
  prefix, copies it into staging and scatters it with one backend call per layer group.

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
from typing import Dict, List, Optional

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
    path: str = ""  # "one-pass" or "staged"
    blocks_ok: int = 0
    blocks_total: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    stages: Dict[Stage, StageRecord] = field(default_factory=dict)
    _started: float = field(default_factory=time.perf_counter, repr=False)

    def stage(self, stage: Stage, nbytes: int = 0) -> "StageTimer":
        """Time the body of a `with` as (one run of) `stage`, moving `nbytes`."""
        return StageTimer(self, stage, nbytes)

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
        stages = self._record.stages
        record = stages.get(self._stage)
        if record is None:
            record = stages[self._stage] = StageRecord()
        record.seconds += time.perf_counter() - self._start
        record.nbytes += self._nbytes
        record.runs += 1


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
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- the jobs
# (imports here: the record types above import nothing of ems, so metrics code can use them without the data path)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ems.devices import side_stream  # noqa: E402
from ems.kernels import CopyBackend  # noqa: E402
from ems.planning import Plan  # noqa: E402
from ems.pool_client import PoolClient, PoolOutcome  # noqa: E402
from ems.staging import StagingLease, StagingPool  # noqa: E402
from ems.store import KvStore  # noqa: E402
from ems.types import CcKvOption  # noqa: E402
from ems.buffers import Buffer  # noqa: E402
from ems.value_format import HEADER_SIZE, build_headers, checksum, matches, valid_prefix  # noqa: E402


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
        self.record.path = "one-pass" if self.store is not None else "staged"
        self._buffers: List[np.ndarray] = []
        self._reserved: List[int] = []  # the store's reservation for each buffer
        self._lease: Optional[StagingLease] = None

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
        plan, record = self.plan, self.record
        self._lease = lease = self.staging.acquire(plan.staging_bytes, self.device)
        with side_stream(self.device):
            with record.stage(Stage.GATHER, int(plan.expected.payload_len.sum())):
                plan.gather(self.backend, lease.device)
            if lease.host is not lease.device:
                with record.stage(Stage.COPY, plan.staging_bytes):
                    lease.host[: plan.staging_bytes].copy_(lease.device[: plan.staging_bytes], non_blocking=True)

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
            host = self._lease.host_view()
            with record.stage(Stage.ENCODE, int(plan.expected.payload_len.sum())):
                headers = build_headers(plan.expected, [checksum([p]) for p in plan.payloads(host)])
                values = plan.stored_values(host, headers)
            value_lens = plan.expected.payload_len + HEADER_SIZE
            with record.stage(Stage.SEND, int(value_lens.sum())):
                return self.pool.put(plan.route_keys, plan.keys, values, self.option, value_lens)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Give back the staging lease and any buffer not handed to the store (idempotent)."""
        lease, self._lease = self._lease, None
        if lease is not None:
            self.staging.release(lease)
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
        self.record.path = "one-pass" if self.one_pass else "staged"

    def run(self) -> tuple[int, PoolOutcome]:
        """(blocks written, the pool's outcome)."""
        plan, record = self.plan, self.record
        with record.stage(Stage.RECEIVE):
            store = self.pool.local_store if self.one_pass else None
            if store is not None:  # the embedded store itself: no routing, batching or deadlines to apply
                outcome = PoolOutcome(store.get_many(plan.keys), nodes_contacted=1)
            else:
                outcome = self.pool.get(plan.route_keys, plan.keys, self.option, plan.expected)
        if self.one_pass:
            return self._verify_and_scatter_each(outcome.results), outcome
        with record.stage(Stage.VERIFY, int(plan.expected.payload_len.sum())):
            if outcome.verified:  # the pool checked every value it returned (replicas: to fall back on damage)
                hits = next((i for i, v in enumerate(outcome.results) if v is None), len(outcome.results))
            else:
                hits = valid_prefix(outcome.results, plan.expected)
        if hits:
            nbytes = plan.prefix_staging_bytes(hits)
            lease = self.staging.acquire(nbytes, self.device)
            try:
                with record.stage(Stage.COPY, nbytes):
                    plan.fill_from_values(lease.host_array(), outcome.results, hits)  # type: ignore[arg-type]
                    with side_stream(self.device):
                        if lease.host is not lease.device:
                            lease.device[:nbytes].copy_(lease.host[:nbytes], non_blocking=True)
                with record.stage(Stage.SCATTER, int(plan.expected.payload_len[:hits].sum())):
                    with side_stream(self.device):
                        plan.scatter_prefix(self.backend, lease.device, hits)
            finally:
                self.staging.release(lease)
        return hits, outcome

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

"""A job's time: the deadline it must meet (`Deadline`), where its time went, stage by stage (`JobRecord`), and the
ledger that sums the records.

A job (`ems.datapath.jobs`) keeps one `JobRecord`: per `Stage` the bytes it moved, the seconds it took and how many times it
ran (once per chunk, or once per request). Pipelined stages overlap, so their seconds may add up to more than the
job's wall time (`JobRecord.seconds`); `stage_table` prints both. That record is the one account of where a
request's time went: the benchmarks print it, `ENABLE_CC_PROFILING=1` logs it (logger `ems.profile`), and a
`JobLedger` sums records for metrics (per operation: calls, blocks, bytes and seconds per stage). This module
imports nothing of ems, not even for type checking: it lies below the data path and the transport (which hands
deadlines down), so metrics code can use it alone and the public types name it (`ems.types.CcFuture.job`).

Deadlines (the one way a call's time limit travels between the layers: API option, jobs, pool client, node
clients, the node's waits):
* A `Deadline` is a point on the `time.monotonic()` clock (`at`), fixed when the request starts (`of(option)`,
  `after(seconds)`) and handed down unchanged: every layer asks it what is `left()` at the moment it waits, so the
  layers below a request never restart its clock, and the chunks of one request share it.
* `of(option)`: the option's timeout in milliseconds, clamped to `MAX_TIMEOUT_MS` (0, or anything above it: that
  maximum; `ems.types` re-exports it with the option). `left()` is never negative; `expired()` says whether it has passed.
* `within(limit)`: a `Deadline` as it is, or seconds from now: the one place a span becomes a deadline below the
  API (a node client's entry, for callers that hold seconds).
* `extended(seconds)`: the same point moved later (a fence that waits a grace past a request's deadline).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

profile_logger = logging.getLogger("ems.profile")


MAX_TIMEOUT_MS = 365 * 24 * 3600 * 1000  # the longest wait a request honours: larger timeouts (and 0) mean this


class TimedOption(Protocol):
    """What a deadline reads of a request's option (`ems.types.CcKvOption` is one)."""

    @property
    def timeout(self) -> int:
        """Milliseconds for the whole request; 0: no limit (`MAX_TIMEOUT_MS`)."""
        ...


@dataclass(frozen=True)
class Deadline:
    """A monotonic point in time by which something must be done; see the module docstring."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """The deadline `seconds` from now (a negative span is now)."""
        return cls(time.monotonic() + max(0.0, seconds))

    @classmethod
    def of(cls, option: TimedOption) -> Deadline:
        """The deadline of a request with `option` that starts now."""
        return cls.after(timeout_seconds(option))

    @classmethod
    def within(cls, limit: Deadline | float) -> Deadline:
        """`limit` itself, or the deadline `limit` seconds from now (a node client's callers outside the pool
        client, tools and tests, may give seconds; the pool client always hands a `Deadline` down)."""
        return limit if isinstance(limit, Deadline) else cls.after(limit)

    def left(self) -> float:
        """Seconds until the deadline, 0 once it has passed."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def extended(self, seconds: float) -> Deadline:
        """The same deadline `seconds` later."""
        return Deadline(self.at + seconds)


def timeout_seconds(option: TimedOption) -> float:
    """The option's timeout in seconds, clamped to `MAX_TIMEOUT_MS`; 0 (no limit) is that maximum too."""
    timeout_ms = option.timeout if 0 < option.timeout < MAX_TIMEOUT_MS else MAX_TIMEOUT_MS
    return timeout_ms / 1000.0


class Stage(str, enum.Enum):
    """The stages of a job, in the order they run."""

    PLAN = "plan"  # check arguments, keys, piece tables
    GATHER = "gather"  # engine cache → staging or the store's buffer
    COPY = "copy"  # device ↔ host staging (accelerators only)
    ENCODE = "encode"  # checksum and header per value
    SEND = "send"  # to the pool (the embedded store's index, or the wire)
    RECEIVE = "receive"  # from the pool
    VERIFY = "verify"  # header and checksum per value, up to the first miss (headers only where the scatter verifies)
    SCATTER = "scatter"  # staging or the stored value → engine cache (with the checksums, on the compiled host copy)


class JobKind(str, enum.Enum):
    SAVE = "save"
    LOAD = "load"


@dataclass
class StageRecord:
    """What one stage did over a job (or, in a ledger, over many)."""

    nbytes: int = 0
    seconds: float = 0.0
    runs: int = 0

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class JobRecord:
    """One job's account: blocks done of total, bytes moved, and per stage bytes, seconds and runs."""

    kind: JobKind
    profile: bool = False  # log the record on `ems.profile` when it finishes (Settings.profiling)
    path: str = ""  # "one-pass", "pipelined", (V0 loads from pool nodes) "staged" or (no values) "none"
    blocks_ok: int = 0
    blocks_total: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    _runs: list[tuple[Stage, int, float]] = field(default_factory=list, repr=False)  # (stage, bytes, seconds)
    _started: float = field(default_factory=time.perf_counter, repr=False)

    def stage(self, stage: Stage, nbytes: int = 0) -> StageTimer:
        """Time the body of a `with` as (one run of) `stage`, moving `nbytes`."""
        return StageTimer(self, stage, nbytes)

    def copying(self, nbytes: int) -> StageTimer:
        """Time the body of a `with` as one copy of `nbytes` between device and host staging (`Stage.COPY`): how a
        staging lease records its copies (`ems.staging.CopyRecord`)."""
        return StageTimer(self, Stage.COPY, nbytes)

    def add(self, stage: Stage, nbytes: int, seconds: float) -> None:
        """One run of `stage`. Thread-safe without a lock (a pipelined job's chunks run stages on several threads):
        one `list.append`, summed when `stages` is read; a small call runs about five stages."""
        self._runs.append((stage, nbytes, seconds))

    def runs(self) -> list[tuple[Stage, int, float]]:
        """Every stage run so far, in order: (stage, bytes, seconds)."""
        return list(self._runs)

    @property
    def stages(self) -> dict[Stage, StageRecord]:
        """Per stage: bytes, seconds and runs so far."""
        out: dict[Stage, StageRecord] = {}
        _sum_runs(out, self.runs())
        return out

    @property
    def stage_seconds(self) -> float:
        """The stages' seconds added up (more than `seconds` where they overlapped)."""
        return sum(r.seconds for r in self.stages.values())

    def finish(self, blocks_ok: int, blocks_total: int, nbytes: int) -> JobRecord:
        self.blocks_ok, self.blocks_total, self.nbytes = blocks_ok, blocks_total, nbytes
        self.seconds = time.perf_counter() - self._started
        if self.profile:
            profile_logger.info("%s", self.summary())
        return self

    def summary(self) -> str:
        stages = ", ".join(f"{s.value} {1e3 * r.seconds:.2f} ms/{r.nbytes} B" for s, r in sorted(self.stages.items(), key=_order))
        return (
            f"{self.kind.value} {self.blocks_ok}/{self.blocks_total} blocks, {self.nbytes} bytes, "
            f"{1e3 * self.seconds:.2f} ms ({self.path}): {stages}"
        )


def _sum_runs(stages: dict[Stage, StageRecord], runs: list[tuple[Stage, int, float]]) -> None:
    """Add stage runs (stage, bytes, seconds) into per-stage sums."""
    for stage, nbytes, seconds in runs:
        total = stages.get(stage)
        if total is None:
            total = stages[stage] = StageRecord()
        total.nbytes += nbytes
        total.seconds += seconds
        total.runs += 1


class StageTimer:
    """`with record.stage(...)`: adds the body's time, bytes and one run to the record's stage, on every exit path.
    (A plain class: a generator-based context manager costs several µs, and a small call runs about ten stages.)"""

    __slots__ = ("_nbytes", "_record", "_stage", "_start")

    def __init__(self, record: JobRecord, stage: Stage, nbytes: int) -> None:
        self._record, self._stage, self._nbytes, self._start = record, stage, nbytes, 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._record.add(self._stage, self._nbytes, time.perf_counter() - self._start)


def _order(item: tuple[Stage, StageRecord]) -> int:
    return list(Stage).index(item[0])


@dataclass
class KindTotals:
    """A ledger's sums for one kind of job."""

    jobs: int = 0
    blocks_ok: int = 0
    blocks_total: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    stages: dict[Stage, StageRecord] = field(default_factory=dict)


class JobLedger:
    """Thread-safe sums of job records per kind, and the last record of each kind (what metrics read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[JobKind, KindTotals] = {k: KindTotals() for k in JobKind}
        self._last: dict[JobKind, JobRecord | None] = {k: None for k in JobKind}

    def add(self, record: JobRecord) -> None:
        with self._lock:
            totals = self._totals[record.kind]
            totals.jobs += 1
            totals.blocks_ok += record.blocks_ok
            totals.blocks_total += record.blocks_total
            totals.nbytes += record.nbytes
            totals.seconds += record.seconds
            _sum_runs(totals.stages, record.runs())
            self._last[record.kind] = record

    def totals(self, kind: JobKind) -> KindTotals:
        """A copy of the sums for `kind`."""
        with self._lock:
            t = self._totals[kind]
            return KindTotals(
                t.jobs,
                t.blocks_ok,
                t.blocks_total,
                t.nbytes,
                t.seconds,
                {s: StageRecord(r.nbytes, r.seconds, r.runs) for s, r in t.stages.items()},
            )

    def last(self, kind: JobKind) -> JobRecord | None:
        with self._lock:
            return self._last[kind]


def stage_table(records: list[JobRecord]) -> str:
    """A markdown table of the stages of `records` (one row per job and stage): bytes, ms, GB/s, share of the job."""
    lines = ["| job | path | stage | runs | MiB | ms | GB/s | share of job |", "|---|---|---|---|---|---|---|---|"]
    for record in records:
        for stage, r in sorted(record.stages.items(), key=_order):
            share = r.seconds / record.seconds if record.seconds > 0 else 0.0
            lines.append(
                f"| {record.kind.value} | {record.path} | {stage.value} | {r.runs} | {r.nbytes / 2**20:.1f} "
                f"| {1e3 * r.seconds:.2f} | {r.gbps:.2f} | {share:.0%} |"
            )
        # the job's wall time; its share is the stages' seconds over it (above 100%: the stages overlapped)
        overlap = record.stage_seconds / record.seconds if record.seconds > 0 else 0.0
        lines.append(
            f"| {record.kind.value} | {record.path} | **wall** | 1 | {record.nbytes / 2**20:.1f} "
            f"| {1e3 * record.seconds:.2f} | {record.nbytes / record.seconds / 1e9 if record.seconds > 0 else 0.0:.2f} "
            f"| stages {overlap:.0%} |"
        )
    return "\n".join(lines)

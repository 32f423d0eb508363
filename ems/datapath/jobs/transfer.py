"""A call's transfer as data, and the jobs' contract.

`Transfer` is one save or load call's descriptor: what moves (`plan`: data, `ems.datapath.planning`), on which device,
by which copier (`ems.datapath.copier`, chosen once for the job), with the call's option and its job record.
`JobContext` is where a client's transfers go and what they run on: its pool, its staging pool, the chunk size and
the executor its chunk calls share (`ems.datapath.executor`: the client's, not the pool's). Each pool call a job
makes for values a..b-1 of its plan is one `PoolCall` (`pool_call`). A job is built from
the two by its `JobPath` (the path a client's calls on one device take, chosen once per device:
`ems.datapath.jobs.job_path`; a call of no values is `NothingToMove` on every path) and runs as a `SaveJob` (the base
class of every save job) or a `LoadJob`; no job holds anything a descriptor does not name, and every job gives back
every buffer and lease on every path.

What a load received for one call or one chunk is one value object (`ReceivedValues`): its bytes, the values they
are expected to be, where they lie, and what the pool checked of them.
* Columns, never an object per value: value i is `buffers[i]` (its bytes; None: missing), expected to be value i of
  `expected` (one per value: ValueError otherwise; `ExpectedValues`: kind, layout signature, tokens digest and
  payload length of each, numpy), at `addresses[i]` where the pool knows it (the embedded store), else None.
* `checked` (`ReadCheck`) is what the pool's read checked of them: `EXPECTED`, each value it placed is exactly the
  expected one already (nothing is checked again); `NONE`, the bytes as stored (the load checks them:
  `verified_prefix` here, or its copier's `Copier.check`).
* A value is a hit only from the first on: every prefix here stops at the first value that is missing or wrong.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ems.backends.base import PoolBackend, PoolCall, PoolOutcome, ReadCheck
from ems.buffers import Buffer
from ems.datapath.copier import Copier
from ems.datapath.executor import ChunkExecutor
from ems.datapath.planning import Plan
from ems.records import Deadline, JobRecord
from ems.staging import StagingPool
from ems.store.value_format import ExpectedValues, valid_prefix
from ems.types import CcKvOption


@dataclass(frozen=True)
class Transfer:
    """One call's transfer: its plan, the device of the engine's cache, the job's copier, the call's option
    (deadline, read cache) and the job's record (every stage is recorded there)."""

    plan: Plan
    device: torch.device
    copier: Copier
    option: CcKvOption
    record: JobRecord


@dataclass(frozen=True)
class JobContext:
    """Where a client's transfers go: the pool, the staging pool (`ems.staging`), the chunk size of a pipelined job
    (`Settings.chunk_bytes`) and the executor its chunk calls run on (one per client, which closes it)."""

    pool: PoolBackend
    staging: StagingPool
    chunk_bytes: int
    executor: ChunkExecutor


def pool_call(plan: Plan, option: CcKvOption, a: int = 0, b: int | None = None, deadline: Deadline | None = None) -> PoolCall:
    """Values a..b-1 of `plan` (b None: to the end) as one pool call: their keys, route keys and expected values,
    the call's option and, where given, the job's deadline."""
    if a == 0 and b is None:
        return PoolCall(plan.route_keys, plan.keys, option, deadline, plan.expected, plan.units)
    b = plan.total if b is None else b
    units = None if plan.units is None else plan.units[a:b]
    return PoolCall(plan.route_keys[a:b], plan.keys[a:b], option, deadline, plan.expected.range(a, b), units)


@dataclass(slots=True)
class ReceivedValues:
    """A load's received values (see the module docstring). A value: never changed once built (not a frozen
    dataclass only for the cost of building one, on every load: see `PoolCall`)."""

    buffers: Sequence[Buffer | None]
    expected: ExpectedValues
    checked: ReadCheck = ReadCheck.NONE
    addresses: Sequence[int | None] | None = None

    def __post_init__(self) -> None:
        if len(self.expected.payload_len) != len(self.buffers):
            raise ValueError(f"{len(self.buffers)} values but {len(self.expected.payload_len)} expected")

    def present(self) -> int:
        """How many values, from the first, are there (not checked)."""
        return next((i for i, value in enumerate(self.buffers) if value is None), len(self.buffers))

    def range(self, a: int, b: int) -> ReceivedValues:
        """Values a..b-1 (value 0 of the result is value a of this; all of them: this one)."""
        if a == 0 and b == len(self.buffers):
            return self
        addresses = None if self.addresses is None else self.addresses[a:b]
        return ReceivedValues(self.buffers[a:b], self.expected.range(a, b), self.checked, addresses)

    def verified_prefix(self) -> int:
        """How many values, from the first, are present and exactly the expected ones: those present where the pool
        checked them (`ReadCheck.EXPECTED`), else checked here, header and checksum (`valid_prefix`)."""
        if self.checked is ReadCheck.EXPECTED:
            return self.present()
        return valid_prefix(self.buffers, self.expected)


class SaveJob(abc.ABC):
    """One save: `begin()` takes every byte out of the engine's cache (then the engine may overwrite it),
    `finish()` stores them and returns the pool's outcome (which keys were acknowledged); `abandon()` gives
    everything back when `finish` will never run (idempotent). A job implements `_begin`; `begin` runs it and, when
    it raises (interrupts included), abandons the job before the error goes on, so nothing it took leaks."""

    record: JobRecord

    def begin(self) -> None:
        try:
            self._begin()
        except BaseException:  # interrupts included: nothing leaks
            self.abandon()
            raise

    @abc.abstractmethod
    def _begin(self) -> None:
        """`begin`'s work: take every byte out of the engine's cache (on failure `begin` abandons the job)."""

    @abc.abstractmethod
    def finish(self) -> PoolOutcome: ...

    @abc.abstractmethod
    def abandon(self) -> None: ...


@dataclass(slots=True)
class Loaded:
    """What a load did: `hits`, the values from the first that were verified and written into the cache (nothing
    after them was touched), and the pool's `outcome` (its errors say whether the pool was reachable). Never changed
    once built (slotted, not frozen: see `PoolCall`)."""

    hits: int
    outcome: PoolOutcome


class LoadJob(Protocol):
    """One load: `run()` writes only the verified prefix and says what it did (`Loaded`)."""

    record: JobRecord

    def run(self) -> Loaded: ...


class NothingToMove(SaveJob):
    """The job of a request of no values (a token-form call whose mask asks for no token): it copies nothing and
    contacts no pool; a save stores and a load writes nothing."""

    def __init__(self, record: JobRecord) -> None:
        self.record = record
        record.path = "none"

    def _begin(self) -> None:
        return None

    def finish(self) -> PoolOutcome:
        return PoolOutcome([])

    def abandon(self) -> None:
        return None

    def run(self) -> Loaded:
        return Loaded(0, PoolOutcome([]))


class JobPath(abc.ABC):
    """The path a client's calls on one device take (the embedded one-pass jobs, or staging and the pipelined
    jobs), chosen once per device (`ems.datapath.jobs.job_path`): `save_job` / `load_job` build a call's job on it."""

    def save_job(self, transfer: Transfer, context: JobContext) -> SaveJob:
        """The call's save job (for no values, `NothingToMove`)."""
        return self._save(transfer, context) if transfer.plan.total else NothingToMove(transfer.record)

    def load_job(self, transfer: Transfer, context: JobContext) -> LoadJob:
        """The call's load job (for no values, `NothingToMove`)."""
        return self._load(transfer, context) if transfer.plan.total else NothingToMove(transfer.record)

    @abc.abstractmethod
    def _save(self, transfer: Transfer, context: JobContext) -> SaveJob: ...

    @abc.abstractmethod
    def _load(self, transfer: Transfer, context: JobContext) -> LoadJob: ...

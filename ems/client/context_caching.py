"""`ContextCaching`: the save/load/exists pipeline behind the SDK's calls.

One save: check the arguments (`calls`) → plan keys, values and copies (`planning`) → a `SaveJob` (`jobs`):
gather → encode → send, each stage recorded → `CcResult(consecutive acknowledged blocks, total)`. A load is a
`LoadJob`: receive → verify → scatter, writing only the prefix of values that are present and exactly what the
request expects (header and checksum). On the embedded pool (CPU) both run in one pass over the store's own
buffers; otherwise through staging (see `jobs`). Every finished job's `JobRecord` goes to `self.jobs` (a
`JobLedger`: what metrics read) and, with ENABLE_CC_PROFILING=1, to the `ems.profile` log.

Failure semantics: bad arguments raise `EmsException(EMS_INVALID_ARGUMENT)` before anything moves; a save or load
whose keys partly fail returns the consecutive prefix; one that reached no node raises `EMS_IO_ERROR` (or
`EMS_IO_TIMEOUT`); `exists` never raises for pool failures, it reports 0 hits. A load never writes a block it did not
verify, nor any block after the first miss.

Setup (`ems.client.setup.ClientSetup`, its base): the client's state, `register_kvcache` and the namespace record,
the copy backend and job path chosen on a device's first call, `metrics()`; nothing of it runs during a warm call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import torch

from ems.backends.base import PoolBackend, PoolOutcome
from ems.client.async_calls import AsyncCalls, Pending
from ems.client.setup import ClientSetup
from ems.config import CcConfig
from ems.datapath.arguments import Operation, RawCall
from ems.datapath.calls import Call, bind_and_plan, bind_exists, call_result, consecutive_prefix
from ems.datapath.copier import Copier
from ems.datapath.devices import default_raw_device
from ems.datapath.jobs import JobContext, JobPath, Transfer
from ems.datapath.jobs.lookup import run_lookup
from ems.datapath.planning import Plan
from ems.datapath.tokens import TokenForm
from ems.errors import EmsErrorCode, EmsException
from ems.records import JobKind, JobRecord, Stage
from ems.settings import Settings
from ems.types import CcFuture, CcKvOption, CcResult, KvBufferWrapper, V0Key

if TYPE_CHECKING:
    from typing_extensions import Unpack  # (typing's from Python 3.11 on)

# The argument types of the public call forms (what `calls.bind_call` accepts).
IntList = Sequence[int] | np.ndarray | torch.Tensor  # slot_mapping, offsets
HashList = Sequence[int] | np.ndarray | torch.Tensor  # block hashes: int64 or u64 values
ChunkDescs = Sequence[Sequence[Sequence[int]]]  # chunk_descs[group][block] = (start_slot, length)


def _as_ems_exception(exc: Exception) -> EmsException:
    if isinstance(exc, EmsException):
        return exc
    return EmsException(EmsErrorCode.EMS_INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")


class _EmsErrors:
    """Turn any `Exception` into an `EmsException` (EMS_INTERNAL_ERROR unless it already is one). `KeyboardInterrupt`,
    `SystemExit` and other `BaseException`s pass through unchanged: the caller's process must be able to stop.
    `on_error` (the error counter) runs first for every `Exception`. (A plain class: a generator-based context
    manager costs several µs, and every call runs one or two.)"""

    __slots__ = ("_on_error",)

    def __init__(self, on_error: Callable[[], None] | None = None) -> None:
        self._on_error = on_error

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is None or not isinstance(exc, Exception):
            return
        if self._on_error is not None:
            self._on_error()
        converted = _as_ems_exception(exc)
        if converted is not exc:
            raise converted from exc


class _OpenCalls:
    """The calls running inside one `ContextCaching`: `close()` refuses new ones and returns once none runs, so a call
    racing `Ems.shutdown` from another thread either runs whole (an async call: is submitted, and shutdown waits for
    it) or is refused with an `EmsException`, never half-way into a closed executor or pool. A plain class, as
    `_EmsErrors`: every public call enters it once."""

    __slots__ = ("_count", "_idle", "closed")

    def __init__(self) -> None:
        self._idle = threading.Condition(threading.Lock())
        self._count = 0
        self.closed = False

    def __enter__(self) -> None:
        with self._idle:
            if self.closed:
                raise EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, "this ContextCaching was shut down")
            self._count += 1

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        with self._idle:
            self._count -= 1
            if self._count == 0:
                self._idle.notify_all()

    def close(self) -> None:
        """Refuse new calls; wait for the running ones to return."""
        with self._idle:
            self.closed = True
            self._idle.wait_for(lambda: self._count == 0)


class ContextCaching(ClientSetup):
    """The EMS Context Caching client of one process (get it from `Ems.get_cc()`)."""

    def __init__(self, cc_config: CcConfig, tenant: str | None, pool: PoolBackend, settings: Settings) -> None:
        super().__init__(cc_config, tenant, pool, settings)
        self._calls: _OpenCalls = _OpenCalls()  # the public calls running now (`close` waits for them)
        self._async = AsyncCalls(settings.max_inflight, _EmsErrors(self._metrics.record_error))
        self._metrics.register()

    @property
    def kernel_backend(self) -> str:
        """The copy backend serving the registered cache's device (or the V0 device)."""
        return str(self._backend_for(self._layout.device if self._layout else self._raw_device_now()).describe())

    # ---------------------------------------------------------------- helpers

    def _raw_device_now(self) -> torch.device:
        if self._raw_device is not None:
            return self._raw_device
        return default_raw_device(self._cc_config.device_id, self._layout.device if self._layout else None)

    def _path_for(self, device: torch.device) -> tuple[Copier, JobPath]:
        """The copier and the job path of calls on `device`, chosen on its first call (`ClientSetup._new_path`): a
        call uses them, it does not choose them."""
        path = self._paths.get(device)
        return path if path is not None else self._new_path(device)

    def _bind(self, op: Operation, args: tuple, kwargs: dict) -> tuple[Call, Plan, torch.device]:
        layout = self._layout
        return bind_and_plan(op, args, kwargs, layout, self._v0_namespace, self._v1_namespace, self._raw_device_now)

    @staticmethod
    def _raise_if_unreachable(outcome: PoolOutcome, successes: int) -> None:
        if successes == 0 and outcome.unreachable:
            error = outcome.first_error()
            if error is not None:
                raise EmsException(error.status_code(), f"no pool node could be reached: {error.message()}")

    def _job_context(self) -> JobContext:
        """Where this client's transfers go: its pool, its staging, the chunk size of its settings now and its
        executor."""
        return JobContext(self._pool, self._staging, self._settings.chunk_bytes, self._executor)

    def _job_done(self, record: JobRecord) -> None:
        """A finished job's record goes to the ledger, the one account of each call (`metrics()` reads it)."""
        self.jobs.add(record)

    # ---------------------------------------------------------------- save

    def _begin_save(
        self, args: tuple, kwargs: dict, record: JobRecord | None = None
    ) -> tuple[Callable[[], CcResult], Callable[[], None]]:
        """Check, plan and copy the blocks out of the engine's cache; return (the rest of the save, the way to give
        its buffers back should it never run). `record` (a new one if None) is the save's job record.

        When this returns, every byte the save needs is out of the engine's cache: the engine may overwrite it.
        """
        if record is None:
            record = JobRecord(JobKind.SAVE, profile=self._settings.profiling)
        with record.stage(Stage.PLAN):
            call, plan, device = self._bind(Operation.SAVE, args, kwargs)
            copier, path = self._path_for(device)
        job = path.save_job(Transfer(plan, device, copier, call.option, record), self._job_context())
        with _EmsErrors(self._metrics.record_error):  # e.g. the allocator refusing a buffer: an EmsException
            job.begin()

        def finish() -> CcResult:
            outcome = job.finish()
            successes = consecutive_prefix(outcome.results)
            self._raise_if_unreachable(outcome, successes)
            self._job_done(record.finish(successes, plan.total, plan.expected.payload_bytes()))
            return call_result(call, successes, plan.total)

        return finish, job.abandon

    @overload
    def save(
        self, option: CcKvOption, key_list: Sequence[V0Key], value_list: Sequence[Sequence[KvBufferWrapper]]
    ) -> CcResult: ...

    @overload
    def save(
        self,
        slot_mapping: IntList,
        hashes: HashList,
        offsets: IntList,
        option: CcKvOption | None = None,
        *,
        chain_prefix: HashList | None = None,
    ) -> CcResult: ...

    @overload
    def save(
        self, *, hashes: HashList, chunk_descs: ChunkDescs, option: CcKvOption | None = None, chain_prefix: HashList | None = None
    ) -> CcResult: ...

    @overload
    def save(self, slot_mapping: IntList, *, option: CcKvOption | None = None, **form: Unpack[TokenForm]) -> CcResult: ...

    def save(self, *args: Any, **kwargs: Any) -> CcResult:
        """Save blocks to the pool (V0 `save(option, key_list, value_list)`; V1 `save(slot_mapping, hashes,
        offsets, option=None)`, `save(hashes=..., chunk_descs=..., option=None)` or, the token form,
        `save(slot_mapping, option=None, token_ids=..., mask=...)`: `ems.datapath.tokens`). Blocks until stored.
        The V1 hash forms take this package's `chain_prefix=` (where the blocks sit in their prefix chain:
        placement by units, `ems.datapath.calls`)."""
        with self._calls:
            finish, _ = self._begin_save(args, kwargs)
            with _EmsErrors(self._metrics.record_error):
                return finish()

    @overload
    def async_save(
        self, option: CcKvOption, key_list: Sequence[V0Key], value_list: Sequence[Sequence[KvBufferWrapper]]
    ) -> CcFuture: ...

    @overload
    def async_save(
        self,
        slot_mapping: IntList,
        hashes: HashList,
        offsets: IntList,
        option: CcKvOption | None = None,
        *,
        chain_prefix: HashList | None = None,
    ) -> CcFuture: ...

    @overload
    def async_save(
        self, *, hashes: HashList, chunk_descs: ChunkDescs, option: CcKvOption | None = None, chain_prefix: HashList | None = None
    ) -> CcFuture: ...

    @overload
    def async_save(self, slot_mapping: IntList, *, option: CcKvOption | None = None, **form: Unpack[TokenForm]) -> CcFuture: ...

    def async_save(self, *args: Any, **kwargs: Any) -> CcFuture:
        """Like `save`, but returns a `CcFuture` at once.

        The blocks have been copied out of the engine's cache when this returns, so the engine may reuse or
        overwrite them immediately; the transfer to the pool continues in the background. At most
        `max_inflight` async calls are pending; a further call waits for one to finish (back-pressure).
        Bad arguments raise here, before anything moves. The future's `job` is the call's job record.
        """
        with self._calls:
            return self._async.start(lambda: self._pending_save(args, kwargs))

    def _pending_save(self, args: tuple, kwargs: dict) -> Pending:
        record = JobRecord(JobKind.SAVE, profile=self._settings.profiling)
        finish, abandon = self._begin_save(args, kwargs, record)
        return Pending(finish, record, abandon)

    # ---------------------------------------------------------------- load

    def _load(self, call: Call, plan: Plan, device: torch.device, record: JobRecord) -> CcResult:
        copier, path = self._path_for(device)
        job = path.load_job(Transfer(plan, device, copier, call.option, record), self._job_context())
        loaded = job.run()
        self._raise_if_unreachable(loaded.outcome, loaded.hits)
        if not self._namespaces.settled and not isinstance(call, RawCall):  # (settled: one attribute test per call)
            self._namespaces.observe(loaded.hits)
        self._job_done(record.finish(loaded.hits, plan.total, plan.expected.payload_bytes(0, loaded.hits)))
        return call_result(call, loaded.hits, plan.total)

    def _bind_load(self, args: tuple, kwargs: dict) -> tuple[Call, Plan, torch.device, JobRecord]:
        record = JobRecord(JobKind.LOAD, profile=self._settings.profiling)
        with record.stage(Stage.PLAN):
            call, plan, device = self._bind(Operation.LOAD, args, kwargs)
        return call, plan, device, record

    @overload
    def load(
        self, option: CcKvOption, key_list: Sequence[V0Key], value_list: Sequence[Sequence[KvBufferWrapper]]
    ) -> CcResult: ...

    @overload
    def load(
        self,
        slot_mapping: IntList,
        hashes: HashList,
        offsets: IntList,
        option: CcKvOption | None = None,
        *,
        chain_prefix: HashList | None = None,
    ) -> CcResult: ...

    @overload
    def load(
        self, *, hashes: HashList, chunk_descs: ChunkDescs, option: CcKvOption | None = None, chain_prefix: HashList | None = None
    ) -> CcResult: ...

    @overload
    def load(self, slot_mapping: IntList, *, option: CcKvOption | None = None, **form: Unpack[TokenForm]) -> CcResult: ...

    def load(self, *args: Any, **kwargs: Any) -> CcResult:
        """Load blocks from the pool into the places the arguments name (the same four forms as `save`).

        `success` is the number of blocks (the token form: tokens), from the first, that were found and verified:
        exactly those are written; nothing after the first miss is touched."""
        with self._calls:
            call, plan, device, record = self._bind_load(args, kwargs)
            with _EmsErrors(self._metrics.record_error):
                return self._load(call, plan, device, record)

    @overload
    def async_load(
        self, option: CcKvOption, key_list: Sequence[V0Key], value_list: Sequence[Sequence[KvBufferWrapper]]
    ) -> CcFuture: ...

    @overload
    def async_load(
        self,
        slot_mapping: IntList,
        hashes: HashList,
        offsets: IntList,
        option: CcKvOption | None = None,
        *,
        chain_prefix: HashList | None = None,
    ) -> CcFuture: ...

    @overload
    def async_load(
        self, *, hashes: HashList, chunk_descs: ChunkDescs, option: CcKvOption | None = None, chain_prefix: HashList | None = None
    ) -> CcFuture: ...

    @overload
    def async_load(self, slot_mapping: IntList, *, option: CcKvOption | None = None, **form: Unpack[TokenForm]) -> CcFuture: ...

    def async_load(self, *args: Any, **kwargs: Any) -> CcFuture:
        """Like `load`, but returns a `CcFuture` at once. The engine must not use the named slots or buffers until
        the future is done. Bad arguments raise here. The future's `job` is the call's job record."""
        with self._calls:
            return self._async.start(lambda: self._pending_load(args, kwargs))

    def _pending_load(self, args: tuple, kwargs: dict) -> Pending:
        call, plan, device, record = self._bind_load(args, kwargs)
        return Pending(lambda: self._load(call, plan, device, record), record)

    # ---------------------------------------------------------------- futures (`ems.client.async_calls.AsyncCalls`)

    def is_ready(self, future: CcFuture) -> bool:
        """Whether an async call has finished; never blocks."""
        return self._async.ready(future)

    def get_result(self, future: CcFuture) -> CcResult:
        """The result of an async call, waiting for it; raises what the call raised."""
        return self._async.result(future)

    # ---------------------------------------------------------------- exists

    def exists(self, hashes: HashList | Sequence[V0Key], option: CcKvOption | None = None, **kwargs: Any) -> CcResult:
        """How many of `hashes` (V1 block hashes, or V0 keys: PrimaryKey or str), from the first, the pool holds.

        A pool failure or timeout reports 0 hits (the engine then recomputes) instead of raising. This package's
        additions, `lease_ms=N` and `pin=True` (keep what is reported from eviction), and `chain_prefix=...` (V1: the
        blocks' chain position, as for save and load: `ems.datapath.calls`): `ems.datapath.jobs.lookup`."""
        with self._calls:
            call = bind_exists(hashes, option, kwargs)
            v1_namespace = self._v1_namespace if self._layout is not None else None
            outcome = run_lookup(self._pool, call, self._v0_namespace, v1_namespace)
            if not outcome.pool_raised:  # (a pool that raised answered nothing: not counted)
                self._metrics.record_exists(outcome.result.success, outcome.result.total)
            if not self._namespaces.settled and not call.is_v0:  # a V1 lookup (V0 keys are the engine's own: not observed)
                self._namespaces.observe(outcome.result.success)
            return outcome.result

    # ---------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Refuse new calls, wait for the running ones and for pending async calls, then release threads and staging
        buffers."""
        self._calls.close()
        self._async.close()
        self._executor.close()
        self._staging.clear()
        self._metrics.unregister()


ContextCache_v1 = ContextCaching  # the EMS SDK's name of its V1 client: one type, two names

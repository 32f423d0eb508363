"""How a client's public calls run, apart from what they move: errors as `EmsException` (`EmsErrors`), the calls
open now (`OpenCalls`: what closing waits for) and the async calls (`AsyncCalls`: bounded in flight, run on the
client's threads, answered as `CcFuture`s).

Contract:
* `EmsErrors`: any `Exception` leaving its block becomes an `EmsException` (EMS_INTERNAL_ERROR unless it already is
  one), after `on_error` (the error counter); other `BaseException`s (interrupts, exits) pass through unchanged.
* `OpenCalls`: `close()` refuses new calls (`EmsException`) and returns once none runs, so a call racing a shutdown
  runs whole or is refused, never half-way into a closed executor or pool.
* `AsyncCalls.start`: at most `max_inflight` async calls pending at once (a further call waits for one to finish:
  back-pressure); a call that fails before it is submitted gives back its slot (and what its job holds: `abandon`),
  one that is submitted gives it back when it finishes, whatever happened. `close()` waits for the pending ones.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ems.datapath.records import JobRecord
from ems.errors import EmsErrorCode, EmsException
from ems.types import CcFuture, CcResult


def _as_ems_exception(exc: Exception) -> EmsException:
    if isinstance(exc, EmsException):
        return exc
    return EmsException(EmsErrorCode.EMS_INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")


class EmsErrors:
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


class OpenCalls:
    """The calls running inside one `ContextCaching`: `close()` refuses new ones and returns once none runs, so a call
    racing `Ems.shutdown` from another thread either runs whole (an async call: is submitted, and shutdown waits for
    it) or is refused with an `EmsException`, never half-way into a closed executor or pool. A plain class, as
    `EmsErrors`: every public call enters it once."""

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


def _nothing_to_give_back() -> None:
    return None


@dataclass(frozen=True)
class Pending:
    """An async call ready to be submitted: the rest of it (`run`), its job record (the future's `job`) and the way to
    give back what its job holds should it never run (`abandon`)."""

    run: Callable[[], CcResult]
    record: JobRecord
    abandon: Callable[[], None] = _nothing_to_give_back


class AsyncCalls:
    """A client's async calls: `max_inflight` slots and the threads they run on; see the module docstring."""

    def __init__(self, max_inflight: int, on_error: Callable[[], None]) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="ems-cc")
        self._inflight = threading.BoundedSemaphore(max_inflight)
        self._on_error = on_error

    def start(self, begin: Callable[[], Pending]) -> CcFuture:
        """Take a slot (waiting for one), run `begin` (the call's checks and what must happen before it returns: a
        save's copy out of the cache), then submit the rest; the slot is given back on every path."""
        self._inflight.acquire()
        try:
            pending = begin()
        except BaseException:
            self._inflight.release()
            raise
        try:
            return CcFuture(self._executor.submit(self._run, pending.run), pending.record)
        except BaseException:  # never submitted: give back what the job held
            pending.abandon()
            self._inflight.release()
            raise

    def _run(self, call: Callable[[], CcResult]) -> CcResult:
        try:
            with EmsErrors(self._on_error):
                return call()
        finally:
            self._inflight.release()

    @staticmethod
    def ready(future: CcFuture) -> bool:
        """Whether an async call has finished; never blocks."""
        return _checked(future).done()

    @staticmethod
    def result(future: CcFuture) -> CcResult:
        """The result of an async call, waiting for it; raises what the call raised."""
        return _checked(future).result()

    def free_slots(self) -> int:
        """How many async calls could start now without waiting (a moment's count: for checks, not for decisions)."""
        taken = 0
        while self._inflight.acquire(blocking=False):
            taken += 1
        for _ in range(taken):
            self._inflight.release()
        return taken

    def close(self) -> None:
        """Wait for the pending calls, then stop the threads."""
        self._executor.shutdown(wait=True)


def _checked(future: object) -> CcFuture:
    if not isinstance(future, CcFuture):
        raise EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, f"future must be a CcFuture, got {type(future).__name__}")
    return future

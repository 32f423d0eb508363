"""A client's async calls (`AsyncCalls`): bounded in flight, run on the client's threads, answered as `CcFuture`s
(`ContextCaching.async_save` / `async_load`, `is_ready`, `get_result`).

Contract:
* `AsyncCalls.start`: at most `max_inflight` async calls pending at once (a further call waits for one to finish:
  back-pressure); a call that fails before it is submitted gives back its slot (and what its job holds: `abandon`),
  one that is submitted gives it back when it finishes, whatever happened. A submitted call runs inside `errors`
  (the client's guard: an `Exception` leaves it as an `EmsException`). `close()` waits for the pending ones.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from ems.errors import EmsErrorCode, EmsException
from ems.records import JobRecord
from ems.types import CcFuture, CcResult


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

    def __init__(self, max_inflight: int, errors: AbstractContextManager[None]) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="ems-cc")
        self._inflight = threading.BoundedSemaphore(max_inflight)
        self._errors = errors  # (stateless: one guard serves every call, on any thread)

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
            with self._errors:
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

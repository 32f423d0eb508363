"""Daemon threads that run the Mooncake client's calls, which may hang (the binding has no timeouts: a lost master
stalls a call for seconds, `setup` without a master for more than a minute).

Contract (`Workers`):
* `call(fn, deadline, what)` waits for `fn` at most until `deadline`: its result, or `TransportError(EMS_IO_TIMEOUT)`.
  A call not started by then is never started; one still running goes on in its thread (holding what `fn` holds, so
  the memory its closure names is never freed under it) and is reported as timed out.
* `submit(fn)` starts a call without waiting (a `Future`); the threads start with the first call.
* `in_flight` counts calls queued or running; `when_idle(action)` runs `action` now if none is, else once the last
  one returns (on that call's thread): what a running call may touch is let go only then.
* Daemon threads: a hung call never keeps the process from exiting. `close` stops the threads once their calls end.
* Thread-safe: `_lock` guards `in_flight`, the idle actions and the start of the threads.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ems.errors import EmsErrorCode
from ems.records import Deadline
from ems.transport.base import TransportError

R = TypeVar("R")


class Workers:
    """Threads for calls that may hang; see the module docstring."""

    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        self._lock = threading.Lock()
        self._started = False
        self.in_flight = 0  # calls running now (read under `_lock`)
        self._idle: list[Callable[[], None]] = []  # run once when no call is in flight

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as error:  # delivered to the waiting caller
                future.set_exception(error)
            finally:
                del item, fn  # drop the call's buffers before saying it is over
                self._finished()

    def _finished(self) -> None:
        with self._lock:
            self.in_flight -= 1
            todo, self._idle = (self._idle, []) if self.in_flight == 0 else ([], self._idle)
        for action in todo:
            action()

    def when_idle(self, action: Callable[[], None]) -> None:
        """Run `action` now if no call is in flight, else once none is."""
        with self._lock:
            if self.in_flight:
                self._idle.append(action)
                return
        action()

    def submit(self, fn: Callable[[], R]) -> concurrent.futures.Future[R]:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self._started:
                for thread in self._threads:
                    thread.start()
                self._started = True
            self.in_flight += 1
        future.add_done_callback(lambda f: self._finished() if f.cancelled() else None)
        self._queue.put((future, fn))
        return future

    def call(self, fn: Callable[[], R], deadline: Deadline, what: str) -> R:
        """`fn()`'s result, or `TransportError(EMS_IO_TIMEOUT)` when it has not returned by `deadline`."""
        future = self.submit(fn)
        try:
            return future.result(timeout=deadline.left())
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TransportError(EmsErrorCode.EMS_IO_TIMEOUT, f"mooncake: {what} did not return in time") from None

    def close(self) -> None:
        with self._lock:
            started = self._started
        if started:
            for _ in self._threads:
                self._queue.put(None)

"""A client's UCX requests, completed by the thread that waits for them: no event loop, no hop per completion.

Contract:
* `DirectRuntime.get()` is the process's client UCX worker (created on first use: `ucx.client_worker`): ucxx's C++
  progress thread moves every byte without the GIL, and requests carry ucxx's completion notifications (its "Python
  futures"), which nothing awaits: they only wake a waiting thread.
* `Connection.send(buffer, tag)` / `recv(buffer, tag)` post (submit, see below) one tagged message now and return a `Posted` (the
  request and the buffer UCX uses, kept alive together). `tag` None is the connection's base tag, else a request id
  (the protocol's tag layout, `protocol.request_tag`). Any thread may post, concurrently with others. A
  connection is made by `ucx.connector.connect` (ucxx's peer-info exchange).
* `DirectRuntime.wait(posted, deadline)` blocks the calling thread until every request in `posted` is complete and
  raises the first one's UCX error, or raises `WaitTimeout` at `deadline`. A request given up on (its caller timed
  out or failed) must be handed to `bury`: it and its buffer are kept until UCX completes it (the endpoint is
  aborted, which completes it soon), so UCX never writes into freed memory.
* `Connection.abort(ending)` closes the endpoint without waiting for the peer (its requests in flight fail) and keeps
  why (`Ending`: the first reason given), so a call that fails on it can tell a cancellation its owner chose from a
  failure the wire reported.
* `Exchange(conn, deadline)`: one call's posts and waits on a connection under the call's deadline; `release()`
  buries whatever of them UCX has not completed (a call that failed or timed out).

How a wait works (why this design, the figures in perf/RESULTS.md "Issue 16: the client's progress model"):
* The waiting threads take turns as the *leader*: the leader sleeps in ucxx's notifier wait
  (`wait_request_notifier`, C++, GIL released) until UCX completes some request, takes the notifications
  (`run_request_notifier`), and releases every waiting thread whose requests are now all complete (a lock each).
  When its own requests are done it hands the lead to a thread still waiting. A lone synchronous call is always
  its own leader: a batch of completions costs one wake-up of the calling thread itself (no other thread between
  UCX and the caller), and a call posts everything it can up front (all of a GET's segment receives at once), so
  the bytes of a bulk transfer never wait for the caller: the wake-ups while it runs (ucxx notifies per request,
  batched when they come close together) only look, and the call goes on at the one after its last completion.
  Many calls in flight (async saves on the pool's executor threads) are served by one leader; the others sleep on
  their locks: no thread per request, no spinning.
* Alternatives measured on this 2-core host and not taken: ucxx's asyncio client (UCX progress thread, notifier
  thread, event loop, then the caller: three GIL hand-overs per completion, each up to the interpreter's 5 ms
  switch interval beside a busy Python thread); the calling thread progressing the worker itself (fast for one
  small request, but bytes then move only while the caller holds the GIL: bulk loads fell several-fold); polling
  `completed` with short sleeps (slower small calls, same bulk figures).
* ucxx creates each request's notification object as an `asyncio.Future()` of the calling thread's running event
  loop. For the duration of a call, a private loop is the thread's running loop (`futures_context`; a thread's own
  loop, which cannot run while the thread is in the call, is restored after): that loop never runs, no callback is
  ever added to those futures, so setting them from the leader thread is safe, and its exception handler keeps the
  failures of requests (reported to their callers by `wait`) out of the log.
* Requests are kept referenced by Python until UCX completes them, so ucxx's progress thread never drops the last
  reference of a notification object (which would make it take the GIL).
* Submission (`ucx.config.Submission`, EMS_UCX_CLIENT_SUBMIT): how a post reaches UCX, DELAYED (the default) or
  DIRECT, and why: `ucx.client_worker`, which makes the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ems.transport import protocol
from ems.transport.base import Ending
from ems.transport.ucx import config as ucx_config
from ems.transport.ucx.client_worker import start_worker, ucxx_names

PROGRESS_EPOLL_MS = 100  # the C++ progress thread's idle wake-up period (UCX keepalive, peer-failure detection)
LEAD_PERIOD_S = 0.05  # a leader re-checks its deadline and the waits at least this often
ABORT_PERIOD_NS = 10**8  # how long aborting an endpoint may wait for UCX (never long: the peer may hang)
_GRAVEYARD_LIMIT = 1 << 16  # requests given up on and kept; past it the oldest are let go (never grows unbounded)
# DIRECT: a receive posted of at most this many bytes signals no one: it completes from the bytes' arrival (which wakes
# the progress thread). Past it (UCX's RNDV_THRESH is 8K on TCP) it may match a rendezvous already announced, whose
# answer UCX sends at post time but may leave queued for progress; a reply head (8 KiB) is always posted before its
# request goes out, so it never matches one already announced
SMALL_RECV_BYTES = 8192


class WaitTimeout(TimeoutError):
    """A wait reached its deadline before UCX completed its requests."""


class Posted:
    """One posted UCX request and the buffer it sends from or receives into (kept alive together)."""

    __slots__ = ("array", "buffer", "request")

    def __init__(self, request: Any, array: Any, buffer: Any) -> None:
        self.request = request
        self.array = array
        self.buffer = buffer


_futures_loop: asyncio.AbstractEventLoop | None = None
_futures_loop_lock = threading.Lock()


def _quiet(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The private loop's exception handler: a request that failed (an aborted endpoint cancels every request on it)
    is reported to its caller by `DirectRuntime.wait`, never through its notification object, whose unretrieved
    exception asyncio would otherwise log when it is collected."""


@contextlib.contextmanager
def futures_context() -> Iterator[None]:
    """Within it, ucxx creates its notification objects in this thread, on a private loop that never runs (see the
    module docstring); the thread's own running loop, if any, is restored after."""
    global _futures_loop
    with _futures_loop_lock:
        if _futures_loop is None:
            _futures_loop = asyncio.new_event_loop()
            _futures_loop.set_exception_handler(_quiet)
    previous = asyncio._get_running_loop()
    asyncio._set_running_loop(_futures_loop)
    try:
        yield
    finally:
        asyncio._set_running_loop(previous)


class _State(enum.Enum):
    """Where one thread's wait stands."""

    WAITING = "waiting"  # asleep on its lock (a follower), or not yet listed
    LEAD = "lead"  # it watches ucxx's notifier for every waiting thread
    DONE = "done"  # its requests are all complete


class _Wait:
    """One thread's wait for a set of requests; its lock is released (once) when it is DONE or asked to LEAD."""

    __slots__ = ("lock", "requests", "state")

    def __init__(self, requests: list[Any]) -> None:
        self.requests = requests
        self.state = _State.WAITING
        self.lock = threading.Lock()
        self.lock.acquire()

    def complete(self) -> bool:
        return all(r.completed for r in self.requests)


class DirectRuntime:
    """The process's client UCX worker and the waits on it; see the module docstring."""

    _instance: DirectRuntime | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self.submission = ucx_config.settings().client_submit
        self.context, self.worker, self._signal = start_worker(self.submission)
        with futures_context():
            self.worker.populate_python_futures_pool()
        self.worker.start_progress_thread(polling_mode=False, epoll_timeout=PROGRESS_EPOLL_MS)
        self._mutex = threading.Lock()  # guards the three below
        self._waits: list[_Wait] = []
        self._leader: _Wait | None = None
        self._graveyard: list[Posted] = []
        self.live: set[Connection] = set()
        self._stopped = False
        register = getattr(threading, "_register_atexit", None)
        if register is not None:  # before the interpreter joins threads and tears objects down
            register(self.shutdown)

    @classmethod
    def get(cls) -> DirectRuntime:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = DirectRuntime()
            return cls._instance

    def shutdown(self) -> None:
        """Abort every connection and stop UCX's progress thread (at exit)."""
        with self._mutex:
            if self._stopped:
                return
            self._stopped = True
            live = list(self.live)
            self.live.clear()
        for conn in live:
            conn.abort(Ending.CANCELLED)
        try:
            self.worker.stop_progress_thread()
            self.worker.clear_python_futures_pool()  # here, with the GIL, not at the worker's destruction
        except Exception:  # already stopped
            pass

    # ---- waits ----

    def wait(self, posted: Sequence[Posted], deadline: float) -> None:
        """Block until every request of `posted` is complete (then raise the first UCX error among them), or raise
        WaitTimeout at `deadline`; see the module docstring."""
        requests = [p.request for p in posted]
        if not self._wait(requests, deadline):
            raise WaitTimeout()
        for request in requests:
            request.check_error()

    def _wait(self, requests: list[Any], deadline: float) -> bool:
        wait = _Wait(requests)
        if wait.complete():
            return True
        with self._mutex:
            self._waits.append(wait)
            if self._leader is None:
                self._leader = wait
                wait.state = _State.LEAD
        try:
            # a completion whose notification an earlier leader took before this wait was listed is seen here
            if wait.complete():
                return True
            while True:
                if wait.state == _State.LEAD:
                    return self._lead(wait, deadline)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not wait.lock.acquire(timeout=remaining):
                    return wait.complete()
                if wait.state == _State.DONE:
                    return True
        finally:
            self._leave(wait)

    def _lead(self, wait: _Wait, deadline: float) -> bool:
        worker = self.worker
        while True:
            if wait.state == _State.DONE or wait.complete():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            worker.wait_request_notifier(period_ns=int(min(remaining, LEAD_PERIOD_S) * 1e9))
            worker.run_request_notifier()
            with futures_context():
                worker.populate_python_futures_pool()
            self._release_done()

    def _release_done(self) -> None:
        """Release every waiting thread whose requests are all complete; forget completed buried requests."""
        with self._mutex:
            for other in self._waits:
                if other.state != _State.DONE and other.complete():
                    lead = other.state == _State.LEAD
                    other.state = _State.DONE
                    if not lead:
                        other.lock.release()
            if self._graveyard:
                self._graveyard = [p for p in self._graveyard if not p.request.completed]

    def _leave(self, wait: _Wait) -> None:
        """`wait` is over: unlist it, and when it led, hand the lead to a thread still waiting."""
        with self._mutex:
            self._waits.remove(wait)
            if self._leader is not wait:
                return
            self._leader = None
            for other in self._waits:
                if other.state == _State.WAITING:
                    self._leader = other
                    other.state = _State.LEAD
                    other.lock.release()
                    return

    def signal(self) -> None:
        """Wake the progress thread (DIRECT submission: a request posted from another thread that UCX did not finish
        at once needs the worker progressed, and the progress thread may be asleep in epoll)."""
        if self._signal is not None:
            self._signal()

    def bury(self, posted: Sequence[Posted]) -> None:
        """Keep `posted` (given up on) until UCX completes them; see the module docstring."""
        with self._mutex:
            self._graveyard.extend(p for p in posted if not p.request.completed)
            if len(self._graveyard) > _GRAVEYARD_LIMIT:
                self._graveyard = [p for p in self._graveyard if not p.request.completed]
                del self._graveyard[: max(0, len(self._graveyard) - _GRAVEYARD_LIMIT)]


class Connection:
    """One endpoint to a node, with the tags of ucxx's peer-info exchange; see the module docstring."""

    def __init__(self, runtime: DirectRuntime, endpoint: Any, send_tag: int, recv_tag: int) -> None:
        self.runtime = runtime
        self.endpoint: Any = endpoint
        self.send_tag = send_tag
        self.recv_tag = recv_tag
        self.ending: Ending | None = None  # set (once) when it is aborted
        names = ucxx_names()
        self._array, self._tag, self._mask = names["Array"], names["Tag"], names["mask"]

    def _live(self) -> Any:
        endpoint = self.endpoint
        if endpoint is None:
            raise ConnectionError("the connection was closed")
        endpoint.raise_on_error()
        return endpoint

    def send(self, buffer: Any, tag: int | None = None) -> Posted:
        """Post one tagged send of `buffer` now."""
        array = self._array(buffer)
        request = self._live().tag_send(array, self._tag(protocol.request_tag(self.send_tag, tag)))
        if not request.completed:  # DIRECT: the rest of it needs progress (DELAYED: a no-op)
            self.runtime.signal()
        return Posted(request, array, buffer)

    def recv(self, buffer: Any, tag: int | None = None) -> Posted:
        """Post one tagged receive into `buffer` (writable) now."""
        array = self._array(buffer)
        request = self._live().tag_recv(array, self._tag(protocol.request_tag(self.recv_tag, tag)), self._mask)
        # DIRECT: a small receive only waits for the peer's bytes (their arrival wakes the progress thread); a large
        # one may have matched a rendezvous already announced, whose reply UCX then has to progress
        if array.nbytes > SMALL_RECV_BYTES and not request.completed:
            self.runtime.signal()
        return Posted(request, array, buffer)

    def abort(self, ending: Ending) -> None:
        """Close the endpoint now, without waiting for the peer; its requests in flight fail. `ending` (why) is kept
        unless it was aborted before: it is set before the endpoint closes, so a request it fails sees it."""
        if self.ending is None:
            self.ending = ending
        endpoint, self.endpoint = self.endpoint, None
        if endpoint is None:
            return
        try:
            endpoint.close_blocking(period=ABORT_PERIOD_NS, max_attempts=1)
        except Exception:  # already failed or closed
            pass


class Exchange:
    """One call's traffic on a connection, under the call's deadline: what it posts is recorded, and `release` (at
    the end of the call, however it ended) hands what UCX has not completed to `DirectRuntime.bury`."""

    __slots__ = ("conn", "deadline", "posted")

    def __init__(self, conn: Connection, deadline: float) -> None:
        self.conn = conn
        self.deadline = deadline
        self.posted: list[Posted] = []

    def send(self, buffer: Any, tag: int | None = None) -> Posted:
        posted = self.conn.send(buffer, tag)
        self.posted.append(posted)
        return posted

    def recv(self, buffer: Any, tag: int | None = None) -> Posted:
        posted = self.conn.recv(buffer, tag)
        self.posted.append(posted)
        return posted

    def wait(self, posted: Sequence[Posted]) -> None:
        """`DirectRuntime.wait` under the call's deadline."""
        if posted:
            self.conn.runtime.wait(posted, self.deadline)

    def release(self) -> None:
        if self.posted:
            self.conn.runtime.bury(self.posted)
            self.posted = []

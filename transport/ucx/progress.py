"""UCX progress on the event loop thread, and the tagged send/receive every frame of the transport goes through.

Contract:
* `install(worker, loop)` (called by `ucx.config.init_ucx` in progress mode "loop", a node's default) makes `loop` drive
  `worker`: the worker's epoll descriptor is watched by the loop (`add_reader`); on each event, and right after
  anything posts a request, the loop thread progresses the worker until it is idle, re-arms it, and completes the
  asyncio future of every request that finished. A periodic progress (`TICK_S`) keeps UCX's keepalive and error
  detection going while idle. Nothing spins: an idle process sleeps in the loop's `select`. A `sweeper` (a node's
  `ConnectionTable.sweep_front`) runs every SWEEP_EVERY progress passes of one progress call and once after it: a
  flood of messages nobody will receive is discarded while it arrives, not after (UCX buffers them meanwhile).
* `send(ep, buffer, tag)` / `recv(ep, buffer, tag)` post one tagged message on a ucxx `Endpoint` now (before the
  caller awaits anything) and return a future that ends when UCX completes it (raising UCX's error when it fails:
  a peer that died, an aborted endpoint, a message longer than the buffer). `tag` None is the endpoint's base tag,
  else a request id, and the message travels on `protocol.request_tag(base, tag)` (the protocol's tag layout: every tag of a
  connection shares the high 32 bits of its base tag). The buffer is kept alive until UCX has finished with it,
  even when the caller stops waiting. On a loop without a driver (progress mode "thread"), they are ucxx's
  `Endpoint.send/recv` with that tag, started as tasks.
* `wait(request)`: the same for a request posted by other means (stream sends of the connection exchange).
* Every call must come from the loop thread (the worker is single-threaded in this mode).

Why (measured on this 2-core host, perf/RESULTS.md "Per-call cost over UCX"): with ucxx's "thread" progress mode,
every completion goes through three threads (UCX's progress thread, ucxx's notifier thread, the event loop) and a
Task; a bare 8-byte UCXX round trip took ~550-600 us. ucxx's own "blocking"/"polling" modes avoid the threads but
await each request by polling with `asyncio.sleep(0)`: any process with a posted receive (a pool node always has one)
burns a core. Here the completions are found by the progress call that produced them, so a round trip is one
loop wake-up per side (~140 us in-loop on the same host). The price: bytes move only while the loop thread holds
the GIL, so a process with a busy Python thread starves it (`ucx.config` keeps clients on "thread" for that).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

from ems.transport import protocol

log = logging.getLogger("ems.transport")

TICK_S = 0.1  # idle progress period (keepalive, peer-failure detection, a missed wake-up never stalls longer)
SWEEP_EVERY = 8  # progress passes between two calls of the sweeper inside one progress call

_drivers: dict[asyncio.AbstractEventLoop, LoopProgress] = {}


class LoopProgress:
    """Drives one UCX worker from one event loop; see the module docstring."""

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.worker = worker
        self.event_loop = loop
        self._waiting: dict[Any, tuple[asyncio.Future, Any]] = {}  # request -> (its future, the buffer UCX uses)
        self._scheduled = False
        self._closed = False
        self.sweeper: Callable[[], None] | None = None
        worker.init_blocking_progress_mode()
        self._fd = worker.epoll_file_descriptor
        loop.add_reader(self._fd, self.progress)
        self._timer = loop.call_later(TICK_S, self._tick)

    # ucxx keeps its progress objects in a dict keyed by loop and compares them by loop
    def __hash__(self) -> int:
        return hash(self.event_loop)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoopProgress) and other.event_loop is self.event_loop

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._timer.cancel()
        try:
            self.event_loop.remove_reader(self._fd)
        except Exception:  # the loop is closed already
            pass

    def _tick(self) -> None:
        if self._closed:
            return
        self.progress()
        self._timer = self.event_loop.call_later(TICK_S, self._tick)

    def kick(self) -> None:
        """Progress soon (once, however many requests are posted before it runs)."""
        if not self._scheduled:
            self._scheduled = True
            self.event_loop.call_soon(self.progress)

    def progress(self) -> None:
        """Progress until UCX is idle, complete the finished requests' futures, re-arm the epoll descriptor."""
        self._scheduled = False
        if self._closed:
            return
        worker = self.worker
        sweeper = self.sweeper
        while True:
            passes = 0
            while worker.progress_once():
                passes += 1
                if sweeper is not None and passes % SWEEP_EVERY == 0:
                    sweeper()
            if sweeper is not None:
                sweeper()
            if self._waiting:
                self._complete()
            if worker.arm():
                return

    def _complete(self) -> None:
        done = [r for r in self._waiting if r.completed]
        for request in done:
            future, _ = self._waiting.pop(request)
            _settle(request, future)

    def wait(self, request: Any, keep: Any = None) -> asyncio.Future[None]:
        """A future that ends when `request` does; `keep` (its buffer) stays referenced until then."""
        future = self.event_loop.create_future()
        if request.completed:
            _settle(request, future)
            return future
        self._waiting[request] = (future, keep)
        self.kick()
        return future


def _settle(request: Any, future: asyncio.Future) -> None:
    if future.done():  # cancelled by its waiter: UCX has finished with the buffer all the same
        return
    try:
        request.check_error()
    except Exception as error:
        future.set_exception(error)
        return
    future.set_result(None)


def install(worker: Any, loop: asyncio.AbstractEventLoop) -> LoopProgress:
    """Make `loop` drive `worker` (once per loop); ucxx's own progress for that loop is then never started."""
    from ucxx._lib_async import application_context

    driver = _drivers.get(loop)
    if driver is None:
        driver = LoopProgress(worker, loop)
        _drivers[loop] = driver
        application_context.ProgressTasks[loop] = driver
    return driver


def driver() -> LoopProgress | None:
    """The driver of the running loop, or None (ucxx's own progress)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return _drivers.get(loop)


_ucxx: dict[str, Any] = {}  # ucxx names, imported on first use (ucx.config must set UCX's environment first)


def _names() -> dict[str, Any]:
    if not _ucxx:
        from ucxx._lib.arr import Array
        from ucxx._lib.libucxx import UCXXTag, UCXXTagMaskFull
        from ucxx._lib_async.utils import hash64bits
        from ucxx.exceptions import UCXCloseError

        _ucxx.update(Array=Array, Tag=UCXXTag, mask=UCXXTagMaskFull, hash=hash64bits, closed=UCXCloseError)
    return _ucxx


def kick() -> None:
    """Progress the running loop's worker soon (after an endpoint was aborted: its requests' failures are delivered
    at once instead of at the next tick); nothing without a driver."""
    d = driver()
    if d is not None:
        d.kick()


def _tag(ep: Any, kind: str, tag: int | None) -> Any:
    return _names()["Tag"](protocol.request_tag(ep._tags[kind], tag))


def _endpoint(ep: Any) -> Any:
    """The live ucxx C++ endpoint of `ep`; ucxx's own errors when it is closed or failed."""
    inner = ep._ep
    if inner is None:
        raise _names()["closed"]("Endpoint closed")
    inner.raise_on_error()
    return inner


def send(ep: Any, buffer: Any, tag: int | None = None) -> asyncio.Future[Any]:
    """Post one tagged send; see the module docstring."""
    d = driver()
    if d is None:
        wire_tag = protocol.request_tag(ep._tags["msg_send"], tag)
        return cast("asyncio.Future[Any]", asyncio.ensure_future(ep.send(buffer, tag=wire_tag, force_tag=True)))
    arr = _names()["Array"](buffer)
    return d.wait(_endpoint(ep).tag_send(arr, _tag(ep, "msg_send", tag)), arr)


def recv(ep: Any, buffer: Any, tag: int | None = None) -> asyncio.Future[Any]:
    """Post one tagged receive into `buffer` (writable); see the module docstring."""
    d = driver()
    if d is None:
        wire_tag = protocol.request_tag(ep._tags["msg_recv"], tag)
        return cast("asyncio.Future[Any]", asyncio.ensure_future(ep.recv(buffer, tag=wire_tag, force_tag=True)))
    names = _names()
    arr = names["Array"](buffer)
    return d.wait(_endpoint(ep).tag_recv(arr, _tag(ep, "msg_recv", tag), names["mask"]), arr)


def wait(request: Any, keep: Any = None) -> asyncio.Future[Any]:
    """Await a UCX request posted directly on a ucxx C++ object (driver mode) or through ucxx (`request.wait()`)."""
    d = driver()
    if d is None:
        return cast("asyncio.Future[Any]", asyncio.ensure_future(request.wait()))
    return d.wait(request, keep)

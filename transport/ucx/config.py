"""The UCX settings both sides use, applied once per process before `ucxx` starts.

Contract: `init_ucx()` sets the UCX environment defaults below (a value already in the environment wins, so an
operator can override any of them), then calls `ucxx.init` with the chosen progress mode, once per process. It
must run inside the event loop thread that will drive UCX (the progress mode hooks into that loop), and before
anything else imports `ucxx`: UCX reads its options from the environment when the library loads and when its
context is created, so the defaults are written into `os.environ` there, when the transport is first opened, never
at import. This package's own knobs (`UcxSettings`: EMS_UCX_PROGRESS_MODE, EMS_UCX_PYTHON_FUTURE, EMS_UCX_NOTIFIER,
EMS_UCX_CLIENT_SUBMIT) are read once: `configure()` at `Ems.init` or at a pool node's start, else from the environment
at `init_ucx` or a pool client's first connection (`settings()`).

Why these values (measured on loopback, see perf/RESULTS.md "Pool nodes" and "Per-call cost over UCX"):
* progress mode of the asyncio side (a pool node; the test suites' raw sessions and scripted nodes, `UcxRuntime`
  of tests/ucx_loop.py), by role unless EMS_UCX_PROGRESS_MODE sets it for every such process: "loop" for a process
  that serves UCX (a pool node: `init_ucx()`), "thread" for `UcxRuntime` (`init_ucx(CLIENT_PROGRESS_MODE)`). Pool
  clients (`UcxNode`) use neither: they complete their own requests (`ucx.direct`, its own UCX worker; the
  environment defaults below apply to it too).
  "loop": UCX is progressed on the event loop thread by `ucx.progress` (ucxx's "blocking" mode, minus its polling
  waits), so a message costs one loop wake-up per side; ucxx's "thread" mode runs a UCX progress thread and a
  notifier thread that completes asyncio futures: three threads per completion (a bare round trip about twice
  as long as with "loop" on both sides). But in "loop" mode every byte moves only when the loop thread holds the
  GIL: in a process with a busy Python thread (an engine) each hand-over waits for the interpreter's switch
  interval, and large calls became tens of times slower than with "thread", whose progress thread moves bytes
  without the GIL (perf/RESULTS.md, "Per-call cost over UCX"). A node runs nothing else, so it gets "loop".
  ucxx's own "polling" and "blocking" modes await every request by polling with asyncio.sleep(0): any process with
  a posted receive burns a whole core; "loop" idles like "thread".
* client submission (`Submission`, EMS_UCX_CLIENT_SUBMIT) "delayed" by default (ucxx's delayed submission: the
  worker's progress thread submits what a thread posts); "direct" (opt-in): a pool client's posting thread submits
  its requests itself, so a small call no longer waits for that thread's wake-up before its request leaves (across
  hosts `UcxNode.exists` 340 -> 306 us, 32 MiB saves and loads unchanged: perf/RESULTS.md "Issue 32: client
  submission"). Posting threads then take the worker's lock beside its progress thread: the client's context makes
  it a mutex (UCX's spinlock spun through its holder's preemption here, a small call's p99 2-3x). It stays opt-in
  until its tail latency and its thread safety under engines' load are measured beyond the two runs so far.
* UCX_TCP_TX_SEG_SIZE / UCX_TCP_RX_SEG_SIZE = 1m: the 8 KiB default splits every large message into many small
  TCP sends; 1 MiB segments doubled loopback throughput.
* endpoint error handling stays ON: it lets UCX report a dead peer (peer failure / keepalive) instead of hanging or
  aborting the process. It rules out the shared-memory transports that cannot report a peer's death (cma), which
  would be faster between processes on one host, but a pool client must survive its node dying.
* UCX_WARN_UNUSED_ENV_VARS = n: otherwise UCX prints a warning to stdout, which pool nodes reserve for their
  ready line. UCX_LOG_FILE = stderr: every UCX log line goes to stderr, never to that pipe (see below).
* In "thread" mode, ucxx's notifier thread is replaced by `_notifier_thread` (same job, one hop less per
  completion; `EMS_UCX_NOTIFIER=ucxx` keeps ucxx's): ucxx 0.52's
  wakes on every batch of completed UCX requests, submits a coroutine to the event loop
  (`run_coroutine_threadsafe`: a Task and a concurrent Future) and then sleeps until that Task has run; on 2 shared
  cores that round trip (two more thread switches and GIL hand-overs per completion) was a large part of a small
  call's latency. Here the thread only posts `worker.run_request_notifier` with `call_soon_threadsafe` (at most one
  pending at a time) and goes straight back to waiting. The futures are still completed on the loop thread, as
  asyncio requires.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

UCX_ENV_DEFAULTS: dict[str, str] = {
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_TCP_TX_SEG_SIZE": "1m",
    "UCX_TCP_RX_SEG_SIZE": "1m",
    # a restarted node must get its port back at once, not after the old connections' TIME_WAIT
    "UCX_TCP_CM_REUSEADDR": "y",
    # ucxx warns on stdout whenever a large batch drains its pool of pre-made futures (harmless, refilled at once)
    "UCXX_LOG_LEVEL": "ERROR",
    # UCX logs to stdout by default. A node's stdout is a pipe its supervisor reads once (the ready line): at the
    # descriptor limit UCX logs a failed accept() on every try, the pipe filled, and UCX's async thread blocked in
    # that write while holding the worker's lock, which wedged the whole node for good
    "UCX_LOG_FILE": "stderr",
}
# "loop" (default): UCX progressed on the event loop thread by `ucx.progress` (ucxx's "blocking" mode without its
# polling waits); "thread", "thread-polling", "polling", "blocking": ucxx's own modes
# The default depends on the process's role (`init_ucx(role)`): see the module docstring.
NODE_PROGRESS_MODE = "loop"
CLIENT_PROGRESS_MODE = "thread"
PROGRESS_MODES = ("loop", "thread", "thread-polling", "polling", "blocking")
NOTIFIERS = ("ems", "ucxx")


class Submission(enum.Enum):
    """How a pool client's UCX worker (`ucx.direct.DirectRuntime`) submits what a thread posts."""

    # ucxx's delayed submission: the posting thread queues the request and wakes the worker's progress thread,
    # which submits it (every post costs a wake-up of that thread before anything reaches the wire)
    DELAYED = "delayed"
    # the posting thread submits the request itself (the worker is thread-safe): a small eager send is on the wire
    # when the post returns; a post UCX could not finish at once signals the progress thread to carry it on
    DIRECT = "direct"


@dataclass(frozen=True)
class UcxSettings:
    """This package's UCX knobs (part of `ems.settings.Settings`; a pool node reads them at start)."""

    # EMS_UCX_PROGRESS_MODE: one of PROGRESS_MODES for every process; None: by role (see the module docstring)
    progress_mode: str | None = None
    # EMS_UCX_PYTHON_FUTURE (0 turns it off): Python futures completed by ucxx's notifier thread; without them every
    # pending request is awaited by polling with asyncio.sleep(0), a core at 100% whenever a receive is posted
    python_future: bool = True
    # EMS_UCX_NOTIFIER: "ems" (`_notifier_thread`) or "ucxx" (ucxx's own notifier thread)
    notifier: str = "ems"
    # EMS_UCX_CLIENT_SUBMIT: "delayed" or "direct" (`Submission`), for pool clients' requests
    client_submit: Submission = Submission.DELAYED

    def __post_init__(self) -> None:
        if self.progress_mode is not None and self.progress_mode not in PROGRESS_MODES:
            raise ValueError(f"EMS_UCX_PROGRESS_MODE must be one of {', '.join(PROGRESS_MODES)}, got {self.progress_mode!r}")
        if self.notifier not in NOTIFIERS:
            raise ValueError(f"EMS_UCX_NOTIFIER must be one of {', '.join(NOTIFIERS)}, got {self.notifier!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> UcxSettings:
        return cls(
            progress_mode=environ.get("EMS_UCX_PROGRESS_MODE") or None,
            python_future=environ.get("EMS_UCX_PYTHON_FUTURE", "1") != "0",
            notifier=environ.get("EMS_UCX_NOTIFIER") or "ems",
            client_submit=_submission(environ.get("EMS_UCX_CLIENT_SUBMIT") or Submission.DELAYED.value),
        )


def _submission(text: str) -> Submission:
    try:
        return Submission(text)
    except ValueError:
        choices = ", ".join(s.value for s in Submission)
        raise ValueError(f"EMS_UCX_CLIENT_SUBMIT must be one of {choices}, got {text!r}") from None


PROGRESS_MODE = "(not started)"  # the mode this process runs, once `init_ucx` ran

_lock = threading.Lock()
_initialised = False
_settings: UcxSettings | None = None  # set by `configure`; else read from the environment at `init_ucx`


def configure(settings: UcxSettings) -> None:
    """Use `settings` when UCX starts in this process (`Ems.init`, a pool node's start). UCX starts once per
    process: after that, a call with other settings is refused (ValueError) rather than silently ignored."""
    global _settings
    with _lock:
        if _initialised and settings != _settings:
            raise ValueError(f"UCX already runs in this process with {_settings}; cannot switch to {settings}")
        _settings = settings


def settings() -> UcxSettings:
    """The settings this process uses: those given to `configure`, else the environment's (read once)."""
    global _settings
    with _lock:
        if _settings is None:
            _settings = UcxSettings.from_env()
        return _settings


def apply_env_defaults() -> None:
    """UCX_* defaults into the environment (an operator's value wins): UCX reads them from there, when its library
    loads and when `ucxx.init` creates its context, so this runs just before `import ucxx` in `init_ucx`."""
    for name, value in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


log = logging.getLogger("ems.transport")
NOTIFIER_PERIOD_NS = 10**9  # how often the notifier thread looks at its shutdown queue when idle


def _notifier_thread(event_loop: asyncio.AbstractEventLoop, worker: Any, q: queue.Queue[str]) -> None:
    """ucxx's notifier thread (same signature, same shutdown protocol), without the wait for the loop: see the module
    docstring. `run_request_notifier` takes every completion queued so far, so one pending call serves all the
    completions that arrive before it runs; a completion queued after it took the list wakes this thread again."""
    import ucxx._lib.libucxx as ucx_api

    asyncio.set_event_loop(event_loop)  # the futures pool creates its futures for this loop
    ready = ucx_api.PythonRequestNotifierWaitState.Ready
    shutdown = ucx_api.PythonRequestNotifierWaitState.Shutdown
    pending = threading.Event()  # a run_request_notifier call is posted and has not started yet

    def run() -> None:
        pending.clear()  # before taking the list: a completion queued from now on posts another call
        try:
            worker.run_request_notifier()
        except Exception:  # never lose the loop over one failed notification
            log.exception("UCX request notifier failed")

    while True:
        worker.populate_python_futures_pool()
        state = worker.wait_request_notifier(period_ns=NOTIFIER_PERIOD_NS)
        if not q.empty() and q.get() == "shutdown":
            break
        if state == shutdown:
            break
        if state != ready or pending.is_set():
            continue
        pending.set()
        try:
            event_loop.call_soon_threadsafe(run)
        except RuntimeError:  # the loop is closed: nothing left to notify
            break
    worker.clear_python_futures_pool()


def init_ucx(default_mode: str = NODE_PROGRESS_MODE) -> None:
    """Initialise ucxx once in this process, with the settings above; the progress mode is `UcxSettings.progress_mode`
    when set, else `default_mode` (NODE_PROGRESS_MODE for a process serving UCX, CLIENT_PROGRESS_MODE for a client)."""
    global _initialised, _settings, PROGRESS_MODE
    with _lock:
        if _initialised:
            return
        if _settings is None:
            _settings = UcxSettings.from_env()
        PROGRESS_MODE = _settings.progress_mode or default_mode
        apply_env_defaults()
        import ucxx
        import ucxx._lib_async.application_context as app_context

        from ems.transport.ucx import ucxx_internals

        ucxx_internals.check()  # a moved internal fails here, loudly, not later or silently slower

        if _settings.notifier == "ems":
            app_context._notifierThread = _notifier_thread  # the name start_notifier_thread() calls

        if PROGRESS_MODE == "loop":
            from ucxx.core import _get_ctx

            from ems.transport.ucx.progress import install

            ucxx.init(progress_mode="blocking", enable_python_future=False)
            install(_get_ctx().worker, asyncio.get_running_loop())
        else:
            ucxx.init(
                progress_mode=PROGRESS_MODE,
                enable_python_future=_settings.python_future and PROGRESS_MODE.startswith("thread"),
            )
        _initialised = True

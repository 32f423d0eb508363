"""The pool client's UCX worker (`ucx.direct.DirectRuntime` makes one per process): ucxx's names, imported once UCX's
environment is in place (`ucx.config`), the UCX context and worker as the submission mode needs them, and the way to
wake the worker's progress thread.

Contract:
* `ucxx_names()`: ucxx's modules and classes the client uses (`api`, `Array`, `hash`, `Tag`, `mask`), imported on
  first use, after `ucx.config.apply_env_defaults` and the check of the ucxx internals they rely on.
* `start_worker(submission)` returns (context, worker, signal): the client's own UCX context and worker, with
  ucxx's Python futures on; `signal` wakes the worker's progress thread (`worker_signal`), None under DELAYED
  submission, which needs none. The caller fills the futures pool and starts the progress thread.
* Submission (`ucx.config.Submission`, EMS_UCX_CLIENT_SUBMIT): with DIRECT (opt-in) the posting thread submits its
  request to UCX itself, so a small request is on the wire when `send` returns; a post UCX could not finish at once
  (a send with bytes left, a large receive that may have matched a rendezvous) signals the progress thread
  (`ucp_worker_signal`), which carries it on. With ucxx's delayed submission (DELAYED, the default) a post
  only queues the request and wakes the progress thread, which submits it: every small call paid that thread's
  wake-up before its request left (perf/RESULTS.md, "Issue 32: client submission": `UcxNode.exists` 340 -> 306 us
  across hosts, bulk unchanged). Without the signal, a large send posted directly stalled until the progress
  thread's next wake-up (a 1 MiB put 4.5 ms instead of 1.1 ms, issue 16). Posting threads take the worker's lock
  beside the progress thread, so the client's UCX context makes it a mutex (`USE_MT_MUTEX`): with UCX's default
  spinlock a small call's p99 was 2-3x delayed submission's on this 2-core host (waiters spinning through the
  holder's preemption), with the mutex within 10%.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ems.transport.ucx import config as ucx_config

_names: dict[str, Any] = {}


def ucxx_names() -> dict[str, Any]:
    """ucxx's names, imported on first use (UCX's environment must be in place first)."""
    if not _names:
        ucx_config.apply_env_defaults()
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array
        from ucxx._lib_async.utils import hash64bits

        from ems.transport.ucx import ucxx_internals

        ucxx_internals.check()
        _names.update(api=ucx_api, Array=Array, hash=hash64bits, Tag=ucx_api.UCXXTag, mask=ucx_api.UCXXTagMaskFull)
    return _names


def start_worker(submission: ucx_config.Submission) -> tuple[Any, Any, Callable[[], Any] | None]:
    """(context, worker, signal) for `submission`; see the module docstring."""
    api = ucxx_names()["api"]
    delayed = submission is ucx_config.Submission.DELAYED
    # DIRECT: every posting thread enters the worker beside its progress thread, so UCX's worker lock is a mutex
    # (a spinlock's waiter spun through the holder's preemption on a busy host: p99 of a small call 2-3x)
    context = api.UCXContext({} if delayed else {"USE_MT_MUTEX": "y"})
    # DIRECT: the posting thread submits its request itself (the worker is thread-safe) and signals the progress
    # thread only for a post UCX did not finish at once (`ucx.direct.Connection.send` / `recv`); DELAYED: a posting
    # thread only queues it and the progress thread submits it
    worker = api.UCXWorker(context, enable_delayed_submission=delayed, enable_python_future=True)
    return context, worker, None if delayed else worker_signal(worker)


def worker_signal(worker: Any) -> Any:
    """A callable that wakes `worker`'s progress thread out of its epoll wait (UCX's `ucp_worker_signal`, which
    ucxx does not expose to Python)."""
    import ctypes

    from ems.transport.ucx.ucxx_internals import loaded_library

    signal = loaded_library("libucp").ucp_worker_signal
    signal.argtypes = [ctypes.c_void_p]
    signal.restype = ctypes.c_int
    handle = ctypes.c_void_p(worker.handle)
    return lambda: signal(handle)

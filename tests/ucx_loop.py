"""`UcxRuntime`: a process-wide thread running an asyncio event loop on ucxx's asyncio API, for protocol-level
sessions written as coroutines: scripted nodes and raw clients in the tests (`tests/security/raw_ucx.py`,
`tests/pool/pool_testlib.client_of_scripted_node`) and perf/bench_pool.py. `UcxNode` does not use it
(`transport.ucx.direct`), so it lives here, beside the tests, not in the package (its users put tests/ on sys.path).

Contract: `UcxRuntime.get()` starts the thread once (UCX initialised inside its loop with the client's progress mode,
`ucx.config`); run coroutines on `.loop` (`asyncio.run_coroutine_threadsafe`) or functions with `call_soon`. Endpoints
added to `.live` are aborted at exit, and ucxx's notifier thread is stopped before the interpreter joins threads.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Callable
from typing import Any

from ems.errors import EmsErrorCode
from ems.transport.base import TransportError
from ems.transport.ucx.config import CLIENT_PROGRESS_MODE, init_ucx

ABORT_PERIOD_NS = 10**8  # how long aborting an endpoint may wait for UCX (never long: the peer may hang)


class UcxRuntime:
    """The process-wide UCX event loop thread (created on first use)."""

    _instance: UcxRuntime | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []

        def start() -> None:
            # ucxx binds its notifier thread to the *running* loop, so it must be initialised from inside it
            try:
                init_ucx(CLIENT_PROGRESS_MODE)
            except BaseException as error:  # reported to the creating thread
                failure.append(error)
                self.loop.stop()
            finally:
                ready.set()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(start)
            self.loop.run_forever()

        self.live: set = set()  # endpoints in use, aborted at exit
        self.thread = threading.Thread(target=run, name="ems-ucx", daemon=True)
        self.thread.start()
        ready.wait()
        if failure:
            raise TransportError(EmsErrorCode.EMS_IO_ERROR, f"UCX failed to start: {failure[0]!r}")
        # ucxx's notifier thread is not a daemon: stop it before the interpreter joins threads at exit, or the
        # process never exits (threading's own exit hook runs before `atexit`)
        register = getattr(threading, "_register_atexit", atexit.register)
        register(self.shutdown)

    def shutdown(self) -> None:
        """Abort every endpoint and stop the loop thread, before the interpreter tears objects down (UCX callbacks
        into half-destroyed Python objects crash the process)."""
        if not self.thread.is_alive():
            return

        def stop() -> None:
            for ep in list(self.live):
                abort(ep)
            self.live.clear()
            try:
                import ucxx

                ucxx.stop_notifier_thread()
            except Exception:  # nothing to stop
                pass
            self.loop.stop()

        self.loop.call_soon_threadsafe(stop)
        self.thread.join(5.0)

    @classmethod
    def get(cls) -> UcxRuntime:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = UcxRuntime()
            return cls._instance

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)


def abort(ep: Any) -> None:
    """Abort a ucxx asyncio Endpoint now (on the loop thread); nothing when it is closed already."""
    from ems.transport.ucx import progress as ucx_progress

    try:
        ep.abort(period=ABORT_PERIOD_NS)
    except Exception:  # already closed
        pass
    ucx_progress.kick()  # the aborted requests' failures reach their callers now

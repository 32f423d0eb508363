"""The UCX settings both sides use, applied once per process before `ucxx` starts.

Contract: `init_ucx()` sets the UCX environment defaults below (a value already in the environment wins, so an
operator can override any of them), then calls `ucxx.init` with the chosen progress mode, once per process. It
must run inside the event loop thread that will drive UCX (the progress mode hooks into that loop). Import this
module before anything imports `ucxx`: UCX reads its global options when the library loads.

Why these values (measured on loopback, see perf/RESULTS.md "Pool nodes"):
* progress mode "thread" with Python futures: a UCX progress thread drives the worker and ucxx's notifier thread
  completes asyncio futures, so a waiting coroutine sleeps. The "polling" and "blocking" modes measured a little
  faster (1.6-1.7 vs 1.4 GB/s, 1 MiB messages) but ucxx 0.52 awaits every request there by polling with
  asyncio.sleep(0): any process with a posted receive (a pool node always has one) burns a whole core.
* UCX_TCP_TX_SEG_SIZE / UCX_TCP_RX_SEG_SIZE = 1m: the 8 KiB default splits every large message into many small
  TCP sends; 1 MiB segments doubled loopback throughput.
* endpoint error handling stays ON: it lets UCX report a dead peer (peer failure / keepalive) instead of hanging or
  aborting the process. It rules out the shared-memory transports that cannot report a peer's death (cma), which
  would be faster between processes on one host, but a pool client must survive its node dying.
* UCX_WARN_UNUSED_ENV_VARS = n: otherwise UCX prints a warning to stdout, which pool nodes reserve for their
  ready line.
"""

from __future__ import annotations

import os
import threading

UCX_ENV_DEFAULTS: dict[str, str] = {
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_TCP_TX_SEG_SIZE": "1m",
    "UCX_TCP_RX_SEG_SIZE": "1m",
    # a restarted node must get its port back at once, not after the old connections' TIME_WAIT
    "UCX_TCP_CM_REUSEADDR": "y",
    # ucxx warns on stdout whenever a large batch drains its pool of pre-made futures (harmless, refilled at once)
    "UCXX_LOG_LEVEL": "ERROR",
}
PROGRESS_MODE = os.environ.get("EMS_UCX_PROGRESS_MODE", "thread")
# Python futures completed by ucxx's notifier thread: without them every pending request is awaited by polling
# with asyncio.sleep(0), i.e. a core at 100% whenever a receive is posted (a pool node always has one).
PYTHON_FUTURE = os.environ.get("EMS_UCX_PYTHON_FUTURE", "1") != "0"

_lock = threading.Lock()
_initialised = False


def apply_env_defaults() -> None:
    for name, value in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


# UCX reads its global options when the library loads (at `import ucxx`), so the defaults go in at import time
# of this module, which every ucxx user here imports first.
apply_env_defaults()


def init_ucx() -> None:
    """Initialise ucxx once in this process, with the settings above."""
    global _initialised
    with _lock:
        if _initialised:
            return
        apply_env_defaults()
        import ucxx

        ucxx.init(
            progress_mode=PROGRESS_MODE, enable_python_future=PYTHON_FUTURE and PROGRESS_MODE.startswith("thread")
        )
        _initialised = True

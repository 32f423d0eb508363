"""The jobs' executor: the threads a pipelined job's chunk calls run on (`ems.datapath.jobs`), one executor per client.

Contract:
* `ChunkExecutor.start(call)` runs `call` on the executor's threads, at most `PIPELINE_THREADS` at once (the rest wait
  in the order started), and returns its `Future`: how one request keeps several chunk calls in flight. The threads
  start on first use.
* Each client (`ContextCaching`) holds one and hands it to its jobs in their `JobContext` (`JobContext.executor`),
  so the cap is per client, whichever jobs share it; the threads are apart from any thread the pool backend's calls
  use themselves (the pool client's fan-out threads), so a chunk call that fans out to several nodes never waits for
  a thread it holds. The client closes it; the pool backend knows nothing of it.
* `close()` cancels the calls not started and lets the running ones finish on their own (it does not wait); a
  `start` after it starts a fresh pool of threads.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

R = TypeVar("R")

PIPELINE_THREADS = 8  # chunk calls of one client that run at once (more wait in order)


class ChunkExecutor:
    """Threads for the chunk calls of pipelined jobs; see the module docstring."""

    def __init__(self, threads: int = PIPELINE_THREADS) -> None:
        self.threads = threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def start(self, call: Callable[[], R]) -> concurrent.futures.Future[R]:
        """Run `call` on the executor's threads; its future."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="ems-pipe")
            return self._pool.submit(call)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

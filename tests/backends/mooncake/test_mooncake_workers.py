"""The Mooncake backend's worker threads (`ems.backends.mooncake.workers.Workers`), without a store: a caller waits
at most until its deadline, a call queued past it never runs, and actions waiting for idleness run once the calls
that hang return."""

from __future__ import annotations

import threading
import time

import pytest

from ems import EmsErrorCode
from ems.backends.mooncake.workers import Workers
from ems.records import Deadline
from ems.transport.base import TransportError


def test_worker_deadline_bounds_the_caller_and_a_queued_call_never_runs():
    """Calls that hang hold their workers; a call queued behind them returns EMS_IO_TIMEOUT by its deadline and is
    never started; actions waiting for idleness run once the hung calls return."""
    workers = Workers(2, "test-workers")
    release = threading.Event()
    ran: list = []
    try:
        hung = [workers.submit(release.wait) for _ in range(2)]
        started = time.monotonic()
        with pytest.raises(TransportError) as raised:
            workers.call(lambda: ran.append("queued"), Deadline.after(0.2), "queued call")
        assert raised.value.status_code() == EmsErrorCode.EMS_IO_TIMEOUT
        assert time.monotonic() - started < 1.0
        idle: list = []
        workers.when_idle(lambda: idle.append(True))
        assert not idle  # two calls still hang
        release.set()
        for future in hung:
            assert future.result(5) is True
        deadline = time.monotonic() + 5
        while not idle and time.monotonic() < deadline:
            time.sleep(0.01)
        assert idle == [True] and workers.in_flight == 0 and ran == []
        assert workers.call(lambda: 7, Deadline.after(5), "a call") == 7
    finally:
        release.set()
        workers.close()

"""`ems.buffers.SpareCpuPacer`: a background populate takes only CPU time no other thread wants."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from ems.buffers import SpareCpuPacer, host_idle_seconds

# no EMS_* settings in the environment and no initialised `Ems`, before and after each test
pytestmark = pytest.mark.usefixtures("clean_ems")


class FakeHost:
    """A clock, the host's idle seconds and this thread's CPU seconds, advanced by hand. While the pacer sleeps the
    host stays busy for `busy_sleeps` more sleeps, then has `idle_cores` idle."""

    def __init__(self, busy_sleeps: int = 0, idle_cores: float = 1.0) -> None:
        self.now = 100.0
        self.idle = 50.0
        self.own = 1.0
        self.busy_sleeps, self.idle_cores = busy_sleeps, idle_cores
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        if len(self.sleeps) > self.busy_sleeps:
            self.idle += self.idle_cores * seconds

    def step(self, seconds: float, idle_cores: float, own_share: float = 1.0) -> None:
        """Time passes with one step running: the host idle at `idle_cores`, this thread on `own_share` of a core."""
        self.now += seconds
        self.idle += idle_cores * seconds
        self.own += own_share * seconds

    def pacer(self, idle_known: bool = True) -> SpareCpuPacer:
        return SpareCpuPacer(
            idle=(lambda: self.idle) if idle_known else (lambda: None),
            own_cpu=lambda: self.own,
            clock=lambda: self.now,
            sleep=self.sleep,
        )


def run_steps(host: FakeHost, pacer: SpareCpuPacer, count: int, seconds: float, idle_cores: float) -> None:
    for _ in range(count):
        pacer.run(lambda: None)
        host.step(seconds, idle_cores)


def test_steps_go_on_without_waiting_while_a_core_is_spare():
    host = FakeHost()
    pacer = host.pacer()
    run_steps(host, pacer, 100, 0.004, idle_cores=0.2)  # this thread's core plus a fifth of another: spare
    assert host.sleeps == [] and pacer.waited_s == 0


def test_a_step_waits_while_every_core_is_busy_and_goes_on_once_one_is_spare():
    """This thread found no idle time and got only half a core: the other threads wanted every core. The next step
    waits window by window, and goes on at the first window that shows a spare core."""
    host = FakeHost(busy_sleeps=4)
    pacer = host.pacer()
    host.step(SpareCpuPacer.WINDOW_S, idle_cores=0.0, own_share=0.5)
    pacer.run(lambda: None)
    w = SpareCpuPacer.WINDOW_S  # four busy windows, each twice the one before, then the one that shows a spare core
    assert host.sleeps == pytest.approx([w, 2 * w, 4 * w, 8 * w, 16 * w])
    assert pacer.waited_s == pytest.approx(31 * w)
    run_steps(host, pacer, 20, 0.004, idle_cores=0.5)  # spare again: no more waiting
    assert len(host.sleeps) == 5


def test_a_long_wait_looks_at_the_host_a_few_times_a_second():
    """While every core stays busy, the windows grow to `MAX_WINDOW_S`: a thread that waits a minute wakes up about
    twice a second, not 33 times (each look reads /proc/stat); the first step once a core is spare starts over."""
    host = FakeHost(busy_sleeps=10**9)
    pacer = host.pacer()
    host.step(SpareCpuPacer.WINDOW_S, idle_cores=0.0, own_share=0.5)
    host.busy_sleeps = 0
    sleeps_before_spare = 0

    def sleep(seconds: float) -> None:
        nonlocal sleeps_before_spare
        host.sleeps.append(seconds)
        host.now += seconds
        if host.now > 160.0:  # a minute later the host has a spare core
            host.idle += seconds
        else:
            sleeps_before_spare += 1

    pacer._sleep = sleep
    pacer.run(lambda: None)
    assert max(host.sleeps) == SpareCpuPacer.MAX_WINDOW_S
    assert sleeps_before_spare < 60 * 2.5
    pacer.run(lambda: None)  # spare: goes on at once, and a later busy spell starts at the short window again
    host.step(SpareCpuPacer.WINDOW_S, idle_cores=0.0, own_share=0.0)
    before = len(host.sleeps)
    pacer.run(lambda: None)
    assert host.sleeps[before:] == [SpareCpuPacer.WINDOW_S]


def test_a_window_after_a_long_rest_says_nothing_of_now():
    """After the thread waited for work (an arena with nothing to populate), the long window's idle time is stale:
    the next step waits one fresh window and goes on only once a window shows a spare core."""
    host = FakeHost(busy_sleeps=2, idle_cores=2.0)
    pacer = host.pacer()
    host.step(5.0, idle_cores=2.0, own_share=0.0)  # five idle seconds: long ago, as far as now is concerned
    pacer.run(lambda: None)
    w = SpareCpuPacer.WINDOW_S  # the stale window, then two busy ones (the second twice as long), then spare
    assert host.sleeps == pytest.approx([w, w, 2 * w])


def test_without_the_hosts_idle_time_it_never_waits():
    host = FakeHost()
    pacer = host.pacer(idle_known=False)
    run_steps(host, pacer, 50, 0.01, idle_cores=0.0)
    assert host.sleeps == []


def test_the_step_result_comes_back():
    assert FakeHost().pacer().run(lambda: 42) == 42


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.skipif(host_idle_seconds() is None, reason="this kernel does not report idle time in /proc/stat")
def test_a_paced_thread_yields_to_processes_that_keep_every_core_busy():
    """On the real host: with one spinning process per core, paced 2 ms steps spend most of a second waiting. The
    second ends inside the pacer's wait too: on a host whose cores other processes keep busy as well (a CPU hog
    beside the suite) the pacer waits for as long as they do, which is its job, so the test stops it at the second
    rather than waiting for a spare core that may not come."""

    class _SecondIsOver(Exception):
        pass

    def sleep_within_the_second(seconds: float) -> None:
        if time.monotonic() - start >= 1.0:
            raise _SecondIsOver
        time.sleep(seconds)

    hogs = [multiprocessing.Process(target=_spin, args=(2.5,)) for _ in range(os.cpu_count() or 1)]
    for hog in hogs:
        hog.start()
    try:
        time.sleep(0.3)  # the hogs are running
        pacer = SpareCpuPacer(sleep=sleep_within_the_second)
        start = time.monotonic()
        steps = 0
        try:
            while time.monotonic() - start < 1.0:
                pacer.run(lambda: _spin(0.002))
                steps += 1
        except _SecondIsOver:
            pass
        assert pacer.waited_s >= 0.5, f"{steps} steps ran and waited only {pacer.waited_s:.2f} s beside busy cores"
    finally:
        for hog in hogs:
            hog.terminate()
            hog.join()

"""The tests' and benchmarks' reader of CPU time in /proc (`tests/proc_cpu.py`): a busy grandchild counts in its
grandparent's tree (in all and by thread) and on the machine, not in the waiting parent itself; this process's spin
counts on both clocks (ticks and schedstat) and by thread; a name with spaces and parentheses parses; a process
that is gone counts nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from proc_cpu import (
    host_busy_seconds,
    process_cpu_seconds,
    schedstat_seconds,
    stat_cpu_seconds,
    threads_cpu_seconds,
    tree_cpu_seconds,
)

SPIN = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass\n"
WRAPPER = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {SPIN!r}])"  # a parent that only waits


def test_a_busy_grandchild_counts_in_the_tree_and_a_gone_process_counts_nothing():
    host_before = host_busy_seconds()
    wrapper = subprocess.Popen([sys.executable, "-c", WRAPPER])
    try:
        time.sleep(1.2)
        tree = tree_cpu_seconds(wrapper.pid)
        assert tree > 0.1  # the grandchild spins (on a host whose cores are busy, for a share of the time)
        assert process_cpu_seconds(wrapper.pid) < tree  # the wrapper itself only waits
        assert sum(threads_cpu_seconds(wrapper.pid, tree=True).values()) > 0.1
    finally:
        wrapper.wait(30)
    assert host_busy_seconds() - host_before > 0.1
    gone = wrapper.pid
    assert process_cpu_seconds(gone) == 0.0 and tree_cpu_seconds(gone) == 0.0 and schedstat_seconds(gone) == 0.0


def test_this_process_spin_counts_on_both_clocks_and_by_thread():
    start_ticks, start_ns = process_cpu_seconds(os.getpid()), schedstat_seconds()
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    assert schedstat_seconds() - start_ns > 0.25  # nanosecond counts
    assert process_cpu_seconds(os.getpid()) - start_ticks > 0.15  # 10 ms ticks
    assert sum(threads_cpu_seconds().values()) > 0.25


def test_a_stat_line_whose_name_holds_spaces_and_parentheses():
    fields = ["S"] + ["0"] * 10 + ["250", "150"] + ["0"] * 30
    stat = f"4242 (odd (name) x) {' '.join(fields)}"
    ticks = os.sysconf("SC_CLK_TCK")
    assert stat_cpu_seconds(stat) == (250 + 150) / ticks

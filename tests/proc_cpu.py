"""CPU time of processes and threads as Linux reports it in /proc, for the tests and the benchmarks: one reader of each
file. Standard library only: a vLLM engine's script and benchmarks without torch import it too.

* `stat_cpu_seconds(text)`: user + system seconds in the text of a /proc stat file, a process's or a thread's (clock
  ticks, 10 ms here: measure over a second or more). `process_cpu_seconds(pid)`: a process's, every thread it ever
  had. `children(pid)`, `tree_cpu_seconds(pid)`: with its descendants. `threads_cpu_seconds(pid, tree)`: by thread
  name (digits and separators stripped, so a pool of threads is one entry), of the process or of its tree.
* `thread_schedstat_ns(pid)`: each thread's nanoseconds on a CPU (/proc/PID/task/TID/schedstat: exact, for short
  windows; threads alive now only), by thread id; `schedstat_seconds(pid)` their sum.
* `host_busy_seconds()`: the machine's CPU seconds spent busy so far, all CPUs (/proc/stat: user to steal, less idle
  and iowait).
A process or thread that is gone counts nothing (its figures are missing, never an error).
"""

from __future__ import annotations

import os

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_NAME_TAIL = "0123456789-_:"  # a thread pool's numbering: "ThreadPoolExecutor-0_1", "gloo_tcp_loop:3"


def stat_cpu_seconds(stat: str) -> float:
    """User + system CPU seconds in the text of a /proc stat file (a process's or a thread's)."""
    fields = stat.rsplit(")", 1)[1].split()  # (the name, in parentheses, may hold spaces)
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _threads(pid: int | str) -> list[str]:
    """The thread ids of `pid` (none for a process gone)."""
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` so far, every thread it ever had (0 for a process gone)."""
    stat = _read(f"/proc/{pid}/stat")
    return stat_cpu_seconds(stat) if stat else 0.0


def children(pid: int) -> list[int]:
    """The child processes of `pid` (none for a process gone)."""
    found: list[int] = []
    for tid in _threads(pid):
        text = _read(f"/proc/{pid}/task/{tid}/children")
        found += [int(c) for c in (text or "").split()]
    return found


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its descendants so far (0 for a process gone)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += process_cpu_seconds(p)
        todo += children(p)
    return total


def threads_cpu_seconds(pid: int | str = "self", tree: bool = False) -> dict[str, float]:
    """User + system CPU seconds so far of `pid`'s threads (and, with `tree`, its descendants'), summed by thread
    name without its numbering (a process names its threads after itself unless they name themselves: vLLM's
    `VLLM::Worker`, a Python thread's name only where the thread set it)."""
    out: dict[str, float] = {}
    todo: list[int | str] = [pid]
    while todo:
        p = todo.pop()
        for tid in _threads(p):
            stat = _read(f"/proc/{p}/task/{tid}/stat")
            if not stat:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")].rstrip(_NAME_TAIL)
            out[name] = out.get(name, 0.0) + stat_cpu_seconds(stat)
        if tree:
            todo += children(int(p) if p != "self" else os.getpid())
    return out


def thread_schedstat_ns(pid: int | str = "self") -> dict[int, int]:
    """Each live thread of `pid`: its nanoseconds on a CPU so far, by thread id."""
    out: dict[int, int] = {}
    for tid in _threads(pid):
        text = _read(f"/proc/{pid}/task/{tid}/schedstat")
        try:
            out[int(tid)] = int((text or "").split()[0])
        except (ValueError, IndexError):  # a thread that just ended
            continue
    return out


def schedstat_seconds(pid: int | str = "self") -> float:
    """The seconds `pid`'s live threads have spent on a CPU so far (nanosecond counts: good over short windows)."""
    return sum(thread_schedstat_ns(pid).values()) / 1e9


def host_busy_seconds() -> float:
    """CPU seconds the machine has spent busy so far, all CPUs."""
    text = _read("/proc/stat") or ""
    fields = [int(x) for x in text.split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / _TICKS_PER_S

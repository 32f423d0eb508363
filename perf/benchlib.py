"""Helpers every benchmark in perf/ shares: the machine description, best-of and median timing, percentiles."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """Shortest wall time of `repeats` runs (the machine is shared: the minimum is the least disturbed)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def median_us(fn: Callable[[], object], calls: int) -> float:
    """Median wall time of `calls` runs, µs (a per-call figure: the typical call, not the luckiest)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q` quantile of `values` (0 <= q <= 1; q = 0.5 the upper median), not interpolated: a
    figure that one of the measured calls took."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = f", load average {os.getloadavg()[0]:.1f} at start (shared host)" if hasattr(os, "getloadavg") else ""
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), python {platform.python_version()}{load}"
    )

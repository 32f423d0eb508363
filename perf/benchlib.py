"""Helpers every benchmark in perf/ shares: the machine description and best-of timing."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
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

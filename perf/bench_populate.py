"""Background populate and the mmap lock: how long another thread's allocations wait while a store faults its arena
in ahead of use, by populate step, side by side in one run.

Contract: `python perf/bench_populate.py [--rounds N] [--ahead BYTES] [--no-results]`. For each populate step (the
project's `ems.buffers.POPULATE_STEP`, and larger ones for comparison) a fresh child process builds a `KvStore` whose
arena is faulted in `--ahead` bytes ahead in the background (what the embedded pool and every pool node do at start),
and its main thread meanwhile allocates, touches and frees 1 MiB numpy arrays (each an mmap and a munmap, as an
engine's or UCX's large allocations are) until the populate is done. Rows: the allocations' median, 99th percentile
and worst wait, and the populate's own rate; rounds interleave the steps (the host is shared): each figure is the
median over rounds, worst and rate with their range (both swing with the kernel's supply of huge pages). A plot goes
to perf/populate.png; the table and the command are appended to perf/RESULTS.md.

Why it matters: MADV_POPULATE_WRITE holds the process's mmap lock for a whole call, and mmap/munmap wait for it, so
with 32 MiB steps an engine's allocation right after `Ems.init` could wait a whole step (hundreds of ms on these VMs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchlib import machine

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, sys, time
import numpy as np
import ems.buffers, ems.store.kv_store, ems.store.recycling
step, ahead = int(sys.argv[1]), int(sys.argv[2])
ems.buffers.POPULATE_STEP = ems.store.recycling.POPULATE_STEP = step  # both names: the arena imported it by value
store = ems.store.kv_store.KvStore(2 * ahead, prefault_ahead=ahead)
waits = []
start = time.perf_counter()
while store.stats().arena_populated_bytes < ahead and time.perf_counter() - start < 60:
    t = time.perf_counter()
    block = np.ones(1 << 20, dtype=np.uint8)
    del block
    waits.append(time.perf_counter() - t)
seconds = time.perf_counter() - start
store.close()
waits.sort()
print(json.dumps({"median_ms": 1e3 * waits[len(waits) // 2], "p99_ms": 1e3 * waits[int(0.99 * (len(waits) - 1))],
                  "worst_ms": 1e3 * waits[-1], "allocations": len(waits), "populate_mbps": ahead / seconds / 1e6}))
"""


def child(step: int, ahead: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(step), str(ahead)], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    from ems.buffers import POPULATE_STEP

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ahead", type=int, default=256 << 20, help="bytes faulted in ahead (default: the pools' 256 MiB)")
    ap.add_argument("--no-results", action="store_true")
    args = ap.parse_args()
    steps = sorted({POPULATE_STEP, 8 << 20, 32 << 20})
    runs: dict[int, list[dict]] = {s: [] for s in steps}
    for _ in range(args.rounds):
        for step in steps:
            runs[step].append(child(step, args.ahead))

    def med(step: int, key: str) -> float:
        return statistics.median(r[key] for r in runs[step])

    def spread(step: int, key: str, digits: int) -> str:
        values = [r[key] for r in runs[step]]
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    lines = [
        "| populate step | 1 MiB allocation median ms | p99 ms | worst ms, median (range) | populate MB/s, median (range) | |",
        "|---|---|---|---|---|---|",
        *(
            f"| {step >> 20} MiB | {med(step, 'median_ms'):.3f} | {med(step, 'p99_ms'):.1f} | {spread(step, 'worst_ms', 1)} | "
            f"{spread(step, 'populate_mbps', 0)} | {'the project' if step == POPULATE_STEP else ''} |"
            for step in steps
        ),
    ]
    table = "\n".join(lines)
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.bar([f"{s >> 20} MiB" for s in steps], [med(s, "worst_ms") for s in steps])
        ax.set_xlabel("populate step")
        ax.set_ylabel("worst 1 MiB allocation wait (ms)")
        ax.set_title("Allocations beside a background populate")
        fig.tight_layout()
        fig.savefig(HERE / "populate.png", dpi=120)
    except ImportError:
        print("(matplotlib not installed: no plot)")
    if args.no_results:
        return
    command = " ".join(["python", "perf/bench_populate.py", *sys.argv[1:]])
    header = [
        "",
        f"## Background populate and the mmap lock ({datetime.date.today().isoformat()}, cpu)",
        "",
        f"Command: `{command}`. {machine()}. A store faulting {args.ahead >> 20} MiB in ahead in the background; the "
        f"main thread allocates, touches and frees 1 MiB arrays meanwhile; median over {args.rounds} interleaved rounds "
        "of fresh processes.",
        "",
    ]
    with open(HERE / "RESULTS.md", "a") as f:
        f.write("\n".join([*header, table]) + "\n")


if __name__ == "__main__":
    main()

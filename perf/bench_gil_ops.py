"""Which copies and small ops give the GIL away, and what that costs beside a busy Python thread.

    flock /tmp/ems-bench.lock python perf/bench_gil_ops.py [--reps 40]

An op that releases the GIL (numpy above its 500-element threshold, numpy's sorts, an indexed assignment from a
strided source, every torch op) lets a thread spinning in pure Python take it, and the caller then waits up to the
interpreter's switch interval (5 ms) to get it back. Each op below is timed alone and beside such a thread (the
median of `--reps`, each after the busy thread has had its turn); an op that keeps the GIL costs the same both ways.
The load path's choices follow from these rows (kernels/torch_backend.py, ems/datapath/arguments.py). Prints a table and
appends it with this command to perf/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pool import BusyPythonThread
from benchlib import machine

ROW, ROWS, TABLE_ROWS = 32 << 10, 64, 4000  # 64 rows of 32 KiB (2 MiB) into a table of 4000 rows


def cases() -> list[tuple[str, Callable[[], object]]]:
    rng = np.random.default_rng(0)
    table = np.zeros((TABLE_ROWS, ROW), np.uint8)
    idx = rng.permutation(TABLE_ROWS)[:ROWS].astype(np.int64)
    step = ROW + 64  # a value-major staging: each row followed by a header's gap
    flat = rng.integers(0, 256, ROWS * step, dtype=np.uint8)
    strided = np.lib.stride_tricks.as_strided(flat, (ROWS, ROW), (step, 1))
    contiguous = np.ascontiguousarray(strided)
    void = np.dtype((np.void, ROW))
    table_rows, strided_rows, contiguous_rows = table.view(void)[:, 0], strided.view(void)[:, 0], contiguous.view(void)[:, 0]
    small, large = np.arange(499, dtype=np.int64), np.arange(501, dtype=np.int64)
    tokens = rng.permutation(1 << 14)[:2000].astype(np.int64)
    t_table, t_idx, t_rows = torch.from_numpy(table), torch.from_numpy(idx), torch.from_numpy(contiguous)

    def set_strided_then_contiguous() -> None:
        table_rows[idx] = strided_rows.copy()

    return [
        ("numpy row assignment, uint8 rows (the old scatter)", lambda: table.__setitem__(idx, strided)),
        ("numpy void rows from a strided source", lambda: table_rows.__setitem__(idx, strided_rows)),
        ("numpy void rows from a contiguous source", lambda: table_rows.__setitem__(idx, contiguous_rows)),
        ("numpy void rows: strided copied first, then placed (the scatter now)", set_strided_then_contiguous),
        ("torch index_copy_ of the same rows", lambda: t_table.index_copy_(0, t_idx, t_rows)),
        ("numpy ufunc on 499 elements", lambda: small + 1),
        ("numpy ufunc on 501 elements", lambda: large + 1),
        ("numpy argsort of 2000 slots", lambda: np.argsort(tokens, kind="stable")),
        ("Python set of 2000 slots (the repeat check now)", lambda: len(set(tokens.tolist()))),
        ("torch view of a tensor", lambda: t_table.view(torch.int8)),
    ]


def median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        time.sleep(0)  # give the GIL away here (beside a busy thread: it runs its turn now, not inside the op)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"))
    args = ap.parse_args()
    rows = []
    for name, fn in cases():
        fn()
        alone = median_ms(fn, args.reps)
        with BusyPythonThread():
            busy = median_ms(fn, args.reps)
        rows.append((name, alone, busy))
    lines = [
        "| op | alone ms | beside a busy Python thread ms | busy / alone |",
        "|---|---|---|---|",
        *[f"| {name} | {alone:.3f} | {busy:.3f} | {busy / alone:.1f}x |" for name, alone, busy in rows],
    ]
    print("\n".join(lines))
    header = [
        "",
        f"## Which ops give the GIL away (`perf/bench_gil_ops.py`, {time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `flock /tmp/ems-bench.lock python perf/bench_gil_ops.py --reps {args.reps}`. {machine()}. Median of "
        f"{args.reps} runs of each op, alone and beside a thread spinning in pure Python (switch interval "
        f"{sys.getswitchinterval() * 1e3:.0f} ms); 64 rows of 32 KiB into a table of {TABLE_ROWS} rows.",
        "",
    ]
    with open(args.results, "a") as f:
        f.write("\n".join(header + lines) + "\n")


if __name__ == "__main__":
    main()

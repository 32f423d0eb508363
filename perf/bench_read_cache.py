"""The client's read cache (`ems.backends.pool_client.ReadCache`) on its own: what keeping a save's values
(`remember`, a save with `write_rcache`) and serving a load from it (`place`) cost per call, next to a plain copy of
the same bytes, and, with `--against REV`, next to another commit's `ReadCache` measured in the same rounds.

Contract: `python perf/bench_read_cache.py [--against REV] [--rounds 5] [--no-results]`. For each call shape (values
per call x value size) a cache of the default capacity (256 MiB) is filled past its capacity with fresh keys, so the
timed calls evict as much as they keep, as an engine's cache does after warm-up; then one key saved again and again.
Per round each side (this tree, then REV's, alternating which goes first) runs every shape; a figure is the median
over rounds of the side's median call. REV's class is its `ems/backends/pool_client.py` read from git and run
against this tree's other modules. The plain copy: `np.copyto` of the same bytes between preallocated arrays.
Prints a table, saves perf/read_cache.png and records perf/results/read_cache.json (perf/results.py).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import machine, median_us
from results import Figure, Goal, Run, command_line, markdown, record

from ems.backends.pool_client import ReadCache

HERE = Path(__file__).resolve().parent
CAPACITY = 256 << 20  # the default read_cache_capacity
SHAPES = [(1, 64 << 10), (16, 64 << 10), (32, 1 << 20)]  # (values per call, bytes a value)


def cache_class_at(rev: str) -> type:
    """`ReadCache` as commit `rev` has it."""
    source = subprocess.run(
        ["git", "-C", str(HERE.parent), "show", f"{rev}:ems/backends/pool_client.py"], check=True, capture_output=True, text=True
    ).stdout
    module = types.ModuleType(f"pool_client_at_{rev}")
    exec(compile(source, f"{rev}:ems/backends/pool_client.py", "exec"), module.__dict__)
    return module.ReadCache


def shape_us(cls: type, count: int, nbytes: int) -> tuple[float, float]:
    """Median µs of `remember` and of `place` of `count` values of `nbytes`, the cache full and evicting."""
    cache: Any = cls(CAPACITY)
    rng = np.random.default_rng(0)
    values = [[rng.integers(0, 256, nbytes, dtype=np.uint8)] for _ in range(count)]
    outs = [np.empty(nbytes, np.uint8) for _ in range(count)]
    stored = [True] * count
    serial = iter(range(1 << 40))

    def keys() -> list[bytes]:
        return [b"key-%d" % next(serial) for _ in range(count)]

    for _ in range(2 * CAPACITY // (count * nbytes) + 1):  # fill past the capacity: the timed calls evict
        cache.remember(keys(), values, stored)
    calls = max(20, min(500, (64 << 20) // (count * nbytes)))
    remember, place = [], []
    for _ in range(calls):
        batch = keys()
        start = time.perf_counter()
        cache.remember(batch, values, stored)
        middle = time.perf_counter()
        cache.place(batch, outs)
        remember.append(middle - start)
        place.append(time.perf_counter() - middle)
    return statistics.median(remember) * 1e6, statistics.median(place) * 1e6


def again_us(cls: type, nbytes: int) -> float:
    """Median µs of `remember` of one key saved again and again."""
    cache: Any = cls(CAPACITY)
    value = [[np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)]]
    return median_us(lambda: cache.remember([b"same"], value, [True]), 400)


def copy_us(count: int, nbytes: int) -> float:
    source, target = np.ones(count * nbytes, np.uint8), np.empty(count * nbytes, np.uint8)
    return median_us(lambda: np.copyto(target, source), 200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="another commit whose ReadCache is measured beside this tree's")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-results", action="store_true", help="do not write perf/results/read_cache.json")
    args = parser.parse_args()
    where = machine()  # (its load average: before the rounds)
    sides: dict[str, type] = {"this tree": ReadCache}
    if args.against:
        sides[args.against] = cache_class_at(args.against)
    rows = [f"{count} x {nbytes >> 10} KiB" for count, nbytes in SHAPES] + ["one key saved again, 1024 KiB"]
    measured: dict[tuple[str, str], list[tuple[float, float]]] = {}
    copies: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        order = list(sides.items()) if round_ % 2 == 0 else list(reversed(sides.items()))
        for name, cls in order:
            for row, (count, nbytes) in zip(rows, SHAPES):
                measured.setdefault((name, row), []).append(shape_us(cls, count, nbytes))
            measured.setdefault((name, rows[-1]), []).append((again_us(cls, 1 << 20), float("nan")))
        for row, (count, nbytes) in zip(rows, SHAPES):
            copies.setdefault(row, []).append(copy_us(count, nbytes))
        copies.setdefault(rows[-1], []).append(copy_us(1, 1 << 20))

    def med(name: str, row: str, i: int) -> float:
        return statistics.median(x[i] for x in measured[(name, row)])

    names = list(sides)
    header = "| call | plain copy µs | " + " | ".join(f"{n}: remember / place µs" for n in names)
    header += " | remember / plain copy |" + (f" remember, this tree / {names[1]} |" if len(names) > 1 else "")
    print(header + "\n|" + "---|" * (header.count("|") - 1))
    figures = []
    for row in rows:
        copy = statistics.median(copies[row])
        cells = [f"{med(n, row, 0):.0f} / {med(n, row, 1):.0f}".replace(" / nan", "") for n in names]
        line = f"| {row} | {copy:.0f} | " + " | ".join(cells) + f" | {med(names[0], row, 0) / copy:.2f}x |"
        if len(names) > 1:
            ratios = [a[0] / b[0] for a, b in zip(measured[(names[0], row)], measured[(names[1], row)])]
            line += f" {statistics.median(ratios):.2f}x |"
            figures.append(
                Figure(
                    f"read cache remember, {row}",
                    med(names[0], row, 0),
                    "µs",
                    f"ReadCache at {names[1]}",
                    med(names[1], row, 0),
                    Goal("<=", 1.05),
                    "perf/read_cache.png",
                    f"{args.rounds} rounds",
                )
            )
        figures.append(
            Figure(
                f"read cache remember, {row}, next to a plain copy",
                med(names[0], row, 0),
                "µs",
                "np.copyto of the bytes",
                copy,
                None,
                "perf/read_cache.png",
                f"{args.rounds} rounds",
            )
        )
        print(line)
    plot(rows, names, med, copies)
    run = Run("read_cache", command_line(), figures, machine=where)
    if not args.no_results:
        print(markdown(run))
        print(f"results: {record(run)}")


def plot(rows: list[str], names: list[str], med: Callable[[str, str, int], float], copies: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / (len(names) + 1)
    at = np.arange(len(rows))
    for i, name in enumerate(names):
        ax.bar(at + i * width, [med(name, row, 0) for row in rows], width, label=f"remember, {name}")
    ax.bar(at + len(names) * width, [statistics.median(copies[row]) for row in rows], width, label="plain copy")
    ax.set_xticks(at + width * len(names) / 2, rows, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("µs per call (median)")
    ax.set_title("The client's read cache: keeping a save's values")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "read_cache.png", dpi=110)


if __name__ == "__main__":
    main()

"""What a paced background thread (`ems.buffers.SpareCpuPacer`: a pool node populating its arena, or a region, on
spare CPU) costs while it waits for a spare core that does not come: its looks at the host per second and its own
CPU time, with the pacer's back-off next to a fixed 30 ms window (the pacer before it backed off).

Contract: `python perf/bench_pacer.py [--seconds S] [--no-results]`. One spinning process per core keeps every core
busy; the pacer, in this process, runs 2 ms steps for S seconds (default 5) each way in turn: `backoff` (the
package's pacer) and `fixed` (the same class with `MAX_WINDOW_S = WINDOW_S`: a look every 30 ms). Reports looks per
second (each reads /proc/stat), the thread's CPU per second outside its steps, the steps that ran and the seconds it
waited. Prints a table, saves perf/pacer.png, records perf/results/pacer.json (perf/results.py).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

from results import Figure, Goal, Run, command_line, markdown, record

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's package, before an installed one

from ems.buffers import SpareCpuPacer  # noqa: E402

STEP_S = 0.002


class FixedWindowPacer(SpareCpuPacer):
    """The pacer without its back-off: every look one `WINDOW_S` after the last."""

    MAX_WINDOW_S = SpareCpuPacer.WINDOW_S


class _Over(Exception):
    pass


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def waiting(pacer_class: type[SpareCpuPacer], seconds: float) -> dict[str, float]:
    """Paced 2 ms steps for `seconds` beside busy cores: looks/s, CPU ms/s outside the steps, steps, seconds waited."""
    looks = 0
    start = time.monotonic()

    def sleep(s: float) -> None:
        if time.monotonic() - start >= seconds:
            raise _Over
        time.sleep(min(s, max(0.0, seconds - (time.monotonic() - start))))

    pacer = pacer_class(sleep=sleep)
    sample = pacer._sample

    def counted() -> tuple[float | None, float, float]:
        nonlocal looks
        looks += 1
        return sample()

    pacer._sample = counted  # type: ignore[method-assign]
    steps, in_steps = 0, 0.0

    def step() -> None:
        nonlocal in_steps
        began = time.thread_time()
        _spin(STEP_S)
        in_steps += time.thread_time() - began

    cpu0 = time.thread_time()
    try:
        while time.monotonic() - start < seconds:
            pacer.run(step)
            steps += 1
    except _Over:
        pass
    cpu = time.thread_time() - cpu0 - in_steps
    elapsed = time.monotonic() - start
    return {"looks": looks / elapsed, "cpu_ms": cpu / elapsed * 1e3, "steps": steps, "waited_s": pacer.waited_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--no-results", action="store_true")
    args = ap.parse_args()
    hogs = [multiprocessing.Process(target=_spin, args=(2 * args.seconds + 3,)) for _ in range(os.cpu_count() or 1)]
    for hog in hogs:
        hog.start()
    try:
        time.sleep(0.5)  # the hogs are running
        rows = {"fixed": waiting(FixedWindowPacer, args.seconds), "backoff": waiting(SpareCpuPacer, args.seconds)}
    finally:
        for hog in hogs:
            hog.terminate()
            hog.join()
    lines = [
        "| pacer | looks at the host / s | CPU ms / s outside its steps | 2 ms steps run | seconds waited |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['looks']:.1f} | {r['cpu_ms']:.2f} | {r['steps']} | {r['waited_s']:.2f} |")
    print("\n".join(lines))
    _plot(rows, HERE / "pacer.png")
    fixed, backoff = rows["fixed"], rows["backoff"]
    figures = [
        Figure(
            "a waiting paced thread's looks at the host per second, back-off vs a fixed 30 ms window",
            backoff["looks"],
            "/s",
            "fixed 30 ms window",
            fixed["looks"],
            Goal("<=", 0.25),
            "perf/pacer.png",
            f"every core busy (one spinner per core), {args.seconds:.0f} s each, 2 ms steps",
        ),
        Figure(
            "a waiting paced thread's CPU outside its steps",
            backoff["cpu_ms"],
            "ms/s",
            "fixed 30 ms window",
            fixed["cpu_ms"],
            None,
            "perf/pacer.png",
        ),
    ]
    run = Run("pacer", command_line(), figures)
    print(markdown(run))
    if not args.no_results:
        print(f"results: {record(run)}")


def _plot(rows: dict[str, dict[str, float]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    names = list(rows)
    for ax, (key, title) in zip(axes, (("looks", "looks at the host / s"), ("cpu_ms", "CPU ms / s while waiting"))):
        ax.bar(names, [rows[n][key] for n in names], color=["#999999", "#3a7"])
        ax.set_title(title)
    fig.suptitle("a paced thread waiting beside busy cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

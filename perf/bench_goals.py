"""The data path's goals (issue 8) in one command: every goal next to what this machine measured.

Runs `bench_e2e.py` (save/load through the API on the embedded pool, next to a plain copy) and then `bench_pool.py`
(pool nodes over UCX next to raw UCXX, Redis and Mooncake Store; the API over UCX; per-call medians; requests in
flight), one after the other in child processes on this machine, reads the figures they write (`--json`), and prints
one table: goal, target, measured, its peer, met or not. Each ratio comes from one run of one script, its two sides
measured side by side (the machines here are shared and noisy: ratios are the figures to read). Appends the table,
with the command, to perf/RESULTS.md (the two scripts' own tables are printed above it, not appended), and writes
the figures to perf/results/goals.json (perf/results.py: the format every benchmark's results take).

Usage: python perf/bench_goals.py [--quick] [--no-mooncake] [--no-results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from results import Figure, Goal, Run, markdown, record

from ems.settings import DEFAULT_CHUNK_BYTES

HERE = Path(__file__).resolve().parent
DEFAULT_CHUNKS = f"{DEFAULT_CHUNK_BYTES >> 20}MiB"  # the API rows' EMS_CHUNK_BYTES that equals the default


def run(script: str, args: list[str], out: Path) -> dict:
    command = [sys.executable, str(HERE / script), *args, "--json", str(out)]
    print(f"$ {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=True, cwd=HERE.parent)
    return json.loads(out.read_text())


def goals(e2e: dict, pool: dict) -> tuple[list[Figure], list[str]]:
    """The goals as figures (perf/results.py: each next to the peer it was measured beside), and a line for each
    goal this run could not measure."""
    rows = {(r["block"], r["pool"]): r for r in e2e["rows"]}
    full, growing = rows[(16, "full")], rows[(16, "growing, arena")]
    api, raw, client = pool["api"][DEFAULT_CHUNKS], pool["api"]["raw"], pool["api"]["client"]
    one_chunk = pool["api"]["0"]
    redis = pool["rows"][0]
    per_call, in_flight = pool["per_call"], pool["in_flight"]
    blocks = pool["api"]["blocks"]
    figures = [
        Figure(
            "embedded save (full pool, 32 MiB, 16 tokens/block)",
            full["save"],
            "GB/s",
            "plain copy",
            full["copy"],
            Goal(">=", 0.6),
        ),
        Figure("embedded load (full pool)", full["load"], "GB/s", "plain copy", full["copy"], Goal(">=", 0.5)),
        Figure(
            "embedded save while the pool grows (arena)", growing["save"], "GB/s", "plain copy", growing["copy"], Goal(">=", 0.4)
        ),
        Figure(
            "embedded fixed cost of a 1-block save",
            e2e["fixed"]["save_us"],
            "µs",
            goal=Goal("<=", 60),
            note=f"load {e2e['fixed']['load_us']:.0f}, exists {e2e['fixed']['exists_us']:.0f} µs",
        ),
        Figure(
            f"API save over UCX (1 node, {blocks} x 1 MiB)",
            api["save"],
            "GB/s",
            "raw UCXX",
            raw["save"],
            Goal(">=", 0.8),
            note=f"one chunk {one_chunk['save'] / raw['save']:.2f}x, PoolClient alone {client['save'] / raw['save']:.2f}x",
        ),
        Figure(
            "API load over UCX",
            api["load"],
            "GB/s",
            "raw UCXX",
            raw["load"],
            Goal(">=", 0.8),
            note=f"one chunk {one_chunk['load'] / raw['load']:.2f}x, PoolClient alone {client['load'] / raw['load']:.2f}x",
        ),
        Figure("API load", api["load"], "GB/s", "Redis pipelined GET", redis["redis load"], Goal(">=", 2)),
        Figure("API save", api["save"], "GB/s", "Redis pipelined SET", redis["redis save"], Goal(">=", 1)),
    ]
    missing = []
    for op, word in (("save", "batch_put_from"), ("load", "batch_get_into")):
        peer = redis.get(f"mooncake {op}")
        if peer:
            figures.append(Figure(f"API {op}", api[op], "GB/s", f"Mooncake Store {word}", peer, Goal(">=", 1)))
        else:
            missing.append(f"API {op} / Mooncake Store {word}: {pool.get('mooncake_note') or 'not measured'}")
    exists, save1, load1 = per_call["exists"], per_call["save 1 MiB"], per_call["load 1 MiB"]
    figures += [
        Figure(
            "exists of 1 block over UCX, median",
            exists["ems"],
            "µs",
            goal=Goal("<=", 250),
            note=f"bare UCXX round trip {exists['raw']:.0f}, Redis {exists['redis']:.0f} µs",
        ),
        Figure(
            "save of 1 block (1 MiB) over UCX, median",
            save1["ems"],
            "µs",
            goal=Goal("<=", 1500),
            note=f"raw UCXX {save1['raw']:.0f}, Redis {save1['redis']:.0f} µs",
        ),
        Figure(
            "load of 1 block (1 MiB) over UCX, median",
            load1["ems"],
            "µs",
            goal=Goal("<=", 1500),
            note=f"raw UCXX {load1['raw']:.0f}, Redis {load1['redis']:.0f} µs",
        ),
        Figure(
            "1-block async saves to one node, 8 in flight",
            in_flight["8"],
            "saves/s",
            "1 at a time",
            in_flight["1"],
            Goal(">=", 3),
        ),
    ]
    return figures, missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run, not figures to record)")
    ap.add_argument("--no-mooncake", action="store_true")
    ap.add_argument("--no-results", action="store_true", help="do not append to perf/RESULTS.md")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        e2e = run("bench_e2e.py", ["--rounds", "3" if args.quick else "7", "--no-results"], Path(tmp) / "e2e.json")
        pool_args = (["--quick"] if args.quick else []) + (["--no-mooncake"] if args.no_mooncake else [])
        pool = run("bench_pool.py", pool_args, Path(tmp) / "pool.json")
    figures, missing = goals(e2e, pool)
    command = " ".join(["python", "perf/bench_goals.py"] + (argv if argv is not None else sys.argv[1:]))
    run_ = Run("goals", command, figures, machine=pool["machine"])
    text = markdown(run_) + "".join(f"\n\nNot measured: {line}" for line in missing)
    print()
    print(text)
    if args.no_results:
        return 0
    print(f"results: {record(run_)}")
    commit = run_.commit
    with (HERE / "RESULTS.md").open("a") as f:
        f.write(
            f"\n## Data-path goals (issue 8), measured in one command ({datetime.date.today()}, cpu, loopback)\n\n"
            f"Command: `{command}` at commit {commit}: `bench_e2e.py` ({e2e['clock']} clock) then `bench_pool.py`, "
            f"one after the other. Machine: {e2e['machine']} (at the start of bench_e2e); {pool['machine']} (at the "
            f"start of bench_pool). Each ratio's two sides were measured side by side in one run.\n\n{text}\n\n"
            f"API over UCX rows of this run:\n\n{pool['api_table']}\n\n{pool['api_stages']}\n\n"
            f"Embedded pool stages of this run (16 tokens/block):\n\n{e2e['stages']}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

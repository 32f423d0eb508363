"""The data path's goals (issue 8) in one command: every goal next to what this machine measured.

Runs `bench_e2e.py` (save/load through the API on the embedded pool, next to a plain copy) and then `bench_pool.py`
(pool nodes over UCX next to raw UCXX, Redis and Mooncake Store; the API over UCX; per-call medians; requests in
flight), one after the other in child processes on this machine, reads the figures they write (`--json`), and prints
one table: goal, target, measured, its peer, met or not. Each ratio comes from one run of one script, its two sides
measured side by side (the machines here are shared and noisy: ratios are the figures to read). Appends the table,
with the command, to perf/RESULTS.md (the two scripts' own tables are printed above it, not appended).

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

from ems.config import DEFAULT_CHUNK_BYTES

HERE = Path(__file__).resolve().parent
DEFAULT_CHUNKS = f"{DEFAULT_CHUNK_BYTES >> 20}MiB"  # the API rows' EMS_CHUNK_BYTES that equals the default


def run(script: str, args: list[str], out: Path) -> dict:
    command = [sys.executable, str(HERE / script), *args, "--json", str(out)]
    print(f"$ {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=True, cwd=HERE.parent)
    return json.loads(out.read_text())


def goals(e2e: dict, pool: dict) -> list[tuple[str, str, float, str, bool | None]]:
    """(goal, target, measured, how it was measured, met) per goal; met None: not measured here."""
    rows = {(r["block"], r["pool"]): r for r in e2e["rows"]}
    full, growing = rows[(16, "full")], rows[(16, "growing, arena")]
    api, raw, client = pool["api"][DEFAULT_CHUNKS], pool["api"]["raw"], pool["api"]["client"]
    one_chunk = pool["api"]["0"]
    redis = pool["rows"][0]
    per_call, in_flight = pool["per_call"], pool["in_flight"]
    out: list[tuple[str, str, float, str, bool | None]] = [
        (
            "embedded save / plain copy (full pool, 32 MiB, 16 tokens/block)",
            ">= 0.6",
            full["save/copy"],
            f"{full['save']:.2f} vs {full['copy']:.2f} GB/s",
            full["save/copy"] >= 0.6,
        ),
        (
            "embedded load / plain copy (full pool)",
            ">= 0.5",
            full["load/copy"],
            f"{full['load']:.2f} vs {full['copy']:.2f} GB/s",
            full["load/copy"] >= 0.5,
        ),
        (
            "embedded save / plain copy while the pool grows (arena)",
            ">= 0.4",
            growing["save/copy"],
            f"{growing['save']:.2f} vs {growing['copy']:.2f} GB/s",
            growing["save/copy"] >= 0.4,
        ),
        (
            "embedded fixed cost of a 1-block save (µs)",
            "<= 60",
            e2e["fixed"]["save_us"],
            f"load {e2e['fixed']['load_us']:.0f}, exists {e2e['fixed']['exists_us']:.0f} µs",
            e2e["fixed"]["save_us"] <= 60,
        ),
        (
            f"API save over UCX / raw UCXX (1 node, {pool['api']['blocks']} x 1 MiB)",
            ">= 0.8",
            api["save"] / raw["save"],
            f"{api['save']:.2f} vs {raw['save']:.2f} GB/s (one chunk {one_chunk['save'] / raw['save']:.2f}x, "
            f"PoolClient alone {client['save'] / raw['save']:.2f}x)",
            api["save"] / raw["save"] >= 0.8,
        ),
        (
            "API load over UCX / raw UCXX",
            ">= 0.8",
            api["load"] / raw["load"],
            f"{api['load']:.2f} vs {raw['load']:.2f} GB/s (one chunk {one_chunk['load'] / raw['load']:.2f}x, "
            f"PoolClient alone {client['load'] / raw['load']:.2f}x)",
            api["load"] / raw["load"] >= 0.8,
        ),
        (
            "API load / Redis pipelined GET",
            ">= 2",
            api["load"] / redis["redis load"],
            f"{api['load']:.2f} vs {redis['redis load']:.2f} GB/s",
            api["load"] / redis["redis load"] >= 2,
        ),
        (
            "API save / Redis pipelined SET",
            ">= 1",
            api["save"] / redis["redis save"],
            f"{api['save']:.2f} vs {redis['redis save']:.2f} GB/s",
            api["save"] / redis["redis save"] >= 1,
        ),
    ]
    for op, word in (("save", "batch_put_from"), ("load", "batch_get_into")):
        peer = redis.get(f"mooncake {op}")
        if peer:
            out.append(
                (
                    f"API {op} / Mooncake Store {word}",
                    ">= 1",
                    api[op] / peer,
                    f"{api[op]:.2f} vs {peer:.2f} GB/s",
                    api[op] / peer >= 1,
                )
            )
        else:
            out.append(
                (f"API {op} / Mooncake Store {word}", ">= 1", float("nan"), pool.get("mooncake_note") or "not measured", None)
            )
    exists, save1, load1 = per_call["exists"], per_call["save 1 MiB"], per_call["load 1 MiB"]
    out += [
        (
            "exists of 1 block over UCX, median µs",
            "<= 250",
            exists["ems"],
            f"bare UCXX round trip {exists['raw']:.0f}, Redis {exists['redis']:.0f} µs",
            exists["ems"] <= 250,
        ),
        (
            "save of 1 block (1 MiB) over UCX, median µs",
            "<= 1500",
            save1["ems"],
            f"raw UCXX {save1['raw']:.0f}, Redis {save1['redis']:.0f} µs",
            save1["ems"] <= 1500,
        ),
        (
            "load of 1 block (1 MiB) over UCX, median µs",
            "<= 1500",
            load1["ems"],
            f"raw UCXX {load1['raw']:.0f}, Redis {load1['redis']:.0f} µs",
            load1["ems"] <= 1500,
        ),
        (
            "1-block async saves to one node: 8 in flight / 1 at a time",
            ">= 3",
            in_flight["8"] / in_flight["1"],
            f"{in_flight['8']:.0f} vs {in_flight['1']:.0f} saves/s",
            in_flight["8"] / in_flight["1"] >= 3,
        ),
    ]
    return out


def table(rows: list[tuple[str, str, float, str, bool | None]]) -> str:
    lines = ["| goal | target | measured | side by side | met |", "|---|---|---|---|---|"]
    for goal, target, value, detail, met in rows:
        shown = "—" if value != value else (f"{value:.0f}" if abs(value) >= 10 else f"{value:.2f}")
        lines.append(f"| {goal} | {target} | {shown} | {detail} | {'—' if met is None else 'yes' if met else 'no'} |")
    return "\n".join(lines)


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
    text = table(goals(e2e, pool))
    print()
    print(text)
    if args.no_results:
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    command = " ".join(["python", "perf/bench_goals.py"] + (argv if argv is not None else sys.argv[1:]))
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

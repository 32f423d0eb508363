"""A same-host `exists` through the public API on each path a lookup can take: the region's channel (a Unix socket
round trip), the connection's lookup channel (a TCP socket of its own, as between hosts) and UCX.

Contract: `python perf/bench_exists.py [--calls N] [--rounds R] [--no-results]`. Two `python -m ems.pool` nodes on
127.0.0.1 (one with `--lookup-port off`) and one client process; each round starts, in turn, a client with
`EMS_POOL_SHM=auto` (a same-host node's lookups travel on the region's channel once a save has opened it), one with
`EMS_POOL_SHM=off` against the first node (on the lookup channel) and one with `EMS_POOL_SHM=off` against the
second (every request over UCX), and times N one-block `ContextCaching.exists` calls after a warm-up (median per
round). The figures are the medians over rounds of each channel's medians, next to UCX's from the same rounds.
Prints a table and records the run in perf/results/exists.json (perf/results.py); the command and figures are
appended to perf/RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from results import Figure, Goal, Run, command_line, markdown, record

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent / "tests" / "pool")]

from ems_testlib import make_cache  # noqa: E402
from pool_testlib import PoolProcess  # noqa: E402

from ems import CcConfig, Ems, EmsConfig  # noqa: E402


def median_exists_us(address: str, shm: str, calls: int) -> float:
    """The median of `calls` one-block lookups (µs) from a fresh client with EMS_POOL_SHM=`shm`."""
    os.environ["EMS_POOL_SHM"] = shm
    Ems.init(
        EmsConfig(
            cc_config=CcConfig(rank_id=0, device_id=0, model_id="bench-exists"), pool_nodes=[address], read_cache_capacity=0
        )
    )
    try:
        cc = Ems.get_cc()
        if cc is None:
            raise RuntimeError("Ems.init gave no ContextCaching")
        cc.register_kvcache(make_cache(layers=2, blocks=8, block_size=4))
        if cc.save(list(range(4)), [7], [4]).success != 1:  # (opens the region where there is one)
            raise RuntimeError("the block was not saved")
        for _ in range(300):
            cc.exists([7])
        times = []
        for _ in range(calls):
            start = time.perf_counter_ns()
            hits = cc.exists([7]).success
            times.append(time.perf_counter_ns() - start)
            if hits != 1:
                raise RuntimeError("the block was not found")
        return statistics.median(times) / 1000
    finally:
        Ems.shutdown()
        os.environ.pop("EMS_POOL_SHM", None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-results", action="store_true", help="do not write perf/results/exists.json")
    args = ap.parse_args()
    node, ucx_only = PoolProcess("64MiB"), PoolProcess("64MiB", args=("--lookup-port", "off"))
    channel, lookup, ucx = [], [], []
    try:
        for _ in range(args.rounds):
            channel.append(median_exists_us(node.address, "auto", args.calls))
            lookup.append(median_exists_us(node.address, "off", args.calls))
            ucx.append(median_exists_us(ucx_only.address, "off", args.calls))
    finally:
        node.kill()
        ucx_only.kill()
    print("| round | region's channel µs | lookup channel µs | UCX µs |\n|---|---|---|---|")
    for i, (c, lk, u) in enumerate(zip(channel, lookup, ucx), 1):
        print(f"| {i} | {c:.0f} | {lk:.0f} | {u:.0f} |")
    run = Run(
        "exists",
        command_line(),
        [
            Figure(
                "same-host exists of 1 block through the API, on the region's channel (median)",
                statistics.median(channel),
                "µs",
                "the same over UCX (EMS_POOL_SHM=off, a node with --lookup-port off)",
                statistics.median(ucx),
                Goal("<", 1.0),
                note=f"{args.rounds} rounds of {args.calls} calls, in turn",
            ),
            Figure(
                "same-host exists of 1 block through the API, on the lookup channel (EMS_POOL_SHM=off, median)",
                statistics.median(lookup),
                "µs",
                "the same over UCX (EMS_POOL_SHM=off, a node with --lookup-port off)",
                statistics.median(ucx),
                Goal("<", 1.0),
                note=f"{args.rounds} rounds of {args.calls} calls, in turn",
            ),
        ],
    )
    print(markdown(run))
    if not args.no_results:
        print(f"results: {record(run)}")


if __name__ == "__main__":
    main()

"""A small load beside large asynchronous loads in flight, against the same load alone: what an engine's in-step
load pays when asynchronous loads of the same client are under way (the vLLM step policy's next-step placement rests
on it: docs/concepts/vllm-step-policy.md), with the loads served by the node and by the client's read cache.

Contract: `python perf/bench_beside.py [--small 3] [--large 35] [--in-flight 1,3] [--repeats 20] [--no-results]`.
One `python -m ems.pool` node on 127.0.0.1 (same-host shared memory, as deployed), one client process
(`Ems.init(pool_nodes=[the node])`) with a registered CPU cache of 1 MiB blocks (8 layers x K/V x 32 tokens x 8
heads x 64 float32: the serving benchmark's model). Two sources, one after the other: `node` (the blocks saved
without the client's read cache, `write_rcache` off: every load is served by the node, as another engine's blocks
are) and `read cache` (the same blocks saved again into it: every load is served from this process). Rows of each,
`--repeats` times after a warm-up, medians and p90:
* `alone`: `ContextCaching.load` of `--small` blocks on the calling thread (the in-step load's call);
* `beside K`: the same load started right after K `async_load`s of `--large` blocks each (different blocks);
* `large K`: the K large loads alone, started together, until the last ends.
Prints a table, saves perf/beside.png, records perf/results/beside.json (perf/results.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's package, before an installed one
sys.path.insert(0, str(HERE.parent / "tests" / "pool"))

import torch  # noqa: E402
from benchlib import machine, percentile  # noqa: E402
from pool_testlib import PoolProcess  # noqa: E402
from results import Figure, Run, command_line, markdown, record  # noqa: E402

from ems import CcConfig, CcKvOption, Ems, EmsConfig  # noqa: E402

LAYERS, TOKENS, HEADS, HEAD_SIZE = 8, 32, 8, 64  # float32: 1 MiB a block


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", type=int, default=3, help="blocks of the small (in-step) load")
    parser.add_argument("--large", type=int, default=35, help="blocks of each large asynchronous load")
    parser.add_argument("--in-flight", default="1,3", help="comma-separated counts of large loads in flight")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-results", action="store_true", help="record nothing in perf/results")
    args = parser.parse_args()
    args.counts = [int(k) for k in args.in_flight.split(",") if k]
    if args.small < 1 or args.large < 1 or args.repeats < 1 or not args.counts or min(args.counts) < 1:
        parser.error("--small, --large, --repeats and every --in-flight count must be >= 1")
    return args


def slots(blocks: range | list[int]) -> list[int]:
    return [b * TOKENS + t for b in blocks for t in range(TOKENS)]


def main() -> None:
    args = parse_args()
    most = max(args.counts)
    stored = args.large * most + args.small  # blocks saved once, then loaded again and again
    num_blocks = 2 * stored + args.small
    node = PoolProcess(capacity=f"{2 * stored + 64}MiB")
    rows: dict[str, dict[str, list[float]]] = {}
    try:
        Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="beside"), pool_nodes=[node.address]))
        cc = Ems.get_cc()
        if cc is None:
            raise SystemExit("Ems.init gave no ContextCaching")
        cache = [[torch.randn(num_blocks, TOKENS, HEADS, HEAD_SIZE) for _ in range(2)] for _ in range(LAYERS)]
        cc.register_kvcache(cache)
        option = CcKvOption(timeout=10_000)
        hashes = list(range(1, stored + 1))
        small_hashes = hashes[-args.small :]
        small_into = list(range(stored, stored + args.small))  # loads write blocks past the saved ones
        large_into = [
            list(range(stored + args.small + k * args.large, stored + args.small + (k + 1) * args.large)) for k in range(most)
        ]

        def small() -> float:
            start = time.perf_counter()
            result = cc.load(slots(small_into), small_hashes, [TOKENS] * args.small, option)
            took = time.perf_counter() - start
            if result.success != args.small:
                raise SystemExit(f"a small load found {result.success} of {args.small} blocks")
            return took

        def start_large(count: int) -> list:
            return [
                cc.async_load(slots(large_into[k]), hashes[k * args.large : (k + 1) * args.large], [TOKENS] * args.large, option)
                for k in range(count)
            ]

        def wait(futures: list) -> None:
            for future in futures:
                if cc.get_result(future).success != args.large:
                    raise SystemExit("a large load came back short")

        for source, keep in (("node", False), ("read cache", True)):
            saved = cc.save(slots(range(stored)), hashes, [TOKENS] * stored, CcKvOption(timeout=10_000, write_rcache=keep))
            if saved.success != stored:
                raise SystemExit(f"the node stored {saved.success} of {stored} blocks")
            for _ in range(3):  # warm-up: connections, the region, the read paths
                wait(start_large(most))
                small()
            mine = rows[source] = {"alone": [small() for _ in range(args.repeats)]}
            for count in args.counts:
                beside = []
                for _ in range(args.repeats):
                    futures = start_large(count)
                    beside.append(small())
                    wait(futures)
                mine[f"beside {count}"] = beside
                together = []
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    wait(start_large(count))
                    together.append(time.perf_counter() - started)
                mine[f"large {count}"] = together
    finally:
        Ems.shutdown()
        node.cleanup()
    report(args, rows)


def report(args: argparse.Namespace, rows: dict[str, dict[str, list[float]]]) -> None:
    lines = [
        f"{args.small}-block load (1 MiB blocks) alone and beside K asynchronous {args.large}-block loads; {args.repeats} "
        f"repeats. Machine: {machine()}",
        "",
        "| served by | row | median ms | p90 ms | median / alone |",
        "|---|---|---|---|---|",
    ]
    figures = []
    for source, mine in rows.items():
        alone = statistics.median(mine["alone"])
        for name, values in mine.items():
            median = statistics.median(values)
            ratio = "-" if name.startswith("large") else f"{median / alone:.2f}x"
            lines.append(f"| {source} | {name} | {median * 1e3:.2f} | {percentile(values, 0.9) * 1e3:.2f} | {ratio} |")
        figures += [
            Figure(
                f"a {args.small}-block load beside {count} asynchronous {args.large}-block loads, served by the {source}",
                statistics.median(mine[f"beside {count}"]) * 1e3,
                "ms",
                "the same load alone",
                alone * 1e3,
                None,
                "perf/beside.png",
                f"medians of {args.repeats}, one node on loopback (shared memory), 1 MiB blocks",
            )
            for count in args.counts
        ]
    print("\n".join(lines))
    _plot(rows, HERE / "beside.png")
    run = Run("beside", command_line(), figures, machine=machine())
    print(markdown(run))
    if not args.no_results:
        print(f"results: {record(run)}")


def _plot(rows: dict[str, dict[str, list[float]]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(rows)
    for i, (source, mine) in enumerate(rows.items()):
        names = [n for n in mine if not n.startswith("large")]
        xs = [j + i * width for j in range(len(names))]
        ax.bar(xs, [statistics.median(mine[n]) * 1e3 for n in names], width, label=f"served by the {source} (median)")
        ax.scatter(xs, [percentile(mine[n], 0.9) * 1e3 for n in names], color="black", zorder=3, s=12)
        ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(names))], names)
    ax.set_ylabel("ms per small load (dots: p90)")
    ax.set_title("A small load alone and beside large asynchronous loads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()

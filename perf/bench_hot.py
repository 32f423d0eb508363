"""A hot prefix on real nodes (issue 46, item 3): how evenly a pool's nodes serve reads when every request loads the
same system prompt, with the client's hot copies off and on (`ems.backends.hot_reads`).

Setup: `--nodes` (default 16: 4 placement groups) `python -m ems.pool` processes on this machine (64 MiB each, node
metrics on), one client process. Two clients over the same nodes (2 replicas), side by side: copies off (at most 1
copy: a hot unit is read from its own group only, as before) and on (the default policy). A request loads a shared
system prompt (`--blocks` blocks of 32 KiB, one placement unit) and then its own prompt (as many blocks, its own
unit, saved beforehand); the two clients run `--requests` each, in turn. Per node, the values it was asked for (its
`ems_pool_get_hits_total` + `ems_pool_get_misses_total`, scraped before and after each request): the most asked
node over the mean, and the shared prompt's median load time. Copy writes are waited for after each request (their
cost is not in the loads' times; the nodes' PUT requests are counted apart).

Prints a table, writes perf/hot.png, records perf/results/hot.json.
Usage: python perf/bench_hot.py [--nodes 16] [--requests 48] [--blocks 64] [--quick]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "pool"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))  # this checkout's package, before an installed one

import ems.transport.ucx.config  # noqa: E402,F401,I001 - UCX environment before ucxx loads
import numpy as np  # noqa: E402
from benchlib import machine  # noqa: E402
from cluster_testlib import free_port  # noqa: E402
from ems_testlib import make_cache, slots_of_blocks  # noqa: E402
from pool_testlib import PoolProcess  # noqa: E402
from results import Figure, Goal, Run, command_line, record  # noqa: E402

from ems import CcConfig, CcKvOption, CcResult, ContextCaching, EmsConfig  # noqa: E402
from ems.backends.pool_client import PoolClient  # noqa: E402
from ems.cluster.hot import HotUnits  # noqa: E402
from ems.settings import resolve_settings  # noqa: E402
from ems.transport.ucx.remote import connect  # noqa: E402

HERE = Path(__file__).resolve().parent
BS = 16
NODE_CAPACITY = 64 << 20
OPTION = CcKvOption(timeout=10000)
SYSTEM = [(0x5157 << 40) | b for b in range(4096)]  # the shared system prompt's block hashes
_COUNTER = re.compile(r"^(ems_pool_get_(?:hits|misses)_total|ems_pool_requests_total\{[^}]*op=\"put\"[^}]*\})\s+(\S+)$", re.M)


def asked(metrics: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per node: the values it was asked for by GETs (hits + misses) and its PUT requests, so far."""
    gets, puts = np.zeros(len(metrics)), np.zeros(len(metrics))
    for i, address in enumerate(metrics):
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
            for name, value in _COUNTER.findall(r.read().decode()):
                if name.startswith("ems_pool_get"):
                    gets[i] += float(value)
                else:
                    puts[i] += float(value)
    return gets, puts


def open_cc(addresses: Sequence[str], cache: list, copies: bool) -> tuple[ContextCaching, PoolClient]:
    pool = PoolClient([connect(a, connect_timeout_ms=10000) for a in addresses], replicas=2)
    if not copies:
        pool.router.hot.hot = HotUnits(max_copies=1)  # (a hot unit's own group only: reads as before copies)
    cc = ContextCaching(
        CcConfig(rank_id=0, device_id=0, model_id="hot"), None, pool, resolve_settings(EmsConfig(pool_replicas=2))
    )
    cc.register_kvcache(cache)
    return cc, pool


def _ok(result: CcResult, blocks: int) -> None:
    if result.success != blocks:
        raise RuntimeError(f"{result.success} of {blocks} blocks")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests = 12
    blocks = args.blocks
    started = time.perf_counter()
    metrics = [f"127.0.0.1:{free_port()}" for _ in range(args.nodes)]
    starter = ThreadPoolExecutor(8)  # (a node dies with the thread that forked it: kept until the end)
    procs = list(
        starter.map(lambda m: PoolProcess(f"{NODE_CAPACITY >> 20}MiB", args=("--shm-bytes", "32MiB", "--metrics", m)), metrics)
    )
    print(f"{args.nodes} nodes up in {time.perf_counter() - started:.1f} s", flush=True)
    cache = make_cache(layers=4, blocks=2 * blocks, block_size=BS, heads=2, head_size=64)
    system_slots = slots_of_blocks(range(blocks), BS)
    own_slots = slots_of_blocks(range(blocks, 2 * blocks), BS)
    offsets = [BS] * blocks
    modes = (("copies off", False), ("copies on", True))
    rows: dict[str, dict] = {}
    clients: dict[str, tuple[ContextCaching, PoolClient]] = {}
    try:
        for mode, copies in modes:
            clients[mode] = open_cc([p.address for p in procs], cache, copies)
        own: dict[str, list[list[int]]] = {}
        for k, (mode, _) in enumerate(modes):
            cc = clients[mode][0]
            _ok(cc.save(system_slots, SYSTEM[:blocks], offsets, OPTION, chain_prefix=[]), blocks)
            own[mode] = [[(0x0A11 << 40) | (k << 36) | (r << 16) | b for b in range(blocks)] for r in range(args.requests)]
            for hashes in own[mode]:
                _ok(cc.save(own_slots, hashes, offsets, OPTION, chain_prefix=[]), blocks)
        reads = {mode: np.zeros(args.nodes) for mode, _ in modes}
        puts = {mode: np.zeros(args.nodes) for mode, _ in modes}
        times: dict[str, list[float]] = {mode: [] for mode, _ in modes}
        for r in range(args.requests):  # the two clients' requests in turn, each between two scrapes of the nodes
            for mode, _ in modes:
                cc, pool = clients[mode]
                gets0, puts0 = asked(metrics)
                t0 = time.perf_counter()
                _ok(cc.load(system_slots, SYSTEM[:blocks], offsets, OPTION, chain_prefix=[]), blocks)
                times[mode].append(time.perf_counter() - t0)
                _ok(cc.load(own_slots, own[mode][r], offsets, OPTION, chain_prefix=[]), blocks)
                pool.router.hot.idle(10.0)
                gets1, puts1 = asked(metrics)
                reads[mode] += gets1 - gets0
                puts[mode] += puts1 - puts0
        for mode, _ in modes:
            stats = clients[mode][1].router.hot.stats
            print(mode, stats, flush=True)
            rows[mode] = {
                "max_mean": float(reads[mode].max() / reads[mode].mean()),
                "nodes_read": float((reads[mode] > 0).sum()),
                "load_ms": statistics.median(times[mode]) * 1e3,
                "copy_puts": float(puts[mode].sum()),
                "copy_hits": float(stats.hits),
                "per_node": reads[mode].tolist(),
            }
    finally:
        for cc, pool in clients.values():
            cc.close()
            pool.close()
        for p in procs:
            p.kill()
        starter.shutdown()
    print()
    print(table(args, rows))
    plot(rows, HERE / "hot.png")
    if args.quick:
        return
    off, on = rows["copies off"], rows["copies on"]
    note = f"{args.nodes} nodes, 2 replicas, {args.requests} requests of a shared {blocks}-block prompt + their own"
    figures = [
        Figure(
            "most-asked node's reads / mean, hot copies on",
            on["max_mean"],
            "x",
            "copies off",
            off["max_mean"],
            Goal("<", 1),
            "perf/hot.png",
            note,
        ),
        Figure(
            "most-asked node's reads / mean, hot copies on (absolute)",
            on["max_mean"],
            "x",
            None,
            None,
            Goal("<=", 2),
            "perf/hot.png",
            note,
        ),
        Figure(
            "load of the shared prompt, copies on vs off",
            on["load_ms"],
            "ms",
            "copies off",
            off["load_ms"],
            None,
            "perf/hot.png",
            note + "; median",
        ),
    ]
    run = Run("hot", command_line(), figures, machine=machine())
    print(f"results: {record(run)}")


def table(args: argparse.Namespace, rows: dict) -> str:
    head = f"| {args.nodes} nodes, {args.requests} requests | reads max/mean per node | nodes read "
    lines = [
        head + "| shared prompt load (median) | copy PUTs | values read from copies |",
        "|---|---|---|---|---|---|",
    ]
    for mode, r in rows.items():
        cells = [f"{r['max_mean']:.2f}x", f"{r['nodes_read']:.0f}", f"{r['load_ms']:.1f} ms", f"{r['copy_puts']:.0f}"]
        lines.append(f"| {mode} | " + " | ".join(cells + [f"{r['copy_hits']:.0f}"]) + " |")
    return "\n".join(lines)


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    n = len(next(iter(rows.values()))["per_node"])
    x = np.arange(n)
    for k, (mode, r) in enumerate(rows.items()):
        per = np.asarray(r["per_node"])
        ax.bar(x + (k - 0.5) * 0.4, per / per.mean(), 0.4, label=f"{mode} (max {r['max_mean']:.2f}x)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("node")
    ax.set_ylabel("values asked / mean")
    ax.set_title("a shared system prompt on real nodes: reads per node")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()

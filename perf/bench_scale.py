"""One client, one 512-block prompt, pools of 2, 32 and 64 real nodes on loopback (issue 46): does a call's cost
grow with the pool?

Setup: `--nodes` (default 2 32 64) `python -m ems.pool` processes on this machine (64 MiB each, shared-memory
regions of 32 MiB a connection, so 64 fit in memory); for each pool size a `ContextCaching` over a `PoolClient` of
that many of them (2 replicas), a registered cache of 16-token blocks of 32 KiB (4 layers x K/V x 16 tokens x 2
heads x 64 x fp16). Per round and pool size, side by side: a save of 512 blocks, their load, and `exists` of their
512 hashes, each with `chain_prefix=[]` (placement by units: the prompt's 2 units on 2 x 4 nodes) and without (per-
block placement, as before units); medians of the rounds. First call: a fresh client's pool opening (nodes connected lazily, as
`Ems.init` does for more than `EAGER_CONNECT_NODES` nodes; at open for fewer) plus its first save (registration not
counted), against a steady save.

Before the rounds the pool is filled (`fill`: every node's store written about once over, as a pool in service is;
`--no-fill` measures empty nodes, whose first touches of fresh pages then count, more on the larger pools), and each
client's connections are warmed (`warm`: prompts saved by units until its calls have met each of its nodes, as a
client in service has: a connection's shared-memory region populates only a share of `PREFAULT_BYTES` ahead of use,
and its first calls fault the rest in).

Across hosts (`--hosts H`, root: network namespaces, `tests/pool/hosts_testlib.py`): the nodes on H node hosts
(interleaved, so that any first n of them spread over every host; several nodes a host on ports 7700 up), the
benchmark's client on a host of its own, every host's link 4 Gbit/s each way: no shared memory, every request on
the wire. The hosts are namespaces of this machine, so the nodes still share its cores.

Prints a table, writes perf/scale.png, records perf/results/scale.json (across hosts: perf/scale-hosts.png,
perf/results/scale-hosts.json).
Usage: python perf/bench_scale.py [--nodes 2 32 64] [--rounds 7] [--quick] [--no-fill] [--hosts H]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "pool"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))  # this checkout's package, before an installed one

import ems.transport.ucx.config  # noqa: E402,F401,I001 - UCX environment before ucxx loads
from benchlib import machine  # noqa: E402
from ems_testlib import make_cache, slots_of_blocks  # noqa: E402
from pool_testlib import PoolProcess  # noqa: E402
from results import Figure, Goal, Run, command_line, record  # noqa: E402

from ems import CcConfig, CcKvOption, CcResult, ContextCaching, EmsConfig  # noqa: E402
from ems.backends.pool_client import PoolClient  # noqa: E402
from ems.backends.remote_pool import EAGER_CONNECT_NODES  # noqa: E402
from ems.settings import resolve_settings  # noqa: E402
from ems.transport.ucx.client import UcxNode  # noqa: E402
from ems.transport.ucx.remote import connect  # noqa: E402

HERE = Path(__file__).resolve().parent
BLOCKS, BS = 512, 16
NODE_CAPACITY = 64 << 20  # each node's store
OPTION = CcKvOption(timeout=10000)


def open_cc(addresses: Sequence[str], cache: list) -> tuple[ContextCaching, PoolClient, float]:
    """A client over `addresses`, and the seconds its pool took to open (connecting, where it connects at open)."""
    # as `Ems.init` does: connected at open for a few nodes, else each on its first call
    opener = connect if len(addresses) <= EAGER_CONNECT_NODES else UcxNode
    started = time.perf_counter()
    nodes = [opener(a, connect_timeout_ms=10000) for a in addresses]
    pool = PoolClient(nodes, replicas=2)
    opened = time.perf_counter() - started
    cc = ContextCaching(
        CcConfig(rank_id=0, device_id=0, model_id="scale"), None, pool, resolve_settings(EmsConfig(pool_replicas=2))
    )
    cc.register_kvcache(cache)  # (not counted: the layout and the one-block path's warm-up, no pool call)
    return cc, pool, opened


def fill(cc: ContextCaching, nodes: int, slots: list[int], offsets: list[int], value_bytes: int) -> tuple[float, int]:
    """Save distinct prompts with per-block placement (which spreads over every node) until each node's store has
    been written about once over: a pool in service is full, its pages faulted in and its values recycled. On
    empty nodes a round's calls would pay the first touch of fresh arena pages (about 2 ms per MiB on this VM)
    and race the nodes' background populate for the cores, and on 32 nodes every round touches nodes it has not
    touched before, where on 2 nodes the first rounds fill them: the rounds would compare a cold pool with a warm
    one. `value_bytes`: one block's K and V of every layer. Returns the seconds it took and the MiB saved (the
    replicas' copies not counted)."""
    started = time.perf_counter()
    prompts = -(-NODE_CAPACITY * nodes // (2 * BLOCKS * value_bytes))  # 2 replicas: each value written twice
    for p in range(prompts):
        _ok(cc.save(slots, [(0xF111 << 44) | (p << 12) | b for b in range(BLOCKS)], offsets, OPTION))
    return time.perf_counter() - started, prompts * BLOCKS * value_bytes >> 20


def warm(cc: ContextCaching, nodes: int, slots: list[int], offsets: list[int]) -> float:
    """Save `nodes` distinct prompts by units (each on 2 groups of `UNIT_WIDTH` nodes, 2 replicas): about 8 calls
    meet each node, its connection made and its region's pages in use. Returns the seconds it took."""
    started = time.perf_counter()
    for p in range(nodes):
        hashes = [(0xE111 << 44) | (nodes << 32) | (p << 12) | b for b in range(BLOCKS)]
        _ok(cc.save(slots, hashes, offsets, OPTION, chain_prefix=[]))
    return time.perf_counter() - started


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def across_hosts(args: argparse.Namespace) -> None:
    """The run with the nodes on `args.hosts` namespace hosts and this benchmark's client on one more (see the
    module docstring): the nodes are made here, the client is this script again, run inside the client host."""
    from hosts_testlib import HostCluster, HostNode

    most = max(args.nodes)
    names = [f"n{i}" for i in range(args.hosts)]
    started = time.perf_counter()
    with HostCluster(["client", *names]) as hosts:
        starter = ThreadPoolExecutor(8)
        nodes: list[HostNode] = []
        try:
            nodes = list(
                starter.map(
                    lambda k: HostNode(
                        hosts, names[k % len(names)], capacity=f"{NODE_CAPACITY >> 20}MiB", port=HostNode.PORT + k // len(names)
                    ),
                    range(most),
                )
            )
            print(f"{most} nodes on {len(names)} hosts up in {time.perf_counter() - started:.1f} s", flush=True)
            argv = [sys.executable, str(Path(__file__).resolve()), "--addresses", ",".join(n.address for n in nodes)]
            argv += ["--nodes", *map(str, args.nodes), "--rounds", str(args.rounds)]
            argv += (["--quick"] if args.quick else []) + (["--no-fill"] if args.no_fill else [])
            client = hosts.popen("client", argv)
            if client.wait() != 0:
                raise RuntimeError(f"the client's run failed ({client.returncode})")
        finally:
            for node in nodes:
                node.cleanup()
            starter.shutdown()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 32, 64])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-fill", action="store_true", help="measure on empty nodes (their arenas' first touches included)")
    ap.add_argument("--hosts", type=int, default=0, help="node hosts (network namespaces); 0: every node on loopback")
    ap.add_argument("--addresses", help=argparse.SUPPRESS)  # (the client's run across hosts: the nodes made for it)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = 2
    most = max(args.nodes)
    if args.hosts:
        across_hosts(args)
        return
    started = time.perf_counter()
    # started in parallel; the starting threads live as long as the nodes (a node dies with the thread that forked it)
    starter = ThreadPoolExecutor(8)
    procs: list[PoolProcess] = []
    if args.addresses:
        addresses = args.addresses.split(",")
    else:
        procs = list(starter.map(lambda _: PoolProcess(f"{NODE_CAPACITY >> 20}MiB", args=("--shm-bytes", "32MiB")), range(most)))
        addresses = [p.address for p in procs]
        print(f"{most} nodes up in {time.perf_counter() - started:.1f} s", flush=True)
    name = "scale-hosts" if args.addresses else "scale"
    cache = make_cache(layers=4, blocks=BLOCKS, block_size=BS, heads=2, head_size=64)
    slots = slots_of_blocks(range(BLOCKS), BS)
    offsets = [BS] * BLOCKS
    results: dict[tuple[int, str, str], list[float]] = {}
    first: dict[int, list[float]] = {n: [] for n in args.nodes}
    clients = {}
    try:
        for n in args.nodes:
            clients[n] = open_cc(addresses[:n], cache)[:2]
        if not args.no_fill:
            block_bytes = sum(plane[0].nbytes for layer in cache for plane in layer)
            fill_s, fill_mib = fill(clients[most][0], most, slots, offsets, block_bytes)
            print(f"filled: {fill_mib} MiB saved over the {most} nodes in {fill_s:.1f} s", flush=True)
            for n in args.nodes:
                print(f"{n} nodes' client warmed in {warm(clients[n][0], n, slots, offsets):.1f} s", flush=True)
        for r in range(args.rounds):
            for n in args.nodes:
                cc, _ = clients[n]
                for mode, extra in (("units", {"chain_prefix": []}), ("per key", {})):
                    hashes = [(r + 1) << 40 | (n << 20) | b | (1 << 19 if mode == "units" else 0) for b in range(BLOCKS)]
                    save = timed(lambda: _ok(cc.save(slots, hashes, offsets, OPTION, **extra)))
                    load = timed(lambda: _ok(cc.load(slots, hashes, offsets, OPTION, **extra)))
                    exists = timed(lambda: _ok(cc.exists(hashes, OPTION, **extra)))
                    for op, t in (("save", save), ("load", load), ("exists", exists)):
                        results.setdefault((n, mode, op), []).append(t)
                # first call: a fresh client's first save (its connections made on the way)
                hashes = [(r + 1) << 40 | (n << 20) | (1 << 18) | b for b in range(BLOCKS)]
                fresh, fresh_pool, opened = open_cc(addresses[:n], cache)
                first[n].append(opened + timed(lambda: _ok(fresh.save(slots, hashes, offsets, OPTION, chain_prefix=[]))))
                fresh.close()
                fresh_pool.close()
            print(f"round {r + 1}/{args.rounds}", flush=True)
    finally:
        for cc, pool in clients.values():
            cc.close()
            pool.close()
        for p in procs:
            p.kill()
        starter.shutdown()
    med = {k: statistics.median(v) for k, v in results.items()}
    first_med = {n: statistics.median(v) for n, v in first.items()}
    print()
    print(table(args.nodes, med, first_med))
    plot(args.nodes, med, first_med, HERE / f"{name}.png")
    if args.quick:
        return
    small, large = min(args.nodes), [n for n in args.nodes if n != min(args.nodes)]
    figures = []
    for n in large:
        for op in ("save", "load", "exists"):
            figures.append(
                Figure(
                    f"{op} of {BLOCKS} blocks, {n} nodes vs {small} (units)",
                    med[(n, "units", op)] * 1e3,
                    "ms",
                    f"{small} nodes",
                    med[(small, "units", op)] * 1e3,
                    Goal("<=", 1.3),
                    f"perf/{name}.png",
                    f"medians of {args.rounds} rounds, 2 replicas, 32 KiB values, chain_prefix=[]",
                )
            )
            figures.append(
                Figure(
                    f"{op} of {BLOCKS} blocks, {n} nodes vs {small} (per key, before units)",
                    med[(n, "per key", op)] * 1e3,
                    "ms",
                    f"{small} nodes",
                    med[(small, "per key", op)] * 1e3,
                    None,
                    f"perf/{name}.png",
                    f"medians of {args.rounds} rounds, no chain_prefix",
                )
            )
        figures.append(
            Figure(
                f"first call on {n} nodes vs a steady save",
                first_med[n] * 1e3,
                "ms",
                "steady save",
                med[(n, "units", "save")] * 1e3,
                Goal("<=", 3),
                f"perf/{name}.png",
                f"a fresh client through its first save (connections {'lazy' if n > EAGER_CONNECT_NODES else 'at open'})",
            )
        )
    run = Run(name, command_line(), figures, machine=machine())
    print(f"results: {record(run)}")


def _ok(result: CcResult) -> None:
    if result.success != result.total:
        raise RuntimeError(f"{result.success} of {result.total}")


def table(nodes: Sequence[int], med: dict, first: dict) -> str:
    lines = ["| nodes | placement | save ms | load ms | exists ms | first call ms |", "|---|---|---|---|---|---|"]
    small = min(nodes)
    for n in nodes:
        for mode in ("units", "per key"):
            cells = []
            for op in ("save", "load", "exists"):
                v = med[(n, mode, op)]
                ratio = "" if n == small else f" ({v / med[(small, mode, op)]:.2f}x)"
                cells.append(f"{v * 1e3:.1f}{ratio}")
            fc = f"{first[n] * 1e3:.1f} ({first[n] / med[(n, 'units', 'save')]:.1f}x a save)" if mode == "units" else ""
            lines.append(f"| {n} | {mode} | " + " | ".join(cells) + f" | {fc} |")
    return "\n".join(lines)


def plot(nodes: Sequence[int], med: dict, first: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for ax, op in zip(axes, ("save", "load", "exists")):
        for mode, style in (("units", "o-"), ("per key", "s--")):
            ax.plot([str(n) for n in nodes], [med[(n, mode, op)] * 1e3 for n in nodes], style, label=mode)
        ax.set_title(f"{op}, {BLOCKS} blocks of 32 KiB (ms)")
        ax.set_xlabel("pool nodes")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

"""A pool on etcd: save/load GB/s with replicas=2 next to replicas=1 on the same three nodes, and how long engines
take to see a node join or leave. Everything runs on this machine (loopback), side by side in one run.

* Three `python -m ems.pool --etcd ...` nodes registered in a local etcd; two `PoolClient`s opened through
  `ems.backends.remote_pool.open_remote_pool` (the engine's path) with `pool_replicas` 1 and 2, measured alternately per value
  size (best of the rounds). GB/s counts the caller's bytes once: with 2 replicas the nodes receive twice as much.
* Join: a fourth node (started without --etcd) is registered with `Registration` (what `--etcd` does), and the
  time until the engine's placement includes it — connecting to it included — is measured; leave: deregistration
  (what SIGTERM does) until placement drops it; expiry: a registered node is SIGKILLed and the time until its lease
  (`--lease-ttl 2`) runs out and placement drops it.

Prints a table, writes perf/cluster.png. Usage: python perf/bench_cluster.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "pool"))
sys.path.insert(0, str(ROOT / "tests" / "ems"))

from benchlib import machine  # noqa: E402
from cluster_testlib import ClusterNode, EtcdProcess  # noqa: E402
from pool_testlib import PoolProcess, make_values  # noqa: E402

import ems.transport.ucx.config  # noqa: E402,F401 - UCX environment before ucxx loads
from ems.backends.base import PoolCall  # noqa: E402
from ems.backends.pool_client import PoolClient  # noqa: E402
from ems.backends.remote_pool import open_remote_pool  # noqa: E402
from ems.cluster.membership import NodeInfo, Registration, wait_for  # noqa: E402
from ems.config import EmsConfig  # noqa: E402
from ems.settings import resolve_settings  # noqa: E402
from ems.transport.ucx.remote import connect  # noqa: E402
from ems.types import CcKvOption  # noqa: E402

SIZES = [256 << 10, 1 << 20, 4 << 20]
CLUSTER = "bench"


def _open(etcd_url: str, replicas: int) -> PoolClient:
    settings = resolve_settings(
        EmsConfig(pool_etcd=etcd_url, pool_cluster=CLUSTER, pool_replicas=replicas, read_cache_capacity=0)
    )
    return open_remote_pool(settings, lambda address: connect(address, connect_timeout_ms=5000))


def _has(pool: PoolClient, address: str) -> bool:
    return address in pool.members.view.addresses


def membership_times(etcd: EtcdProcess, pool: PoolClient, rounds: int) -> dict:
    extra = PoolProcess("64MiB")
    joins, leaves = [], []
    try:
        for _ in range(rounds):
            reg = Registration(etcd.url, CLUSTER, NodeInfo(extra.address), ttl_s=2)
            t0 = time.perf_counter()
            reg.start()
            if not wait_for(lambda: _has(pool, extra.address), 10, 0.001):
                raise RuntimeError("the join was not seen")
            joins.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            reg.deregister()
            if not wait_for(lambda: not _has(pool, extra.address), 10, 0.001):
                raise RuntimeError("the leave was not seen")
            leaves.append(time.perf_counter() - t0)
    finally:
        extra.cleanup()
    victim = ClusterNode(etcd.url, CLUSTER, capacity="64MiB")
    try:
        wait_for(lambda: _has(pool, victim.address), 10, 0.001)
        t0 = time.perf_counter()
        victim.kill()
        wait_for(lambda: not _has(pool, victim.address), 15, 0.005)
        expiry = time.perf_counter() - t0
    finally:
        victim.cleanup()
    return {
        "join": statistics.median(joins),
        "leave": statistics.median(leaves),
        "expiry": expiry,
        "join_max": max(joins),
        "leave_max": max(leaves),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller batches and fewer rounds")
    parser.add_argument("--batch-mib", type=int, default=32, help="bytes per call, MiB")
    args = parser.parse_args()
    batch = (8 if args.quick else args.batch_mib) << 20
    rounds = 2 if args.quick else 4
    option = CcKvOption(timeout=60_000, write_rcache=False)
    print(machine(), flush=True)

    etcd = EtcdProcess()
    nodes = [ClusterNode(etcd.url, CLUSTER, capacity="1GiB") for _ in range(3)]
    pools = {k: _open(etcd.url, k) for k in (1, 2)}
    rows = []
    try:
        for pool in pools.values():
            if not wait_for(lambda p=pool: len(p.nodes) == 3, 10):
                raise RuntimeError("the engines do not see three nodes")
        for size in SIZES:
            n = max(2, batch // size)
            values = make_values(n, size - 40, seed=size)
            total = n * size
            best = {(k, op): float("inf") for k in pools for op in ("save", "load")}
            for r in range(rounds):  # alternate the two so both see the same machine noise
                for k, pool in pools.items():
                    keys = [f"r{k}-{size}-{r}-{i}".encode() for i in range(n)]
                    t0 = time.perf_counter()
                    put = pool.put(PoolCall(keys, keys, option), values)
                    best[(k, "save")] = min(best[(k, "save")], time.perf_counter() - t0)
                    if not all(put.results):
                        raise RuntimeError(f"replicas={k}: a save failed: {put.errors}")
                    t0 = time.perf_counter()
                    got = pool.get(PoolCall(keys, keys, option))
                    best[(k, "load")] = min(best[(k, "load")], time.perf_counter() - t0)
                    if any(v is None for v in got.results):
                        raise RuntimeError(f"replicas={k}: a value did not come back: {got.errors}")
            row = {"size": size, **{f"r{k} {op}": total / t / 1e9 for (k, op), t in best.items()}}
            rows.append(row)
            print(f"{size >> 10:>6} KiB  " + "  ".join(f"{c} {row[c]:.2f}" for c in COLUMNS), flush=True)
        times = membership_times(etcd, pools[1], rounds=5 if not args.quick else 2)
    finally:
        for pool in pools.values():
            pool.close()
        for node in nodes:
            node.cleanup()
        etcd.cleanup()
    print()
    print(table(rows, times))
    plot(rows, ROOT / "perf" / "cluster.png")


COLUMNS = ["r1 save", "r2 save", "r1 load", "r2 load"]


def table(rows: list, times: dict) -> str:
    lines = [
        "| value | replicas=1 save | replicas=2 save | r2/r1 save | replicas=1 load | replicas=2 load | r2/r1 load |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size'] >> 10} KiB | {r['r1 save']:.2f} | {r['r2 save']:.2f} | {r['r2 save'] / r['r1 save']:.2f}x"
            f" | {r['r1 load']:.2f} | {r['r2 load']:.2f} | {r['r2 load'] / r['r1 load']:.2f}x |"
        )
    lines += [
        "",
        "| membership change seen by an engine | median | max |",
        "|---|---|---|",
        f"| join (register → in placement, connect included) | {1e3 * times['join']:.1f} ms | {1e3 * times['join_max']:.1f} ms |",
        f"| leave (deregister on SIGTERM → out of placement) | {1e3 * times['leave']:.1f} ms |"
        f" {1e3 * times['leave_max']:.1f} ms |",
        f"| crash (SIGKILL, lease TTL 2 s → out of placement) | {times['expiry']:.2f} s | |",
    ]
    return "GB/s of the caller's bytes (best of rounds), three nodes\n" + "\n".join(lines)


def plot(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["size"] >> 10 for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, op in zip(axes, ["save", "load"]):
        for k in (1, 2):
            ax.plot(sizes, [r[f"r{k} {op}"] for r in rows], marker="o", label=f"replicas={k}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("value size (KiB)")
        ax.set_title(op)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s (caller's bytes)")
    axes[1].legend()
    fig.suptitle("EMS pool on etcd membership, 3 local nodes, replicas 1 vs 2 (2 shared cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()

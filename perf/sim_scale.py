"""A pool of 1,024-4,096 nodes, simulated with the real placement, routing and fan-out code (issue 46).

What is real: keys (`ems.datapath.keys.chain_keys`), placement (`ems.cluster.rendezvous`), the router's reads with
failover and hedging (`ems.backends.node_router.NodeRouter`, `ems.backends.reads`, `ems.backends.fanout`), the hot-unit
policy (`ems.cluster.hot`). What is simulated: the nodes (`SimNode`), each answering a request after a latency drawn
from this machine's measured one-node distribution (one real `python -m ems.pool` node on loopback, timed on
`get_into` of the share of a call one node serves), 1 % of them 10x slower.

Per pool size it reports, for 1,000-block prompts (2 replicas, 32 KiB values):
* nodes touched per prompt (replicas counted) and the largest share of a call's bytes one node is asked for, with
  units (a chain prefix given) and per key (none given: the placement before units), side by side;
* routing time per 1,000 blocks with 2 replicas (`ranked_owners`), units and per key;
* call latency p50/p99 through the real router over simulated nodes, against the same calls through the same router
  to one simulated node (its p99: what the call costs without a fan-out, the router's own work included);
* under a Zipf workload of shared system prompts: the most-loaded node's values and reads over the mean, without and
  with hot copies (`HotUnits`; extra copies counted as values). Values fill the pool to `--fill` blocks a node.

Prints a table, writes perf/sim_scale.png, records perf/results/sim_scale.json.
Usage: python perf/sim_scale.py [--nodes 1024 4096] [--fill 16384] [--calls 300] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "pool"))
sys.path.insert(0, str(ROOT))  # this checkout's package, before an installed one

from benchlib import machine  # noqa: E402
from results import Figure, Goal, Run, command_line, record  # noqa: E402

from ems.backends.base import PoolCall  # noqa: E402
from ems.backends.node_router import NodeRouter  # noqa: E402
from ems.cluster.hot import MIN_CALLS, HotUnits, spread  # noqa: E402
from ems.cluster.rendezvous import UNIT_WIDTH, node_seeds, ranked_by_hash, ranked_owners  # noqa: E402
from ems.datapath.keys import UNIT_BLOCKS, chain_keys, v1_keys  # noqa: E402
from ems.errors import EmsErrorCode  # noqa: E402
from ems.records import Deadline  # noqa: E402
from ems.transport.base import NodeClient, TransportError  # noqa: E402
from ems.types import CcKvOption  # noqa: E402

HERE = Path(__file__).resolve().parent
BLOCKS = 1000
VALUE = 32 << 10
REPLICAS = 2
SLOW_SHARE, SLOW_FACTOR = 0.01, 10.0
NS = bytes(16)
PROMPTS = 256  # recurring prompts of the latency runs


# ---- the one-node latency distribution (measured) ----


def measure_one_node(samples: int) -> np.ndarray:
    """Seconds of `samples` get_into requests to one real pool node, each of the values one node serves in a call
    of BLOCKS blocks over 4 units of UNIT_WIDTH nodes (primary reads)."""
    from pool_testlib import PoolProcess, make_values

    import ems.transport.ucx.config  # noqa: F401 - UCX environment before ucxx loads
    from ems.transport.ucx.remote import connect

    share = -(-BLOCKS // (4 * UNIT_WIDTH))
    node_proc = PoolProcess("256MiB")
    node = connect(node_proc.address, connect_timeout_ms=5000)
    try:
        keys = [f"k{i}".encode() for i in range(share)]
        values = make_values(share, VALUE)
        node.put(keys, values, Deadline.after(10))
        outs = [np.empty(sum(len(p) for p in v), dtype=np.uint8) for v in values]
        for _ in range(20):
            node.get_into(keys, outs, Deadline.after(10))
        times = []
        for _ in range(samples):
            start = time.perf_counter()
            node.get_into(keys, outs, Deadline.after(10))
            times.append(time.perf_counter() - start)
        return np.asarray(times)
    finally:
        node.close()
        node_proc.kill()


# ---- simulated nodes behind the real router ----


class SimNode(NodeClient):
    """A node that holds every key and answers after a drawn latency (x `factor`); `abort` ends its calls now."""

    def __init__(self, address: str, draws: np.ndarray, factor: float, seed: int) -> None:
        self.address = address
        self._draws, self._factor = draws, factor
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._aborted = threading.Event()

    def _wait(self) -> None:
        with self._lock:
            delay = float(self._draws[self._rng.integers(self._draws.size)]) * self._factor
        if self._aborted.wait(delay):
            self._aborted.clear()
            raise TransportError(EmsErrorCode.EMS_IO_ERROR, f"{self.address}: aborted")

    def put(self, keys, values, deadline):  # type: ignore[no-untyped-def]
        self._wait()
        return [True] * len(keys)

    def get(self, keys, deadline):  # type: ignore[no-untyped-def]
        self._wait()
        return [b"v"] * len(keys)

    def get_into(self, keys, outs, deadline):  # type: ignore[no-untyped-def]
        self._wait()
        return [True] * len(keys)

    def exists(self, keys, deadline, hold=None):  # type: ignore[no-untyped-def]
        self._wait()
        return [True] * len(keys)

    def ping(self, deadline):  # type: ignore[no-untyped-def]
        return True

    def shm_buffer(self, nbytes):  # type: ignore[no-untyped-def]
        return None

    def abort(self) -> None:
        self._aborted.set()

    def close(self) -> None:
        pass


def call_latencies(n: int, draws: np.ndarray, calls: int, seed: int) -> np.ndarray:
    """Seconds of `calls` reads (`NodeRouter.get`) of one BLOCKS-block prompt each, through the real router over n
    simulated nodes, 1 % of them slow (none of one node); the first quarter of the calls warm the router's latency
    model up. A call reads one of PROMPTS recurring prompts (Zipf 1.1: shared system prompts), so the client sees
    the nodes it uses again, as an engine does."""
    rng = np.random.default_rng(seed)
    slow = set(rng.choice(n, size=int(n * SLOW_SHARE), replace=False).tolist())
    nodes = [SimNode(f"10.{i // 250}.{i % 250}.1:7700", draws, SLOW_FACTOR if i in slow else 1.0, i) for i in range(n)]
    router = NodeRouter(nodes, replicas=REPLICAS)
    option = CcKvOption(timeout=5000)
    out = []
    try:
        warm = calls // 4
        prompts = [chain_keys(NS, [int(x) for x in rng.integers(0, 2**63, BLOCKS)], []) for _ in range(PROMPTS)]
        zipf = 1.0 / np.arange(1, PROMPTS + 1) ** 1.1
        for c, p in enumerate(rng.choice(PROMPTS, size=calls + warm, p=zipf / zipf.sum()).tolist()):
            keys, routes, units = prompts[p]
            start = time.perf_counter()
            outcome = router.get(PoolCall(routes, keys, option, units=units))
            elapsed = time.perf_counter() - start
            if not all(v is not None for v in outcome.results):
                raise RuntimeError("a simulated read missed")
            if c >= warm:
                out.append(elapsed)
    finally:
        router.close()
    return np.asarray(out)


# ---- placement figures ----


def placement(n: int, prompts: int, seed: int) -> dict:
    """Nodes touched, largest node share of a call's bytes and routing time: units vs per key."""
    rng = np.random.default_rng(seed)
    seeds = node_seeds([f"10.{i // 250}.{i % 250}.1:7700" for i in range(n)])
    touched, share, touched_key, share_key, t_units, t_key = [], [], [], [], [], []
    for p in range(prompts):
        chain = [int(x) for x in rng.integers(0, 2**63, BLOCKS)]
        _, routes, units = chain_keys(NS, chain, [])
        start = time.perf_counter()
        ranks = ranked_owners(routes, seeds, REPLICAS, units)
        t_units.append(time.perf_counter() - start)
        touched.append(np.unique(ranks).size)
        share.append(np.bincount(ranks.ravel()).max() / ranks.size)
        if p < max(3, prompts // 10):  # per key: O(N) a key, slow at scale; a few prompts
            _, key_routes = v1_keys(NS, chain)
            start = time.perf_counter()
            per_key = ranked_owners(key_routes, seeds, REPLICAS)
            t_key.append(time.perf_counter() - start)
            touched_key.append(np.unique(per_key).size)
            share_key.append(np.bincount(per_key.ravel()).max() / per_key.size)
    return {
        "touched_mean": float(np.mean(touched)),
        "touched_max": int(np.max(touched)),
        "share_max": float(np.max(share)),
        "touched_key": float(np.mean(touched_key)),
        "share_key": float(np.max(share_key)),
        "route_ms": statistics.median(t_units) * 1e3,
        "route_key_ms": statistics.median(t_key) * 1e3,
    }


# ---- the Zipf workload: values and reads per node ----


def zipf_load(n: int, fill: int, requests: int, seed: int) -> dict:
    """Most-loaded node over the mean, in values and in reads, without and with hot copies.

    The pool holds `systems` shared system prompts (256-1,024 blocks) and users' conversations (unique chains of
    256-1,024 blocks) until it holds `fill` values a node (REPLICAS copies each). A request reads a system prompt
    drawn Zipf(1.1) and one stored conversation drawn uniformly (its own history), each from its chain's start. Reads
    are counted per value at the node asked first: its first owner, or with hot copies the copy group `spread` picks."""
    rng = np.random.default_rng(seed)
    seeds = node_seeds([f"10.{i // 250}.{i % 250}.1:7700" for i in range(n)])
    systems = 1000
    sys_len = rng.integers(256, 1025, systems)
    target_values = n * fill // REPLICAS
    conv_len = rng.integers(256, 1025, max(1, (target_values - int(sys_len.sum())) // 640 + 1))
    conv_len = conv_len[: int(np.searchsorted(np.cumsum(conv_len), target_values - int(sys_len.sum()))) + 1]
    lengths = np.concatenate([sys_len, conv_len])
    salt = np.uint64(seed)

    def blocks_of(chains: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(unit, own hash) of every block of `chains`, in order: digests of (chain, unit) and (chain, position)."""
        lens = lengths[chains]
        chain_of = np.repeat(chains, lens).astype(np.uint64)
        pos = (np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)).astype(np.uint64)
        units = _mix(_mix(chain_of ^ salt) ^ (pos // np.uint64(UNIT_BLOCKS)))
        return units, _mix(_mix(chain_of + np.uint64(1 << 40)) ^ pos)

    values = np.zeros(n, dtype=np.int64)
    step = 2048  # chains a batch (~1.3 M blocks)
    for a in range(0, lengths.size, step):
        units, hashes = blocks_of(np.arange(a, min(a + step, lengths.size)))
        values += np.bincount(ranked_by_hash(hashes, seeds, REPLICAS, units).ravel(), minlength=n)
    # requests: a Zipf system prompt + a uniform conversation, read from the first owner (or a hot copy); in
    # batches of requests that share the hot units' state of the batch's start
    zipf = 1.0 / np.arange(1, systems + 1) ** 1.1
    sys_pick = rng.choice(systems, size=requests, p=zipf / zipf.sum())
    conv_pick = systems + rng.integers(0, lengths.size - systems, requests)
    batch = 500
    # a batch's reads are counted as one call (`HotUnits.read`) where a client counts each request's: a batch stands
    # for `batch` calls, so a unit needs MIN_CALLS / batch of them (else the hot prompts' first 2,000 requests,
    # 4 batches, all went to their own groups: the most-read node 2.9x the mean on 4,096 nodes instead of ~1.9x)
    hot = HotUnits(half_life_s=1e9, min_calls=MIN_CALLS / batch)
    reads = np.zeros(n, dtype=np.int64)
    reads_hot = np.zeros(n, dtype=np.int64)
    unit_len: dict[int, int] = {}  # unit -> its blocks (what a copy of it holds)
    for a in range(0, requests, batch):
        chains = np.stack([sys_pick[a : a + batch], conv_pick[a : a + batch]], axis=1).ravel()
        units, hashes = blocks_of(chains)
        request = np.repeat(np.arange(chains.size) // 2, lengths[chains]) + a
        first = ranked_by_hash(hashes, seeds, 1, units)[:, 0]
        reads += np.bincount(first, minlength=n)
        copy = spread(hot.copies(units, n), request)
        asked = ranked_by_hash(hashes, seeds, 1, units, copy=copy)[:, 0]
        reads_hot += np.bincount(asked, minlength=n)
        hot.read(units)
        one_read_units, _ = blocks_of(np.unique(chains))
        uniq, counts = np.unique(one_read_units, return_counts=True)
        unit_len.update(zip(uniq.tolist(), counts.tolist()))
    final = np.fromiter(unit_len, dtype=np.uint64, count=len(unit_len))
    extra_values = {  # (unit, copy) -> values placed there (REPLICAS copies of each block of the unit)
        (u, j): unit_len[u] for u, k in zip(final.tolist(), hot.copies(final, n).tolist()) for j in range(1, k)
    }
    with_copies = values.copy()
    for (u, j), length in extra_values.items():  # the hot copies' values, placed by the real code
        hashes = rng.integers(0, 2**63, length, dtype=np.uint64)
        ranks = ranked_by_hash(hashes, seeds, REPLICAS, np.full(length, u, dtype=np.uint64), copy=np.full(length, j))
        with_copies += np.bincount(ranks.ravel(), minlength=n)
    return {
        "values_max": float(values.max() / values.mean()),
        "values_max_hot": float(with_copies.max() / with_copies.mean()),
        "reads_max": float(reads.max() / reads.mean()),
        "reads_max_hot": float(reads_hot.max() / reads_hot.mean()),
        "reads_per_node": float(reads.mean()),
        "values_per_node": float(values.mean()),
        "hot_units": len({u for u, _ in extra_values}),
        "hot_copies": len(extra_values),
    }


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over u64 (a well-spread digest of distinct inputs)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--fill", type=int, default=16384, help="values a node holds (blocks, replicas counted)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--requests", type=int, default=60000, help="requests of the Zipf workload")
    ap.add_argument("--quick", action="store_true", help="small counts (a smoke run, not figures to record)")
    args = ap.parse_args(argv)
    if args.quick:
        args.calls, args.requests, args.fill = 40, 1000, 1024
    draws = measure_one_node(400 if not args.quick else 50)
    print(f"one node's requests: p50 {np.percentile(draws, 50) * 1e3:.2f} ms, p99 {np.percentile(draws, 99) * 1e3:.2f} ms")
    one = call_latencies(1, draws, args.calls, 1)
    one_p99 = float(np.percentile(one, 99))
    one_p50 = float(np.percentile(one, 50))
    print(f"calls to one simulated node: p50 {one_p50 * 1e3:.2f} ms, p99 {one_p99 * 1e3:.2f} ms", flush=True)
    rows = {}
    for n in args.nodes:
        place = placement(n, 40 if not args.quick else 5, n)
        lat = call_latencies(n, draws, args.calls, n)
        load = zipf_load(n, args.fill, args.requests, n)
        rows[n] = {**place, **load, "p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99))}
        print(n, {k: round(v, 3) if isinstance(v, float) else v for k, v in rows[n].items()}, flush=True)
    print()
    print(table(rows, one_p50, one_p99))
    plot(rows, one_p99, HERE / "sim_scale.png")
    if args.quick:
        return
    figures = []
    for n, r in rows.items():
        note = f"{n} simulated nodes, {BLOCKS}-block prompts, {REPLICAS} replicas"
        figures += [
            Figure(
                f"{n} nodes: nodes touched per {BLOCKS}-block prompt (units)",
                r["touched_max"],
                "nodes",
                "per key",
                r["touched_key"],
                None,
                "perf/sim_scale.png",
                note + "; the max over 40 prompts, the anchor the mean per key",
            ),
            Figure(
                f"{n} nodes: largest share of a call's bytes on one node",
                r["share_max"],
                "share",
                None,
                None,
                Goal("<=", 0.25),
                "perf/sim_scale.png",
                note,
            ),
            Figure(
                f"{n} nodes: routing per {BLOCKS} blocks, 2 replicas",
                r["route_ms"],
                "ms",
                "per key",
                r["route_key_ms"],
                None,
                "perf/sim_scale.png",
                note + "; medians",
            ),
            Figure(
                f"{n} nodes: call p99 (1 % nodes 10x slow)",
                r["p99"] * 1e3,
                "ms",
                "one node's call p99",
                one_p99 * 1e3,
                Goal("<=", 1.5),
                "perf/sim_scale.png",
                note + f"; {args.calls} reads through NodeRouter",
            ),
            Figure(
                f"{n} nodes: most-loaded node's values / mean (hot copies counted)",
                r["values_max_hot"],
                "x",
                None,
                None,
                Goal("<=", 1.25),
                "perf/sim_scale.png",
                f"fill {args.fill} values a node",
            ),
            Figure(
                f"{n} nodes: most-loaded node's reads / mean, hot copies",
                r["reads_max_hot"],
                "x",
                None,
                None,
                Goal("<=", 2.0),
                "perf/sim_scale.png",
                f"Zipf(1.1) over 1000 system prompts, {args.requests} requests; without hot copies {r['reads_max']:.1f}x",
            ),
        ]
        figures.append(
            Figure(
                f"{n} nodes: nodes touched (units), goal",
                r["touched_max"],
                "nodes",
                None,
                None,
                Goal("<=", 16),
                "perf/sim_scale.png",
                note,
            )
        )
        figures.append(
            Figure(f"{n} nodes: routing, goal", r["route_ms"], "ms", None, None, Goal("<=", 1.0), "perf/sim_scale.png", note)
        )
    run = Run("sim_scale", command_line(), figures, machine=machine())
    print(f"results: {record(run)}")


def table(rows: dict, one_p50: float, one_p99: float) -> str:
    head = (
        "| nodes | touched (units / per key) | max share | routing ms (units / per key) | p50 / p99 ms "
        f"(one node {one_p50 * 1e3:.2f} / {one_p99 * 1e3:.2f}) | values max/mean (hot copies) | reads max/mean "
        "(no copies / hot copies) |"
    )
    lines = [head, "|" + "---|" * 7]
    for n, r in rows.items():
        lines.append(
            f"| {n} | {r['touched_mean']:.1f} (max {r['touched_max']}) / {r['touched_key']:.0f} | {r['share_max']:.3f} "
            f"(per key {r['share_key']:.3f}) | {r['route_ms']:.2f} / {r['route_key_ms']:.1f} | "
            f"{r['p50'] * 1e3:.2f} / {r['p99'] * 1e3:.2f} ({r['p99'] / one_p99:.2f}x) | "
            f"{r['values_max']:.2f} ({r['values_max_hot']:.2f}) | {r['reads_max']:.1f} / {r['reads_max_hot']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: dict, one_p99: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    ns = list(rows)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar([str(n) for n in ns], [rows[n]["touched_max"] for n in ns], label="units (max)")
    axes[0].plot([str(n) for n in ns], [rows[n]["touched_key"] for n in ns], "o-", color="C3", label="per key (mean)")
    axes[0].axhline(16, ls="--", color="k", lw=0.8)
    axes[0].set_yscale("log")
    axes[0].set_title(f"nodes touched per {BLOCKS}-block prompt")
    axes[0].legend()
    axes[1].bar([str(n) for n in ns], [rows[n]["p99"] / one_p99 for n in ns])
    axes[1].axhline(1.5, ls="--", color="k", lw=0.8)
    axes[1].set_title("call p99 / one node's p99 (1 % slow)")
    x = np.arange(len(ns))
    axes[2].bar(x - 0.2, [rows[n]["values_max_hot"] for n in ns], 0.4, label="values")
    axes[2].bar(x + 0.2, [rows[n]["reads_max_hot"] for n in ns], 0.4, label="reads (hot copies)")
    axes[2].set_xticks(x, [str(n) for n in ns])
    axes[2].set_title("most-loaded node / mean (Zipf)")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

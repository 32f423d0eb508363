"""A pool node's CPU per request and per MiB: the node process's CPU time (all its threads, /proc schedstat) over N
small requests and over bulk MiB, from one client over UCX (loopback).

    flock /tmp/ems-bench.lock .venv/bin/python perf/bench_node_cpu.py [--base REV] [--calls N] [--rounds R]

Rows: a 1-key `exists` (the per-request cost: no value bytes), a 1 MiB put and get_into (one value per request),
and 32 x 1 MiB put and get_into (bulk: per MiB). Per MiB = CPU per call / MiB per call; the per-request part is
the exists row. Shared memory is off (`--shm` turns it on): the bytes cross UCX, as for a node on another host.

`--base REV` runs a second node from the source of git revision REV (extracted to a temporary directory) beside
this tree's node, and measures them in turn, round by round, so the two columns share the machine's state (the
client is this tree's in both). Prints a table, saves `perf/node_cpu.png`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "pool"))
sys.path.insert(0, str(ROOT / "perf"))
sys.path.insert(0, str(ROOT / "tests"))

from benchlib import machine  # noqa: E402
from pool_testlib import PoolProcess, make_values  # noqa: E402
from proc_cpu import schedstat_seconds  # noqa: E402

import ems.transport.ucx.config  # noqa: E402, F401 - UCX environment before ucxx loads
from ems.records import Deadline  # noqa: E402
from ems.transport.shm.client import ShmMode  # noqa: E402
from ems.transport.ucx.client import UcxNode  # noqa: E402

MiB = 1 << 20
BULK = 32  # values of 1 MiB per bulk call


@contextlib.contextmanager
def source_of(rev: str) -> Iterator[Path]:
    """A directory whose `ems` package is revision `rev`'s source (ems/, with transport/ and kernels/ inside it, as
    the package installs them)."""
    tmp = Path(tempfile.mkdtemp(prefix="ems-bench-base-"))
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, "ems", "transport", "kernels"], check=True, capture_output=True
        ).stdout
        tar_path = tmp / "src.tar"
        tar_path.write_bytes(archive)
        with tarfile.open(tar_path) as tar:
            tar.extractall(tmp / "tree", filter="data")
        package = tmp / "pkg"
        package.mkdir()
        shutil.move(str(tmp / "tree" / "ems"), str(package / "ems"))
        shutil.move(str(tmp / "tree" / "transport"), str(package / "ems" / "transport"))
        shutil.move(str(tmp / "tree" / "kernels"), str(package / "ems" / "kernels"))
        yield package
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def start_node(source: Path | None) -> PoolProcess:
    """A node of this tree (`source` None) or of the package directory `source` (run from there, so its `ems` is
    the one imported)."""
    if source is None:
        return PoolProcess("512MiB")
    saved_cwd, saved_path = os.getcwd(), os.environ.get("PYTHONPATH")
    os.chdir(source)
    os.environ["PYTHONPATH"] = str(source)
    try:
        node = PoolProcess("512MiB")
    finally:
        os.chdir(saved_cwd)
        if saved_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_path
    where = Path(f"/proc/{node.proc.pid}/cwd").resolve()
    if where != source.resolve():
        node.kill()
        raise RuntimeError(f"the base node runs in {where}, not {source}")
    return node


def workloads(client: UcxNode) -> dict[str, tuple[Callable[[], object], float]]:
    """name -> (one call, MiB it moves)."""
    one = make_values(1, MiB - 40, seed=5)
    bulk = make_values(BULK, MiB - 40, seed=6)
    bulk_keys = [f"bulk-{i}".encode() for i in range(BULK)]
    one_out = [np.empty(MiB, np.uint8)]
    bulk_outs = [np.empty(MiB, np.uint8) for _ in range(BULK)]
    t = 30.0
    if client.put([b"one"], one, t) != [True] or not all(client.put(bulk_keys, bulk, t)):
        raise RuntimeError("the values were not stored")

    def checked(call: Callable[[], list], what: str) -> Callable[[], object]:
        def run() -> object:
            got = call()
            if not all(got):
                raise RuntimeError(f"{what}: {got}")
            return got

        return run

    return {
        "exists (1 key)": (checked(lambda: client.exists([b"one"], Deadline.after(t)), "exists"), 0.0),
        "put 1 MiB": (checked(lambda: client.put([b"one"], one, Deadline.after(t)), "put"), 1.0),
        "get_into 1 MiB": (checked(lambda: client.get_into([b"one"], one_out, Deadline.after(t)), "get_into"), 1.0),
        f"put {BULK} x 1 MiB": (checked(lambda: client.put(bulk_keys, bulk, Deadline.after(t)), "bulk put"), BULK),
        f"get_into {BULK} x 1 MiB": (
            checked(lambda: client.get_into(bulk_keys, bulk_outs, Deadline.after(t)), "bulk get_into"),
            BULK,
        ),
    }


def measure(node: PoolProcess, calls: dict[str, tuple[Callable[[], object], float]], n: dict[str, int]) -> dict[str, float]:
    """µs of node CPU per call of each workload."""
    out: dict[str, float] = {}
    for name, (fn, _) in calls.items():
        fn()
        start = schedstat_seconds(node.proc.pid)
        for _ in range(n[name]):
            fn()
        out[name] = (schedstat_seconds(node.proc.pid) - start) / n[name] * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", help="also measure a node of this git revision, in turn with this tree's")
    parser.add_argument("--calls", type=int, default=2000, help="small calls per round (bulk: calls / 40)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shm", action="store_true", help="same-host shared memory on (default off: UCX only)")
    args = parser.parse_args()
    print(f"# {machine()}")
    mode = ShmMode.AUTO if args.shm else ShmMode.OFF
    with contextlib.ExitStack() as stack:
        sources: dict[str, Path | None] = {"this tree": None}
        if args.base:
            sources[f"base {args.base}"] = stack.enter_context(source_of(args.base))
        nodes = {label: start_node(src) for label, src in sources.items()}
        for node in nodes.values():
            stack.callback(node.kill)
        clients = {label: UcxNode(node.address, connect_timeout_ms=5000, shm=mode) for label, node in nodes.items()}
        for client in clients.values():
            stack.callback(client.close)
        calls = {label: workloads(client) for label, client in clients.items()}
        names = list(next(iter(calls.values())))
        counts = {name: args.calls if mib <= 1 else max(10, args.calls // 40) for name, (_, mib) in calls["this tree"].items()}
        samples: dict[str, dict[str, list[float]]] = {label: {name: [] for name in names} for label in nodes}
        for _ in range(args.rounds):
            for label in reversed(list(nodes)) if args.base else nodes:  # base first: each round in the same order
                for name, us in measure(nodes[label], calls[label], counts).items():
                    samples[label][name].append(us)
    medians = {label: {name: statistics.median(v) for name, v in rows.items()} for label, rows in samples.items()}
    labels = list(medians)
    print(f"\nNode CPU, µs per call (median of {args.rounds} rounds; shm {'on' if args.shm else 'off'}):\n")
    print("| call | calls per round | " + " | ".join(labels) + (" | this / base |" if args.base else " |"))
    print("|---|---|" + "---|" * len(labels) + ("---|" if args.base else ""))
    for name in names:
        row = f"| {name} | {counts[name]} | " + " | ".join(f"{medians[label][name]:.0f}" for label in labels)
        if args.base:
            row += f" | {medians[labels[0]][name] / medians[labels[1]][name]:.2f}"
        print(row + " |")
    print("\nPer request (exists) and per MiB (bulk calls, less nothing; 1-value calls less the per-request part):\n")
    print(
        "| node | per request µs | per MiB saved µs (bulk) | per MiB loaded µs (bulk) | 1 MiB put less request | "
        "1 MiB get_into less request |"
    )
    print("|---|---|---|---|---|---|")
    for label in labels:
        m = medians[label]
        request = m["exists (1 key)"]
        print(
            f"| {label} | {request:.0f} | {m[f'put {BULK} x 1 MiB'] / BULK:.0f} | {m[f'get_into {BULK} x 1 MiB'] / BULK:.0f} "
            f"| {m['put 1 MiB'] - request:.0f} | {m['get_into 1 MiB'] - request:.0f} |"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(labels)
        for j, label in enumerate(labels):
            ax.bar([i + j * width for i in range(len(names))], [medians[label][n] for n in names], width, label=label)
        ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(names))], names, rotation=15, fontsize=8)
        ax.set_ylabel("node CPU µs per call")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(ROOT / "perf" / "node_cpu.png", dpi=100)
    except ImportError:
        pass


if __name__ == "__main__":
    main()

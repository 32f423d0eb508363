"""Pool-node throughput, side by side in one run: EMS pool (1 and 3 local nodes) vs raw UCXX vs Redis.

For each value size, the same batch of well-formed EMS values (header + payload) is saved and loaded:
* ems-1 / ems-3: through `PoolClient` + `UcxNode` to 1 or 3 `python -m ems.pool` processes (routing, per-node
  fan-out, protocol, checksum on the node);
* raw-ucxx: the same bytes as one UCX tagged message per value, same UCX settings, to an echo/sink peer;
* redis: a local redis-server (no persistence), pipelined SET / GET of the same values.
Prints a table, writes perf/pool.png. Usage: python perf/bench_pool.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "pool"))

import ems.transport.ucx_config  # noqa: E402,F401 - UCX environment before ucxx loads
from pool_testlib import PoolProcess, make_values  # noqa: E402

from benchlib import best_of  # noqa: E402

from ems.pool_client import PoolClient  # noqa: E402
from ems.transport.ucx import UcxNode, UcxRuntime  # noqa: E402
from ems.types import CcKvOption  # noqa: E402

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


# ---- raw UCXX: a sink/echo peer in another process ----

RAW_PEER = r"""
import asyncio, sys, numpy as np
import ems.transport.ucx_config as cfg
async def main():
    cfg.init_ucx()
    import ucxx
    async def handle(ep):
        hdr = np.empty(3, np.uint64)
        while True:
            try:
                await ep.recv(hdr)
            except Exception:
                return
            op, n, size = (int(x) for x in hdr)
            if op == 0:  # sink n messages of size, then ack
                bufs = [np.empty(size, np.uint8) for _ in range(n)]
                await asyncio.gather(*(ep.recv(b) for b in bufs))
                await ep.send(np.ones(1, np.uint8))
            else:  # send n messages of size
                data = np.ones(size, np.uint8)
                await asyncio.gather(*(ep.send(data) for _ in range(n)))
    lst = ucxx.create_listener(handle, port=0)
    print(lst.port, flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


class RawUcx:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", RAW_PEER], stdout=subprocess.PIPE, text=True)
        port = int(self.proc.stdout.readline())
        self.rt = UcxRuntime.get()
        from ems.transport.ucx_endpoint import create_endpoint

        self.ep = self.rt.submit(create_endpoint("127.0.0.1", port, 5.0)).result(10)

    def put(self, values: list) -> None:
        async def run() -> None:
            await self.ep.send(np.array([0, len(values), len(values[0])], np.uint64))
            await asyncio.gather(*(self.ep.send(v) for v in values))
            await self.ep.recv(np.empty(1, np.uint8))

        self.rt.submit(run()).result(120)

    def get(self, n: int, size: int) -> None:
        async def run() -> None:
            await self.ep.send(np.array([1, n, size], np.uint64))
            bufs = [np.empty(size, np.uint8) for _ in range(n)]
            await asyncio.gather(*(self.ep.recv(b) for b in bufs))

        self.rt.submit(run()).result(120)

    def close(self) -> None:
        self.rt.call_soon(self.ep.abort)
        self.proc.kill()
        self.proc.wait()


# ---- Redis ----


class Redis:
    def __init__(self) -> None:
        import redis

        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not installed (apt-get install redis-server)")
        self.dir = tempfile.mkdtemp(prefix="bench-redis-")
        self.port = 6390 + os.getpid() % 1000
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--maxmemory", "0", "--proto-max-bulk-len", "1gb"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.client = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def put(self, keys: list, values: list) -> None:
        pipe = self.client.pipeline(transaction=False)
        for k, v in zip(keys, values):
            pipe.set(k, v)
        pipe.execute()

    def get(self, keys: list) -> list:
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        return pipe.execute()

    def close(self) -> None:
        self.client.flushall()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller batches and fewer repeats")
    parser.add_argument("--batch-mib", type=int, default=64, help="bytes per call, MiB")
    args = parser.parse_args()
    batch = (16 if args.quick else args.batch_mib) << 20
    repeats = 2 if args.quick else 3
    option = CcKvOption(timeout=60_000, write_rcache=False)

    nodes = [PoolProcess("2GiB") for _ in range(3)]
    raw = RawUcx()
    red = Redis()
    rows = []
    try:
        pools = {
            "ems-1": PoolClient([UcxNode(nodes[0].address, connect_timeout_ms=5000)]),
            "ems-3": PoolClient([UcxNode(n.address, connect_timeout_ms=5000) for n in nodes]),
        }
        for size in SIZES:
            n = max(2, batch // size)
            values = make_values(n, size - 40, seed=size)  # each value (with its 40-byte header) is `size` bytes
            flat = [b"".join(v) for v in values]
            total = n * size
            keys = [f"bench-{size}-{i}".encode() for i in range(n)]
            row = {"size": size}
            for name, pool in pools.items():
                ks = [name.encode() + k for k in keys]
                row[f"{name} save"] = total / best_of(lambda: pool.put(ks, ks, values, option), repeats) / 1e9
                out = pool.get(ks, ks, option)
                if any(o is None for o in out.results):
                    raise RuntimeError(f"{name}: a value did not come back ({out.errors})")
                row[f"{name} load"] = total / best_of(lambda: pool.get(ks, ks, option), repeats) / 1e9
            arrays = [np.frombuffer(f, np.uint8) for f in flat]
            row["raw save"] = total / best_of(lambda: raw.put(arrays), repeats) / 1e9
            row["raw load"] = total / best_of(lambda: raw.get(n, size), repeats) / 1e9
            row["redis save"] = total / best_of(lambda: red.put(keys, flat), repeats) / 1e9
            row["redis load"] = total / best_of(lambda: red.get(keys), repeats) / 1e9
            red.client.flushall()
            rows.append(row)
            print(_fmt_row(row), flush=True)
        for pool in pools.values():
            pool.close()
    finally:
        raw.close()
        red.close()
        for node in nodes:
            node.cleanup()
    print()
    print(table(rows))
    plot(rows, ROOT / "perf" / "pool.png")


COLUMNS = ["ems-1 save", "ems-1 load", "ems-3 save", "ems-3 load", "raw save", "raw load", "redis save", "redis load"]


def _fmt_row(row: dict) -> str:
    return f"{row['size'] >> 10:>6} KiB " + " ".join(f"{row[c]:>6.2f}" for c in COLUMNS)


def table(rows: list) -> str:
    lines = [
        "| value | " + " | ".join(COLUMNS) + " | ems-1/raw save | ems-1/raw load | ems-1/redis save | ems-1/redis load |",
        "|---" * (len(COLUMNS) + 5) + "|",
    ]
    for r in rows:
        ratios = [r["ems-1 save"] / r["raw save"], r["ems-1 load"] / r["raw load"],
                  r["ems-1 save"] / r["redis save"], r["ems-1 load"] / r["redis load"]]
        lines.append(
            f"| {r['size'] >> 10} KiB | " + " | ".join(f"{r[c]:.2f}" for c in COLUMNS) + " | "
            + " | ".join(f"{x:.2f}x" for x in ratios) + " |"
        )
    return "GB/s (best of runs)\n" + "\n".join(lines)


def plot(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["size"] >> 10 for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, op in zip(axes, ["save", "load"]):
        for name in ["ems-1", "ems-3", "raw", "redis"]:
            ax.plot(sizes, [r[f"{name} {op}"] for r in rows], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("value size (KiB)")
        ax.set_title(op)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend()
    fig.suptitle("EMS pool nodes vs raw UCXX vs Redis, loopback (2 cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()

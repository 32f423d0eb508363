"""The API on the Mooncake backend vs the API on an `ems` pool node vs Mooncake's own calls, side by side in one run.

Setup (all on 127.0.0.1): `mooncake_master` and a storage process holding a 1 GiB segment (Mooncake's bytes cross
TCP to it, as ours cross to a pool node), one `python -m ems.pool` node over UCX, and in this process:
* api-mooncake: `ContextCaching.save/load` (V1 slot_mapping, `--blocks` blocks of 1 MiB: 16 layers x K/V x 16 tokens
  x 8 heads x 128 fp16) with `pool_backend="mooncake"`: gather into registered staging, checksum and header,
  `batch_upsert_from` straight from staging; `batch_get_into` straight into staging, verify, scatter. Default
  chunks (32 MiB: one chunk here), then 16 MiB chunks (two: the second put or receive overlaps the first one's copies).
* api-ems: the same calls on the `ems` node (UCX, the node checks every value's XXH3).
* backend alone: `MooncakePool.put` / `get_into` of the same values from and into registered staging (the
  backend's own cost: key names, worker thread, per-key results; no gather, checksum or scatter).
* mooncake-own: Mooncake's `batch_put_from` / `batch_get_into` of the same values (1 MiB + the 40-byte header each)
  from and into registered buffers: no gather, checksum or scatter (the issue's reference).
Rounds interleave the three (the host is shared); each figure is the best of `--rounds`, after a warm-up round.
Fresh keys every round (Mooncake's put does not replace a value).
Per call (median of `--calls`): exists of 1 block, save and load of 1 block (1 MiB), API on each backend next to
Mooncake's own `is_exist` / `batch_put_from` / `batch_get_into` of one value.
Prints tables (and the Mooncake jobs' stage table), writes perf/mooncake.png.

Usage: flock /tmp/ems-bench.lock .venv/bin/python perf/bench_mooncake.py [--blocks 32] [--rounds 5] [--calls 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

import ems.transport.ucx.config  # noqa: F401 - UCX environment before ucxx loads
from ems import CcConfig, ContextCaching, EmsConfig
from ems.backends.base import PoolCall
from ems.backends.mooncake import MooncakePool
from ems.backends.pool_client import PoolClient
from ems.records import JobKind, stage_table
from ems.settings import resolve_settings
from ems.tools.demo import Engine
from ems.transport.ucx.client import UcxNode
from ems.types import CcKvOption

ROOT = Path(__file__).resolve().parent.parent
# after `ems` is imported: tests/ holds a folder named ems that must not shadow the package
sys.path.insert(0, str(ROOT / "tests" / "pool"))
sys.path.append(str(ROOT / "tests"))

from benchlib import machine, median_us  # noqa: E402
from mooncake_testlib import MooncakeCluster  # noqa: E402
from pool_testlib import PoolProcess  # noqa: E402

VALUE = (1 << 20) + 40  # a 1 MiB block and its header


class MooncakeOwn:
    """Mooncake's own client calls on registered buffers (the reference)."""

    def __init__(self, master: str, blocks: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        if self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", master) != 0:
            raise RuntimeError("Mooncake client setup failed")
        self.src = np.random.default_rng(1).integers(0, 255, blocks * VALUE, dtype=np.uint8)
        self.dst = np.empty(blocks * VALUE, np.uint8)
        for buf in (self.src, self.dst):
            if self.store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
                raise RuntimeError("Mooncake register_buffer failed")
        self.generation = 0

    def put(self, n: int) -> list:
        self.generation += 1
        names = [f"own-{self.generation}-{i}" for i in range(n)]
        codes = self.store.batch_put_from(names, [self.src.ctypes.data + i * VALUE for i in range(n)], [VALUE] * n)
        if any(c != 0 for c in codes):
            raise RuntimeError(f"batch_put_from: {set(codes)}")
        return names

    def get(self, names: list) -> None:
        n = len(names)
        got = self.store.batch_get_into(names, [self.dst.ctypes.data + i * VALUE for i in range(n)], [VALUE] * n)
        if any(g != VALUE for g in got):
            raise RuntimeError(f"batch_get_into: {set(got)}")

    def close(self) -> None:
        self.store.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    blocks = args.blocks
    total = blocks * VALUE
    print(machine(), flush=True)
    load_before = os.getloadavg()[0]
    cluster = MooncakeCluster(segment_bytes=(args.rounds + 2) * 4 * total + (256 << 20))
    node = PoolProcess("1GiB")
    own = MooncakeOwn(cluster.master, blocks)
    config = CcConfig(0, 0, "bench-mooncake")
    settings = resolve_settings(EmsConfig(**cluster.settings()))
    assert settings.mooncake is not None
    moon_pool = MooncakePool(settings.mooncake)
    ems_pool = PoolClient([UcxNode(node.address, connect_timeout_ms=5000)])
    ccs = {}
    try:
        if not moon_pool.healthy(10.0):
            raise RuntimeError("the Mooncake backend did not connect")
        engine = Engine(16, 2 * blocks, 16, 8, 128, torch.float16, torch.device("cpu"))
        for plane in engine.planes:
            plane.copy_(torch.randn(plane.shape, dtype=torch.float32).to(plane.dtype))
        ccs = {
            "api-mooncake": ContextCaching(config, None, moon_pool, settings),
            "api-ems": ContextCaching(config, None, ems_pool, resolve_settings(EmsConfig(read_cache_capacity=0))),
        }
        for cc in ccs.values():
            cc.register_kvcache(engine.kvcache)
        slots = engine.slots(engine.allocate(blocks))
        staging = torch.empty(2 * total, dtype=torch.uint8)
        staging[:total].copy_(torch.from_numpy(own.src))
        moon_pool.prepare_staging(staging)
        flat = memoryview(staging.numpy()).cast("B")
        alone_values = [[flat[i * VALUE : (i + 1) * VALUE]] for i in range(blocks)]
        alone_outs = [flat[total + i * VALUE : total + (i + 1) * VALUE] for i in range(blocks)]
        offsets = [16] * blocks
        option = CcKvOption(timeout=60_000, write_rcache=False)
        runs = [("api-mooncake", "32MiB"), ("api-mooncake", "16MiB"), ("api-ems", "32MiB")]
        best: dict = {}
        records: dict = {}
        counter = iter(range(1, 1 << 30))
        for round_ in range(args.rounds + 1):  # round 0 warms up (connections, staging, registrations)
            for name, chunk in runs:
                os.environ["EMS_CHUNK_BYTES"] = chunk
                cc = ccs[name]
                hashes = [next(counter) * 1000 + i for i in range(blocks)]
                start = time.perf_counter()
                if cc.save(slots, hashes, offsets, option).success != blocks:
                    raise RuntimeError(f"{name} save incomplete")
                t_save = time.perf_counter() - start
                start = time.perf_counter()
                if cc.load(slots, hashes, offsets, option).success != blocks:
                    raise RuntimeError(f"{name} load incomplete")
                t_load = time.perf_counter() - start
                if round_:
                    key = (name, chunk)
                    for op, t in (("save", t_save), ("load", t_load)):
                        if t < best.get((key, op), float("inf")):
                            best[(key, op)] = t
                            records[(key, op)] = cc.jobs.last(JobKind.SAVE if op == "save" else JobKind.LOAD)
            keys = [b"alone-%d-%d" % (round_, i) for i in range(blocks)]
            start = time.perf_counter()
            if not all(moon_pool.put(PoolCall(keys, keys, option), alone_values).results):
                raise RuntimeError("backend put incomplete")
            t_save = time.perf_counter() - start
            start = time.perf_counter()
            if not all(moon_pool.get_into(PoolCall(keys, keys, option), alone_outs).results):
                raise RuntimeError("backend get_into incomplete")
            t_load = time.perf_counter() - start
            if round_:
                best[("alone", "save")] = min(best.get(("alone", "save"), float("inf")), t_save)
                best[("alone", "load")] = min(best.get(("alone", "load"), float("inf")), t_load)
            start = time.perf_counter()
            names = own.put(blocks)
            t_save = time.perf_counter() - start
            start = time.perf_counter()
            own.get(names)
            t_load = time.perf_counter() - start
            if round_:
                best[("own", "save")] = min(best.get(("own", "save"), float("inf")), t_save)
                best[("own", "load")] = min(best.get(("own", "load"), float("inf")), t_load)
        os.environ.pop("EMS_CHUNK_BYTES", None)

        # per call: exists of 1 block, 1-block save and load (API on each backend, Mooncake's own)
        one_slots, one_hash = engine.slots(engine.allocate(1)), [7]
        for cc in ccs.values():
            cc.save(one_slots, one_hash, [16], option)
        own_one = own.put(1)
        per_call: dict = {}
        for name, cc in ccs.items():
            per_call.setdefault("exists (1 block)", {})[name] = median_us(lambda: cc.exists(one_hash, option), args.calls)
            per_call.setdefault("save 1 block (1 MiB)", {})[name] = median_us(
                lambda: cc.save(one_slots, one_hash, [16], option), args.calls // 2
            )
            per_call.setdefault("load 1 block (1 MiB)", {})[name] = median_us(
                lambda: cc.load(one_slots, one_hash, [16], option), args.calls // 2
            )
        one_block = [ccs["api-mooncake"].jobs.last(kind) for kind in (JobKind.SAVE, JobKind.LOAD)]
        per_call["exists (1 block)"]["mooncake-own"] = median_us(lambda: own.store.is_exist(own_one[0]), args.calls)
        per_call["save 1 block (1 MiB)"]["mooncake-own"] = median_us(lambda: own.put(1), args.calls // 2)
        per_call["load 1 block (1 MiB)"]["mooncake-own"] = median_us(lambda: own.get(own_one), args.calls // 2)
    finally:
        for cc in ccs.values():
            cc.close()
        moon_pool.close()
        ems_pool.close()
        own.close()
        node.cleanup()
        cluster.close()

    gbps = {k: total / t / 1e9 for k, t in best.items()}
    own_s, own_l = gbps[("own", "save")], gbps[("own", "load")]
    lines = [
        f"{blocks} blocks of 1 MiB ({total / 2**20:.0f} MiB a call), best of {args.rounds} interleaved rounds; "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after",
        "",
        "| peer | chunks | save GB/s | load GB/s | save / Mooncake's own | load / Mooncake's own |",
        "|---|---|---|---|---|---|",
    ]
    for name, chunk in runs:
        s, ld = gbps[((name, chunk), "save")], gbps[((name, chunk), "load")]
        chunks = (
            records[((name, chunk), "save")]
            .stages[next(k for k in records[((name, chunk), "save")].stages if k.value == "send")]
            .runs
        )
        lines.append(
            f"| {name} (EMS_CHUNK_BYTES={chunk}) | {chunks} | {s:.2f} | {ld:.2f} | {s / own_s:.2f}x | {ld / own_l:.2f}x |"
        )
    a_s, a_l = gbps[("alone", "save")], gbps[("alone", "load")]
    lines.append(
        f"| MooncakePool put / get_into alone (same values, registered) | - | {a_s:.2f} | {a_l:.2f} "
        f"| {a_s / own_s:.2f}x | {a_l / own_l:.2f}x |"
    )
    lines.append(f"| Mooncake's own batch_put_from / batch_get_into | - | {own_s:.2f} | {own_l:.2f} | 1.00x | 1.00x |")
    lines += ["", "| call (median µs) | api-mooncake | api-ems | mooncake-own |", "|---|---|---|---|"]
    for call, figures in per_call.items():
        lines.append(f"| {call} | {figures['api-mooncake']:.0f} | {figures['api-ems']:.0f} | {figures['mooncake-own']:.0f} |")
    print("\n".join(lines))
    shown = [records[(run, op)] for run in runs for op in ("save", "load")]
    print("\nStages of the best jobs (api-mooncake 32 MiB chunks, 16 MiB chunks, then api-ems):\n")
    print(stage_table(shown))
    print("\nStages of the last 1-block api-mooncake save and load:\n")
    print(stage_table([r for r in one_block if r is not None]))
    plot(gbps, runs, ROOT / "perf" / "mooncake.png")


def plot(gbps: dict, runs: list, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{n}\n{c}" for n, c in runs] + ["mooncake own"]
    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(len(labels))
    for i, op in enumerate(("save", "load")):
        values = [gbps[((n, c), op)] for n, c in runs] + [gbps[("own", op)]]
        ax.bar(x + (i - 0.5) * 0.38, values, 0.38, label=op)
    ax.set_xticks(x, labels)
    ax.set_ylabel("GB/s")
    ax.set_title("API on Mooncake vs API on an ems node vs Mooncake's own calls (loopback, 1 MiB blocks)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()

"""The embedded copy path at the engine's pace: per-request and per-block costs, side by side in one run.

Contract: `python perf/bench_copy_path.py [--rounds N] [--no-results] [--json PATH] [--quick]`. Every timed call runs
in this process's main thread and is timed by its CPU clock (`time.thread_time`: robust to other jobs on a shared
host); every row compares figures measured interleaved, round by round, in this run. It prints:

1. **default path vs the memcpy path**: a save (and a load) of 64 scattered blocks of a 256-block cache, 16-token
   blocks, 8 layers, 4 KV heads x 128 fp16 (the row the issue names), and of 32 of 64 blocks of 128 tokens (same
   rows), through `ContextCaching.save`/`load` with `kernel_backend` = auto (the torch path on CPU) and = memcpy
   (one copy per block x layer x K/V), each in its own fresh embedded pool;
2. **ops per call**: the copy backend's operations for a save and a load of 1, 16 and 64 blocks (the kernel
   path issues a number that does not grow with the blocks);
3. **per-block and fixed cost**: a 1-layer cache of 4 KiB blocks, saves and loads of 1 and 64 blocks: the extra
   cost per block ((t64 - t1) / 63) and the 1-block call; and in fresh processes (wall time, several runs) the
   median of the first 20 one-block saves and of the first 20 loads, and the first call of each;
4. **layer sweep**: 8, 32 and 80 layers (GQA 8 x 128 fp16) at 16 and 128 tokens per block: save and load GB/s of a
   ~32 MiB request next to one contiguous `copy_` of the same bytes, full pool (the steady state); plotted to
   perf/copy_path.png.

The figures and the command are appended to perf/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from benchlib import machine

from ems import CcConfig, CcKvOption, ContextCaching, Ems, EmsConfig

HERE = Path(__file__).resolve().parent
OPTION = CcKvOption(timeout=60_000, write_rcache=False)


def _cpu(fn: Callable[[], object]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def _init(capacity: int, backend: str = "auto") -> ContextCaching:
    Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "bench-copy-path"), pool_capacity=capacity, kernel_backend=backend))
    cc = Ems.get_cc()
    if cc is None:
        raise RuntimeError("Ems.get_cc() gave None")
    return cc


def _cache(layers: int, blocks: int, block_size: int, heads: int, head_size: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(layers * 1000 + blocks)
    return [
        [torch.randn(blocks, block_size, heads, head_size, generator=generator).half() for _ in range(2)] for _ in range(layers)
    ]


class Workload:
    """One registered cache on a fresh embedded pool and a request of `count` scattered whole blocks."""

    def __init__(
        self,
        layers: int,
        blocks: int,
        block_size: int,
        count: int,
        heads: int = 4,
        head_size: int = 128,
        backend: str = "auto",
        capacity: int | None = None,
    ) -> None:
        block_bytes = layers * 2 * heads * head_size * 2 * block_size
        self.request_bytes = count * block_bytes
        # room for a few requests: the timed saves evict and reuse buffers (the steady state)
        self.cc = _init(capacity or 4 * self.request_bytes + (4 << 20), backend)
        self.cache = _cache(layers, blocks, block_size, heads, head_size)
        self.cc.register_kvcache(self.cache)
        self.block_size, self.count = block_size, count
        picked = torch.randperm(blocks, generator=torch.Generator().manual_seed(3))[:count]
        self.slots = (picked[:, None] * block_size + torch.arange(block_size)[None, :]).reshape(-1).tolist()
        self.offsets = [block_size] * count
        self._next = 0
        for _ in range(5):  # warm up, and fill the pool
            self.save()

    def save(self) -> None:
        self._next += 1
        hashes = list(range(self._next * self.count, (self._next + 1) * self.count))
        if self.cc.save(self.slots, hashes, self.offsets, OPTION).success != self.count:
            raise RuntimeError("save incomplete")

    def load(self) -> None:
        hashes = list(range(self._next * self.count, (self._next + 1) * self.count))
        if self.cc.load(self.slots, hashes, self.offsets, OPTION).success != self.count:
            raise RuntimeError("load incomplete")

    def ops(self, call: Callable[[], None]) -> int:
        backend = self.cc._backend_for(torch.device("cpu"))
        before = backend.ops_issued
        call()
        return backend.ops_issued - before

    def close(self) -> None:
        Ems.shutdown()


def vs_memcpy(layers: int, blocks: int, block_size: int, count: int, rounds: int) -> dict:
    """Save/load through the default path and the memcpy path, interleaved round by round (medians)."""
    times: dict[str, list[float]] = {k: [] for k in ("save", "load", "save_memcpy", "load_memcpy")}
    nbytes = 0
    for _ in range(rounds):
        for backend, suffix in (("auto", ""), ("memcpy", "_memcpy")):
            w = Workload(layers, blocks, block_size, count, backend=backend)
            try:
                nbytes = w.request_bytes
                times["save" + suffix].append(statistics.median(_cpu(w.save) for _ in range(5)))
                times["load" + suffix].append(statistics.median(_cpu(w.load) for _ in range(5)))
            finally:
                w.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "layers": layers,
        "blocks": f"{count} of {blocks}",
        "tokens": block_size,
        "MiB": nbytes / 2**20,
        "save_gbps": nbytes / med["save"] / 1e9,
        "save_memcpy_gbps": nbytes / med["save_memcpy"] / 1e9,
        "save_ratio": med["save_memcpy"] / med["save"],
        "load_gbps": nbytes / med["load"] / 1e9,
        "load_memcpy_gbps": nbytes / med["load_memcpy"] / 1e9,
        "load_ratio": med["load_memcpy"] / med["load"],
    }


def ops_per_call() -> list[dict]:
    rows = []
    for count in (1, 16, 64):
        w = Workload(8, 256, 16, count)
        try:
            rows.append({"blocks": count, "save_ops": w.ops(w.save), "load_ops": w.ops(w.load), "planes": 16})
        finally:
            w.close()
    return rows


def per_block(rounds: int) -> dict:
    """1 layer, one 1 x 64 fp16 head, 16 tokens: 4 KiB blocks. Medians over many calls."""
    w = Workload(1, 512, 16, 64, heads=1, head_size=64, capacity=64 << 20)
    try:
        cc = w.cc
        calls = 200 * rounds
        counter = iter(range(1 << 20, 1 << 40))

        def save(n: int) -> Callable[[], None]:
            def call() -> None:
                base = next(counter) * 64
                cc.save(w.slots[: 16 * n], list(range(base, base + n)), [16] * n, OPTION)

            return call

        def load(n: int) -> Callable[[], None]:
            def call() -> None:
                if cc.load(w.slots[: 16 * n], list(range(64, 64 + n)), [16] * n, OPTION).success != n:
                    raise RuntimeError("load incomplete")

            return call

        t = {}
        for name, make in (("save", save), ("load", load)):
            if name == "load" and cc.save(w.slots, list(range(64, 128)), [16] * 64, OPTION).success != 64:
                raise RuntimeError("save incomplete")  # (again: the timed saves evicted earlier values)
            for n in (1, 64):
                fn = make(n)
                t[f"{name}{n}"] = statistics.median(_cpu(fn) for _ in range(calls))
        return {
            "save_1_us": 1e6 * t["save1"],
            "load_1_us": 1e6 * t["load1"],
            "save_per_block_us": 1e6 * (t["save64"] - t["save1"]) / 63,
            "load_per_block_us": 1e6 * (t["load64"] - t["load1"]) / 63,
        }
    finally:
        w.close()


# A fresh process's first one-block calls (what an engine's first request meets): registration, then 20 saves of
# new blocks and 20 loads of them, each timed by the wall clock; the process prints its medians and first calls.
_FRESH_PROCESS = """
import json, statistics, time, torch
from ems import CcConfig, CcKvOption, Ems, EmsConfig
torch.set_num_threads(1)
Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "bench-fresh"), pool_capacity=64 << 20))
cc = Ems.get_cc()
cc.register_kvcache([[torch.randn(512, 16, 1, 64).half() for _ in range(2)]])
option = CcKvOption(timeout=60_000, write_rcache=False)
slots = torch.arange(512 * 16, dtype=torch.int64)
saves, loads = [], []
for i in range(20):
    start = time.perf_counter(); cc.save(slots[:16], [1000 + i], [16], option); saves.append(time.perf_counter() - start)
for i in range(20):
    start = time.perf_counter(); cc.load(slots[:16], [1000 + i], [16], option); loads.append(time.perf_counter() - start)
print(json.dumps({"save": statistics.median(saves), "load": statistics.median(loads), "save_first": saves[0],
                  "load_first": loads[0]}))
"""


def fresh_process(runs: int) -> dict:
    """`_FRESH_PROCESS` in `runs` new interpreters: the median of each figure over the runs, in µs."""
    results = []
    for _ in range(runs):
        done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {f"{k}_us": 1e6 * statistics.median(r[k] for r in results) for k in results[0]}


def sweep(rounds: int, layer_counts: tuple[int, ...]) -> list[dict]:
    rows = []
    for layers in layer_counts:
        for block_size in (16, 128):
            block_bytes = layers * 2 * 8 * 128 * 2 * block_size
            count = max(1, (32 << 20) // block_bytes)
            w = Workload(layers, 2 * count, block_size, count, heads=8)
            try:
                source = torch.randn(w.request_bytes // 4)
                target = torch.empty_like(source)
                target.copy_(source)
                save_s, load_s, copy_s = [], [], []
                for _ in range(rounds):
                    save_s.append(_cpu(w.save))
                    load_s.append(_cpu(w.load))
                    copy_s.append(_cpu(lambda: target.copy_(source)))
                n = w.request_bytes
                copy = n / min(copy_s) / 1e9
                rows.append(
                    {
                        "layers": layers,
                        "tokens": block_size,
                        "blocks": count,
                        "MiB": n / 2**20,
                        "save": n / min(save_s) / 1e9,
                        "load": n / min(load_s) / 1e9,
                        "copy": copy,
                    }
                )
            finally:
                w.close()
    return rows


def tables(vs: list[dict], ops: list[dict], fixed: dict, fresh: dict, swept: list[dict]) -> str:
    out = [
        "| layers | blocks | tokens/block | MiB | save GB/s | memcpy path save GB/s | save vs memcpy path "
        "| load GB/s | memcpy path load GB/s | load vs memcpy path |",
        "|" + "---|" * 10,
    ]
    for r in vs:
        out.append(
            f"| {r['layers']} | {r['blocks']} | {r['tokens']} | {r['MiB']:.0f} | {r['save_gbps']:.2f} "
            f"| {r['save_memcpy_gbps']:.2f} | **{r['save_ratio']:.2f}x** | {r['load_gbps']:.2f} "
            f"| {r['load_memcpy_gbps']:.2f} | **{r['load_ratio']:.2f}x** |"
        )
    out += ["", "| blocks per call (8 layers = 16 planes) | copy ops per save | copy ops per load |", "|---|---|---|"]
    out += [f"| {r['blocks']} | {r['save_ops']} | {r['load_ops']} |" for r in ops]
    out += [
        "",
        "| tiny layout (1 layer, 4 KiB blocks) | save | load | goal |",
        "|---|---|---|---|",
        f"| extra cost per block | {fixed['save_per_block_us']:.1f} µs | {fixed['load_per_block_us']:.1f} µs | <= 10 µs |",
        f"| 1-block call | {fixed['save_1_us']:.0f} µs | {fixed['load_1_us']:.0f} µs | <= 60 µs |",
        f"| 1-block call, a fresh process's first 20 (median wall time) | {fresh['save_us']:.0f} µs "
        f"| {fresh['load_us']:.0f} µs | <= 60 µs |",
        f"| a fresh process's first call (wall time) | {fresh['save_first_us']:.0f} µs | {fresh['load_first_us']:.0f} µs | — |",
    ]
    out += [
        "",
        "| layers | tokens/block | blocks | MiB | save GB/s | load GB/s | plain copy GB/s | save/copy | load/copy |",
        "|" + "---|" * 9,
    ]
    for r in swept:
        out.append(
            f"| {r['layers']} | {r['tokens']} | {r['blocks']} | {r['MiB']:.0f} | {r['save']:.2f} "
            f"| {r['load']:.2f} | {r['copy']:.2f} | {r['save'] / r['copy']:.2f} | {r['load'] / r['copy']:.2f} |"
        )
    return "\n".join(out)


def plot(swept: list[dict], target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = np.arange(len(swept))
    ax.bar(x - 0.27, [r["save"] for r in swept], 0.27, label="save")
    ax.bar(x, [r["load"] for r in swept], 0.27, label="load")
    ax.bar(x + 0.27, [r["copy"] for r in swept], 0.27, label="plain copy (limit)")
    ax.set_xticks(x, [f"{r['layers']} layers\n{r['tokens']} tok/block" for r in swept])
    ax.set_ylabel("GB/s (CPU time)")
    ax.set_title("ems embedded pool, ~32 MiB requests, GQA 8x128 fp16, full pool")
    ax.legend()
    fig.tight_layout()
    fig.savefig(target, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="8 and 32 layers only, fewer rounds (not figures to record)")
    ap.add_argument("--no-results", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the API and the plain copy alike: on a shared host, 2-thread ops wait on each other
    host = machine()
    rounds = 2 if args.quick else args.rounds
    vs = [vs_memcpy(8, 256, 16, 64, rounds), vs_memcpy(8, 64, 128, 32, rounds)]
    ops = ops_per_call()
    fixed = per_block(rounds)
    fresh = fresh_process(3 if args.quick else 5)
    swept = sweep(rounds, (8, 32) if args.quick else (8, 32, 80))
    text = tables(vs, ops, fixed, fresh, swept)
    print(text)
    if args.json is not None:
        payload = {"vs_memcpy": vs, "ops": ops, "fixed": fixed, "fresh_process": fresh, "sweep": swept}
        args.json.write_text(json.dumps(payload, indent=1))
    if args.no_results:
        return 0
    plot(swept, HERE / "copy_path.png")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    command = " ".join(["python", "perf/bench_copy_path.py"] + (argv if argv is not None else sys.argv[1:]))
    with (HERE / "RESULTS.md").open("a") as f:
        f.write(
            f"\n## The embedded copy path: per request, per block, per layer count ({datetime.date.today()})\n\n"
            f"Command: `{command}` at commit {commit}. Machine: {host}. Process CPU time of the calling thread, "
            f"medians (vs memcpy: {rounds} rounds of 5 calls, each backend in a fresh pool, interleaved) and "
            f"best of {rounds} (sweep, interleaved with the copy). Plot: `perf/copy_path.png`.\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

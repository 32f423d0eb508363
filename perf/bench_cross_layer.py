"""Cross-layer blocks on CPU: save/load through the public API with a block-major cache vs today's per-layer layout
vs one plain copy of the same bytes.

Contract: `python perf/bench_cross_layer.py [--rounds N] [--layers L] [--clock cpu|wall] [--no-results]`. One model
(L layers, default 16, of 8 KV heads x 128 fp16, 16 tokens per block: a block is 64 KiB per layer, 1 MiB across
the layers, in vLLM's 0.5-2 MB range) registered two ways with the same bytes: per layer (`[layers][K, V]`, one
allocation per layer, as vLLM lays out CPU caches today) and block-major (one `[blocks, layers, 2, block_size,
heads, head_size]` allocation registered as its `[layers, 2, blocks, ...]` view: each block one run of memory).
For each copy backend (`host`, the CPU default; `memcpy`, one copy per block and plane, or per block where the layout
allows; `torch`) it saves one request of 32 scattered whole blocks (32 MiB) with new hashes and loads it back,
on an embedded pool at capacity (every save evicts and reuses buffers: an engine's steady state), and times one
`copy_` of the same bytes (the limit), all interleaved round by round; best of N rounds. It reports GB/s, the
ratios to the plain copy, and copies per block (the backend's `ops_issued` per save / blocks). Prints a table,
writes perf/cross_layer.png, appends the figures and the command to perf/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from benchlib import machine

from ems import CcConfig, CcKvOption, Ems, EmsConfig
from ems.kernels.base import KernelBackend
from ems.kernels.select import get_backend

HERE = Path(__file__).resolve().parent
HEADS, HEAD_SIZE, BLOCK, REQUEST_BLOCKS = 8, 128, 16, 32
BACKENDS = ("host", "memcpy", "torch")
LAYOUTS = ("per-layer", "block-major")
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def _cache(layout: str, layers: int, blocks: int) -> tuple[Any, list[torch.Tensor]]:
    """(what `register_kvcache` is given, the allocations), filled with random fp16."""
    if layout == "block-major":
        store = torch.randn(blocks, layers, 2, BLOCK, HEADS, HEAD_SIZE).to(torch.float16)
        return store.permute(1, 2, 0, 3, 4, 5), [store]
    per_layer = [torch.randn(blocks, 2, BLOCK, HEADS, HEAD_SIZE).to(torch.float16) for _ in range(layers)]
    return [[t[:, 0], t[:, 1]] for t in per_layer], per_layer


def bench(backend: str, layout: str, layers: int, rounds: int, clock: Any) -> dict[str, Any]:
    blocks = 3 * REQUEST_BLOCKS
    block_bytes = layers * 2 * BLOCK * HEADS * HEAD_SIZE * 2
    request_bytes = REQUEST_BLOCKS * block_bytes
    capacity = 3 * (request_bytes + REQUEST_BLOCKS * 128) + (1 << 20)  # room for ~3 requests: saves evict
    Ems.init(EmsConfig(cc_config=CcConfig(0, 0, f"bench-cross-{layout}"), kernel_backend=backend, pool_capacity=capacity))
    try:
        cc = Ems.get_cc()
        assert cc is not None
        kvcache, _ = _cache(layout, layers, blocks)
        cc.register_kvcache(kvcache)
        cross = all(g.cross_layer for g in cc.layout.groups)  # type: ignore[union-attr]
        if cross != (layout == "block-major"):
            raise RuntimeError(f"{layout}: cross-layer detection says {cross}")
        copier = get_backend(torch.device("cpu"), KernelBackend(backend))
        chosen = np.random.default_rng(1).permutation(blocks)[:REQUEST_BLOCKS]
        slots = (chosen[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1).tolist()
        offsets = [BLOCK] * REQUEST_BLOCKS
        option = CcKvOption(timeout=60_000)
        source = torch.randn(request_bytes // 4)
        target = torch.empty_like(source)
        target.copy_(source)
        counter = iter(range(1 << 30))

        def save() -> None:
            base = next(counter) * REQUEST_BLOCKS
            if cc.save(slots, list(range(base, base + REQUEST_BLOCKS)), offsets, option).success != REQUEST_BLOCKS:
                raise RuntimeError("save incomplete")

        def load() -> None:
            last = (next(counter) - 1) * REQUEST_BLOCKS
            if cc.load(slots, list(range(last, last + REQUEST_BLOCKS)), offsets, option).success != REQUEST_BLOCKS:
                raise RuntimeError("load incomplete")

        def timed(fn: Any) -> float:
            start = clock()
            fn()
            return float(clock() - start)

        for _ in range(4):
            save()  # fill the pool: the timed saves evict
        before = copier.ops_issued
        save()
        copies = (copier.ops_issued - before) / REQUEST_BLOCKS
        save_s = load_s = copy_s = float("inf")
        for _ in range(rounds):
            save_s = min(save_s, timed(save))
            load_s = min(load_s, timed(load))
            copy_s = min(copy_s, timed(lambda: target.copy_(source)))
    finally:
        Ems.shutdown()
    copy = request_bytes / copy_s / 1e9
    return {
        "backend": backend,
        "layout": layout,
        "block_MiB": block_bytes / 2**20,
        "MiB": request_bytes / 2**20,
        "save": request_bytes / save_s / 1e9,
        "load": request_bytes / load_s / 1e9,
        "copy": copy,
        "save/copy": request_bytes / save_s / 1e9 / copy,
        "load/copy": request_bytes / load_s / 1e9 / copy,
        "copies/block": copies,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | layout | block MiB | request MiB | save GB/s | load GB/s | plain copy GB/s | save/copy | load/copy "
        "| backend ops per block (save) |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['layout']} | {r['block_MiB']:.2f} | {r['MiB']:.0f} | {r['save']:.2f} | {r['load']:.2f} "
            f"| {r['copy']:.2f} | {r['save/copy']:.2f} | {r['load/copy']:.2f} | {r['copies/block']:g} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], target: Path, layers: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["save/copy"] for r in rows], 0.4, label="save / plain copy")
    ax.bar(x + 0.2, [r["load/copy"] for r in rows], 0.4, label="load / plain copy")
    ax.set_xticks(x, [f"{r['backend']}\n{r['layout']}\n{r['copies/block']:g} copies/block" for r in rows], fontsize=8)
    ax.set_ylabel("ratio to one contiguous copy")
    ax.set_title(f"cross-layer blocks vs per-layer layout, CPU, embedded pool ({layers} layers x 8x128 fp16, 16 tokens)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(target, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, as perf/bench_e2e.py)")
    ap.add_argument("--no-results", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    host = machine()
    rows = [bench(b, layout, args.layers, args.rounds, CLOCKS[args.clock]) for b in BACKENDS for layout in LAYOUTS]
    text = table(rows)
    print(text)
    if args.no_results:
        return 0
    plot(rows, HERE / "cross_layer.png", args.layers)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    command = " ".join(["python", "perf/bench_cross_layer.py"] + (argv if argv is not None else sys.argv[1:]))
    with (HERE / "RESULTS.md").open("a") as f:
        f.write(
            f"\n## Cross-layer blocks vs the per-layer layout vs a plain copy ({datetime.date.today()}, cpu)\n\n"
            f"Command: `{command}` at commit {commit}. Machine: {host}. Save and load of {REQUEST_BLOCKS} scattered "
            f"whole blocks ({args.layers} layers x 8 x 128 fp16, 16 tokens a block) through `ContextCaching.save`/"
            f"`load` on an embedded pool at capacity, per backend and layout (same bytes), best of {args.rounds} "
            f"interleaved rounds by the {args.clock} clock; the limit is one `copy_` of the request's bytes. "
            f"Plot: perf/cross_layer.png.\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

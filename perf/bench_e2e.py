"""End-to-end save/load through the public API on the embedded pool, next to a plain copy of the same bytes.

Contract: `python perf/bench_e2e.py [--device cpu] [--rounds N] [--no-results]`. For a 16-layer GQA model (8 KV
heads × 128, fp16, one allocation per layer and K/V as vLLM lays them out) and 16/64/128 tokens per block, it saves
and loads one request of scattered whole blocks (~32 MiB) with `ContextCaching.save` / `.load` and times one
contiguous `copy_` of the same bytes (the limit), interleaved, best of N rounds (the machines are shared and noisy).
Two pool states: "growing" (every save lands in fresh memory: the store grows, first-touch page faults) and "full"
(the pool is at capacity, so every save evicts and reuses the evicted buffers: the steady state of a long-running
engine). Prints a table, writes perf/e2e.png, appends the figures and the command to perf/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from benchlib import best_of, machine
from ems import CcConfig, CcKvOption, Ems, EmsConfig
from ems.demo import Engine, plain_copy_gbps

HERE = Path(__file__).resolve().parent
LAYERS, HEADS, HEAD_SIZE = 16, 8, 128
REQUEST_BYTES = 32 << 20


def bench(block_size: int, pool_state: str, device: torch.device, rounds: int) -> dict:
    token_bytes = LAYERS * 2 * HEADS * HEAD_SIZE * 2
    blocks = REQUEST_BYTES // (token_bytes * block_size)
    request_bytes = blocks * block_size * token_bytes
    # "full": room for ~3 requests, so every save evicts; "growing": room for every save of the run.
    capacity = 3 * request_bytes if pool_state == "full" else (rounds * 2 + 4) * request_bytes
    Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "bench-e2e"), pool_capacity=capacity))
    try:
        cc = Ems.get_cc()
        engine = Engine(LAYERS, 4 * blocks, block_size, HEADS, HEAD_SIZE, torch.float16, device)
        cc.register_kvcache(engine.kvcache)
        for plane in engine.planes:
            plane.copy_(torch.randn(plane.shape, dtype=torch.float32).to(plane.dtype))
        block_ids = engine.allocate(blocks)
        slots = engine.slots(block_ids)
        offsets = [block_size] * blocks
        option = CcKvOption(timeout=30_000)
        counter = iter(range(1 << 30))

        def save_new() -> None:  # new hashes each round: a real save of blocks the pool has not seen
            base = next(counter) * blocks
            if cc.save(slots, list(range(base, base + blocks)), offsets, option).success != blocks:
                raise RuntimeError("save incomplete")

        if pool_state == "full":
            for _ in range(4):
                save_new()  # fill the pool so that the timed saves evict
        save_s = best_of(save_new, rounds)
        last = (next(counter) - 1) * blocks
        hashes = list(range(last, last + blocks))

        def load() -> None:
            if cc.load(slots, hashes, offsets, option).success != blocks:
                raise RuntimeError("load incomplete")

        load_s = best_of(load, rounds)
        copy = plain_copy_gbps(request_bytes, device, repeats=rounds)
    finally:
        Ems.shutdown()
    save, load_gbps = request_bytes / save_s / 1e9, request_bytes / load_s / 1e9
    return {
        "block": block_size, "pool": pool_state, "blocks": blocks, "MiB": request_bytes / 2**20,
        "save": save, "load": load_gbps, "copy": copy, "save/copy": save / copy, "load/copy": load_gbps / copy,
    }


def table(rows: list[dict]) -> str:
    head = "| tokens/block | pool | blocks | MiB | save GB/s | load GB/s | plain copy GB/s | save/copy | load/copy |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['block']} | {r['pool']} | {r['blocks']} | {r['MiB']:.0f} | {r['save']:.2f} | {r['load']:.2f} "
            f"| {r['copy']:.2f} | {r['save/copy']:.2f} | {r['load/copy']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['block']} tok\n{r['pool']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(x - 0.2, [r["save/copy"] for r in rows], 0.4, label="save / plain copy")
    ax.bar(x + 0.2, [r["load/copy"] for r in rows], 0.4, label="load / plain copy")
    ax.set_xticks(x, labels)
    ax.set_ylabel("ratio to one contiguous copy")
    ax.set_title("ems end to end on the embedded pool (GQA 16 layers x 8x128 fp16)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(target, dpi=120)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-results", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    host = machine()
    rows = [bench(bs, state, device, args.rounds) for bs in (16, 64, 128) for state in ("growing", "full")]
    text = table(rows)
    print(text)
    if args.no_results:
        return 0
    plot(rows, HERE / "e2e.png")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    command = " ".join(["python", "perf/bench_e2e.py"] + (argv if argv is not None else sys.argv[1:]))
    with (HERE / "RESULTS.md").open("a") as f:
        f.write(
            f"\n## End to end on the embedded pool: save/load vs one contiguous copy ({datetime.date.today()}, {device})\n\n"
            f"Command: `{command}` at commit {commit}. Machine: {host}. One request of ~32 MiB of scattered whole blocks "
            f"through `ContextCaching.save`/`load` (checks, planning, gather, checksums, store; get, verify, scatter), "
            f"best of {args.rounds} rounds; the limit is one `copy_` of the same bytes. Plot: `perf/e2e.png`.\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Kernel path vs memcpy path vs one contiguous copy of the same bytes (the limit), on one registered cache.

Contract: `python perf/bench_kernels.py [--device cpu|cuda|npu] [--quick] [--no-results]` builds, for each model
layout (40-layer MHA 40×128, 28-layer GQA 4×128, MLA 1×576 latent in K and V) and block size (16, 64, 128), a
paged cache with one allocation per (layer, K/V) like vLLM, and saves a request of n scattered whole blocks
(`slot_mapping` of full blocks, in random block order, one stored value per block: `gather_pieces` into
value-major staging, what V1 saves do) with each path:

* kernel — the device's production path (`auto`): the Triton kernels on cuda/npu, the vectorised torch path on CPU;
* triton-interpreter — on CPU only, at the smallest size (it is ~1000× slower; correctness tool, not a path);
* memcpy — one copy per (block, plane), what engines without kernels do;
* limit — one contiguous `copy_` of the same number of bytes.

For each it reports GB/s (bytes of the save / time; best of several interleaved rounds, because these machines
are shared and noisy), the ratio to the limit, and device operations per save (`ops_issued` deltas). Prints a
table, writes perf/kernels.png, and appends a section to perf/RESULTS.md (unless --no-results).
On CPU the layer counts and block counts are scaled down (so the run takes < 3 minutes on 2 cores); the table
says which were used. Token-row bytes are those of the real models.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from benchlib import machine

from ems.datapath.planning import value_pieces
from ems.kernels.base import CopyBackend, KernelBackend
from ems.kernels.planes import PlaneSet
from ems.kernels.select import get_backend

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Model:
    name: str
    layers: int  # real layer count
    heads: int
    head_size: int
    dtype: torch.dtype


MODELS = [
    Model("MHA 40x128", 40, 40, 128, torch.float16),
    Model("GQA 4x128", 28, 4, 128, torch.bfloat16),
    Model("MLA 1x576", 61, 1, 576, torch.bfloat16),
]


@dataclass
class Row:
    model: str
    layers: int
    block_size: int
    blocks: int
    row_bytes: int
    save_bytes: int
    gbps: dict[str, float]
    ops: dict[str, int]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]


def _time_rounds(fns: dict[str, Callable[[], None]], device: torch.device, min_s: float, max_rounds: int) -> dict[str, float]:
    """Best time per function over interleaved rounds (warm-up first)."""
    best = {k: float("inf") for k in fns}
    for fn in fns.values():
        fn()
    _sync(device)
    start = time.perf_counter()
    for r in range(max_rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            _sync(device)
            best[k] = min(best[k], time.perf_counter() - t)
        if r >= 2 and time.perf_counter() - start > min_s:
            break
    return best


def make_cache(model: Model, layers: int, num_blocks: int, block_size: int, device: torch.device) -> PlaneSet:
    planes = []
    for _ in range(2 * layers):
        t = torch.empty(num_blocks, block_size, model.heads, model.head_size, dtype=model.dtype, device=device)
        t.view(torch.uint8).random_(1, 255)  # never zeros; any bytes
        planes.append(t)
    return PlaneSet(tuple(planes))


def bench_one(
    model: Model,
    layers: int,
    block_size: int,
    blocks: int,
    device: torch.device,
    backends: dict[str, CopyBackend],
    min_s: float,
    max_rounds: int,
) -> Row:
    gen = torch.Generator().manual_seed(blocks * 1000 + block_size)
    num_blocks = 2 * blocks + 1
    planes = make_cache(model, layers, num_blocks, block_size, device)
    chosen = torch.randperm(num_blocks, generator=gen)[:blocks]
    slots = (chosen[:, None] * block_size + torch.arange(block_size)).reshape(-1).to(torch.int64)
    tokens = int(slots.numel())
    # one stored value per block, back to back in value-major staging (what a V1 save gathers: value format 3)
    tok_start = np.arange(blocks + 1, dtype=np.int64) * block_size
    part_base = np.arange(blocks, dtype=np.int64) * block_size * planes.token_bytes
    pieces = torch.from_numpy(value_pieces(slots.numpy(), block_size, tok_start, part_base)[0])
    out = torch.empty(tokens * planes.token_bytes, dtype=torch.uint8, device=device)
    src = torch.empty_like(out).random_(1, 255)
    dst = torch.empty_like(out)
    fns: dict[str, Callable[[], None]] = {
        name: (lambda b=b: b.gather_pieces(planes, pieces, out)) for name, b in backends.items()
    }
    fns["limit"] = lambda: dst.copy_(src)
    ops: dict[str, int] = {}
    for name, b in backends.items():
        before = b.ops_issued
        b.gather_pieces(planes, pieces, out)
        ops[name] = b.ops_issued - before
    ops["limit"] = 1
    best = _time_rounds(fns, device, min_s, max_rounds)
    nbytes = out.numel() * out.element_size()
    return Row(
        model.name, layers, block_size, blocks, planes.row_bytes, nbytes, {k: nbytes / t / 1e9 for k, t in best.items()}, ops
    )


def format_table(rows: list[Row], paths: list[str]) -> str:
    head = ["model", "layers", "tok/blk", "blocks", "row B", "save MB"]
    for p in paths:
        head += [f"{p} GB/s"]
    for p in paths:
        if p != "limit":
            head += [f"{p}/limit"]
    for p in paths:
        head += [f"{p} ops"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.model, str(r.layers), str(r.block_size), str(r.blocks), str(r.row_bytes), f"{r.save_bytes / 1e6:.1f}"]
        cells += [f"{r.gbps[p]:.3g}" if p in r.gbps else "-" for p in paths]
        cells += [f"{r.gbps[p] / r.gbps['limit']:.2g}" if p in r.gbps else "-" for p in paths if p != "limit"]
        cells += [str(r.ops[p]) if p in r.ops else "-" for p in paths]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[Row], paths: list[str], target: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    labels = [f"{r.model}\nbs{r.block_size} n{r.blocks}" for r in rows]
    x = range(len(rows))
    width = 0.8 / max(1, len([p for p in paths if p != "limit"]))
    for i, p in enumerate([p for p in paths if p != "limit"]):
        ratios = [r.gbps[p] / r.gbps["limit"] if p in r.gbps else 0.0 for r in rows]
        axes[0].bar([j + i * width for j in x], ratios, width, label=p)
        axes[1].bar([j + i * width for j in x], [r.ops.get(p, 0) for r in rows], width, label=p)
    axes[0].axhline(0.7, color="k", linestyle="--", linewidth=0.8, label="0.7 × limit goal")
    axes[0].set_ylabel("GB/s ÷ contiguous copy of the same bytes")
    axes[1].set_ylabel("device ops per save")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=70, fontsize=7)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(target, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="fewer configurations (smoke test)")
    ap.add_argument("--no-results", action="store_true", help="do not append to perf/RESULTS.md or write the plot")
    ap.add_argument("--plot", default=str(HERE / "kernels.png"))
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared 2-core host, multi-threaded copies collapse "
        "whenever another process takes a core)",
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    if cpu:
        torch.set_num_threads(args.threads)

    backends: dict[str, CopyBackend] = {
        "kernel": get_backend(device, KernelBackend.AUTO),
        "memcpy": get_backend(device, KernelBackend.MEMCPY),
    }
    paths = ["kernel", "memcpy", "limit"]
    # layer counts and block counts: real ones on an accelerator, scaled to fit 2 CPU cores and ~3 minutes here
    block_counts = [4, 32, 128] if cpu else [4, 64, 512, 2048]
    budget = 48e6 if cpu else 4e9  # bytes per save at most
    cpu_layers = {"MHA 40x128": 2, "GQA 4x128": 8, "MLA 1x576": 8}
    if args.quick:
        block_counts = [4, 32]
    rows: list[Row] = []
    t0 = time.perf_counter()
    host = machine()
    for model in MODELS:
        layers = cpu_layers[model.name] if cpu else model.layers
        for bs in (16, 64, 128):
            for n in block_counts:
                save = 2 * layers * n * bs * model.heads * model.head_size * torch.empty(0, dtype=model.dtype).element_size()
                if save > budget:
                    continue
                rows.append(bench_one(model, layers, bs, n, device, backends, min_s=1.0 if cpu else 0.2, max_rounds=40))
                print(
                    f"  {model.name} bs{bs} n{n}: " + ", ".join(f"{k} {v:.2f}" for k, v in rows[-1].gbps.items()), file=sys.stderr
                )
    if cpu and not args.quick:
        # the Triton interpreter (kernel source run by numpy) at the smallest size only
        os.environ.setdefault("TRITON_INTERPRET", "1")
        try:
            interp = get_backend(device, KernelBackend.TRITON)
            model = MODELS[1]
            r = bench_one(model, 2, 16, 4, device, {"triton-interpreter": interp, **backends}, 0.1, 3)
            rows.append(r)
            paths = ["kernel", "memcpy", "triton-interpreter", "limit"]
        except RuntimeError as err:
            print(f"triton interpreter skipped: {err}", file=sys.stderr)
    elapsed = time.perf_counter() - t0
    table = format_table(rows, paths)
    print(table)
    kernel_desc = backends["kernel"].describe()
    print(f"\nkernel path on {device}: {kernel_desc}; {elapsed:.0f} s")

    if args.no_results:
        return 0
    title = f"gather (save) on {device}: kernel path = {kernel_desc}"
    plot(rows, paths, Path(args.plot), title)
    goals = goals_text(rows, cpu)
    print(goals)
    results = HERE / "RESULTS.md"
    if not results.exists():
        results.write_text("# Performance results\n")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    except OSError:
        commit = "?"
    scaled = (
        "Scaled down for the CPU: layers "
        + ", ".join(f"{k}: {v}" for k, v in cpu_layers.items())
        + f" (real 40 / 28 / 61); at most {budget / 1e6:.0f} MB per save."
        if cpu
        else "Real layer counts."
    )
    section = (
        f"\n## Kernels: gather paths vs one contiguous copy ({datetime.date.today().isoformat()}, {device})\n\n"
        f"Command: `{' '.join(['python', 'perf/bench_kernels.py'] + (argv if argv is not None else sys.argv[1:]))}`"
        f" at commit {commit}. Machine: {host}. Kernel path: {kernel_desc}. {scaled} "
        f"A save = n whole blocks in random order from a cache of 2n+1 blocks, one allocation per (layer, K/V). "
        f"GB/s = bytes of the save / best time of interleaved rounds. Plot: `perf/{Path(args.plot).name}`.\n\n"
        f"{table}\n\n{goals}\n"
    )
    with results.open("a") as f:
        f.write(section)
    return 0


def goals_text(rows: list[Row], cpu: bool) -> str:
    rows = [r for r in rows if "triton-interpreter" not in r.gbps]  # the interpreter row is a toy-size aside
    big = [r for r in rows if r.row_bytes >= 1024 and "kernel" in r.gbps]
    ratios = [r.gbps["kernel"] / r.gbps["limit"] for r in big]
    at16 = [r.gbps["kernel"] / r.gbps["memcpy"] for r in rows if r.block_size == 16 and "memcpy" in r.gbps]
    by_model: dict[tuple[str, int], list[int]] = {}
    for r in rows:
        if "kernel" in r.ops:
            by_model.setdefault((r.model, r.block_size), []).append(r.ops["kernel"])
    constant = all(len(set(v)) == 1 for v in by_model.values())
    lines = [
        "Goals:",
        f"- kernel path >= 0.7 × limit for rows >= 1 KiB: {'met' if ratios and min(ratios) >= 0.7 else 'NOT met'}"
        f" (min {min(ratios):.2f}, median {sorted(ratios)[len(ratios) // 2]:.2f} over {len(ratios)} configs)"
        if ratios
        else "- kernel path vs limit: no rows >= 1 KiB measured",
        f"- kernel path >= 2 × memcpy path at 16-token blocks: {'met' if at16 and min(at16) >= 2 else 'NOT met'}"
        f" (min {min(at16):.2f}×, median {sorted(at16)[len(at16) // 2]:.2f}×)"
        if at16
        else "- no 16-token rows",
        f"- kernel-path device ops per save constant in the number of blocks: {'met' if constant else 'NOT met'}"
        f" ({', '.join(sorted({str(v[0]) for v in by_model.values()}))} ops per save)",
    ]
    small = [r.gbps["kernel"] / r.gbps["limit"] for r in big if r.save_bytes <= 8e6]
    large = [r.gbps["kernel"] / r.gbps["limit"] for r in big if r.save_bytes > 8e6]
    if small and large:
        lines.append(
            f"- kernel/limit by save size (rows >= 1 KiB): <= 8 MB median {sorted(small)[len(small) // 2]:.2f} "
            f"(the limit copy stays in cache there), > 8 MB median {sorted(large)[len(large) // 2]:.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

"""One-shot check of the Triton kernels on an accelerator: correctness against the torch path, then speed.

Contract: `python perf/gpu_check.py OUT [--device cuda|npu|cpu] [--tiny]` runs in a few minutes on one card:

1. correctness: the Triton backend vs the torch backend, gather and scatter of value-major pieces (what V1 saves
   use: whole blocks, runs crossing blocks, repeats, values with header gaps) and of raw segments, over dtypes
   (fp16, bf16, fp32, int8, fp8 e4m3 bytes), odd rows, K/V-interleaved and padded views; any mismatch is printed
   and makes the exit status 1;
2. speed: saves of n whole blocks (random order, one stored value per block, `gather_pieces`) for the MHA/GQA/MLA
   layouts of perf/bench_kernels.py at their real layer counts: Triton GB/s vs the card's device-to-device copy of
   the same bytes (`copy_` of one contiguous buffer: the limit), vs the memcpy path and the torch path, plus device
   ops per save. GB/s counts bytes read + written (2 × the save) for every path, so ratios equal time ratios.

Prints a table and writes the figures (JSON, with the device name) to OUT. `--device cpu --tiny` runs the same code
through the Triton interpreter at toy sizes (a smoke test of this script without a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ems.kernels.base import CopyBackend, PlaneSet

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]


def _best(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def _rand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    t.view(torch.uint8).random_(1, 255)
    return t


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def correctness(device: torch.device, tiny: bool) -> list[str]:
    """Triton vs torch on fresh random data; returns a list of failures (empty = pass)."""
    from ems.kernels.base import PlaneSet
    from ems.kernels.torch_backend import TorchBackend
    from ems.kernels.triton_backend import TritonBackend

    tri, ref = TritonBackend(device), TorchBackend()
    failures: list[str] = []
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn]
    shapes = [(3, 5), (1, 7), (4, 128)] if tiny else [(3, 5), (1, 7), (8, 128), (1, 576), (40, 128)]
    blocks, bs = (6, 8) if tiny else (64, 16)
    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for heads, head_size in shapes:
            for layout in ("plain", "kv_interleaved", "padded_slot"):
                bases, planes_list = [], []
                for _ in range(2):  # two layers
                    if layout == "plain":
                        for _kv in range(2):
                            t = _rand((blocks, bs, heads, head_size), dtype, device)
                            bases.append(t)
                            planes_list.append(t)
                    elif layout == "kv_interleaved":
                        t = _rand((blocks, 2, bs, heads, head_size), dtype, device)
                        bases.append(t)
                        planes_list += [t[:, 0], t[:, 1]]
                    else:
                        row = heads * head_size
                        for _kv in range(2):
                            t = _rand((blocks, bs, row + 3), dtype, device)
                            bases.append(t)
                            planes_list.append(t[:, :, :row].unflatten(-1, (heads, head_size)))
                planes = PlaneSet(tuple(planes_list))
                case = f"{dtype} {heads}x{head_size} {layout}"
                n = planes.num_slots
                # whole blocks, runs crossing blocks, random slots with repeats (gather); distinct slots (scatter)
                slots = torch.cat(
                    [torch.arange(bs, 3 * bs), torch.arange(1, 2 * bs + 3), torch.randint(0, n, (2 * bs,), generator=gen)]
                )
                uniq = torch.randperm(n, generator=gen)[: 2 * bs]
                failures += [f"{what} {case}" for what in pieces_check(tri, ref, bases, planes, slots, uniq, device)]
    # raw segments, odd and aligned
    buf = _rand((1 << 16,), torch.uint8, device)
    for offs, lens in (([3, 1000, 40000], [997, 5, 20001]), ([0, 4096, 8192], [4096, 64, 40000])):
        ptrs = torch.tensor([buf.data_ptr() + o for o in offs])
        ln = torch.tensor(lens)
        out = _rand((int(ln.sum()),), torch.uint8, device)
        tri.gather_segments(ptrs, ln, out)
        want = torch.cat([buf[o : o + n] for o, n in zip(offs, lens)])
        if not torch.equal(out, want):
            failures.append(f"gather_segments {offs}")
    return failures


def pieces_check(
    tri: CopyBackend,
    ref: CopyBackend,
    bases: list[torch.Tensor],
    planes: PlaneSet,
    slots: torch.Tensor,
    unique: torch.Tensor,
    device: torch.device,
) -> list[str]:
    """Value-major pieces (what V1 saves use): Triton vs torch gather into values with 40-byte gaps (headers); a
    Triton scatter vs a torch scatter into a copy of the cache (every byte, padding included, must match); returns
    the failed checks."""
    import numpy as np

    from ems.kernels.base import PlaneSet
    from ems.kernels.plan import value_pieces

    def layout(s: torch.Tensor) -> tuple[torch.Tensor, int]:
        t = s.numel()
        counts = [t // 3, t // 3, t - 2 * (t // 3)]
        tok_start = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        sizes = (40 + np.asarray(counts) * planes.token_bytes + 63) // 64 * 64
        starts = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        table, _ = value_pieces(s.numpy(), planes.block_size, tok_start, starts[:-1] + 40)
        return torch.from_numpy(table), int(starts[-1])

    failures: list[str] = []
    pieces, total = layout(slots)
    a = torch.full((total,), 0xA5, dtype=torch.uint8, device=device)
    b = a.clone()
    tri.gather_pieces(planes, pieces, a)
    ref.gather_pieces(planes, pieces, b)
    if not torch.equal(a, b):
        failures.append("gather_pieces")
    pieces, total = layout(unique)
    src = _rand((total,), torch.uint8, device)
    copies = [b.clone() for b in bases]
    owner = [
        next(i for i, b in enumerate(bases) if b.untyped_storage().data_ptr() == p.untyped_storage().data_ptr())
        for p in planes.planes
    ]
    twin = PlaneSet(tuple(copies[o].as_strided(p.shape, p.stride(), p.storage_offset()) for o, p in zip(owner, planes.planes)))
    tri.scatter_pieces(planes, pieces, src)
    ref.scatter_pieces(twin, pieces, src)
    if not all(torch.equal(_bytes(b), _bytes(c)) for b, c in zip(bases, copies)):
        failures.append("scatter_pieces (cache bytes)")
    lo = torch.zeros(total, dtype=torch.uint8, device=device)
    hi = torch.full((total,), 0xFF, dtype=torch.uint8, device=device)
    ref.gather_pieces(planes, pieces, lo)
    ref.gather_pieces(planes, pieces, hi)
    written = lo == hi  # bytes a gather writes (whatever the poison)
    if not torch.equal(lo[written], src[written]):
        failures.append("scatter_pieces")
    return failures


def speed(device: torch.device, tiny: bool, reps: int) -> list[dict[str, object]]:
    import bench_kernels as bk
    import numpy as np

    from ems.kernels.memcpy_backend import MemcpyBackend
    from ems.kernels.plan import value_pieces
    from ems.kernels.torch_backend import TorchBackend
    from ems.kernels.triton_backend import TritonBackend

    paths = {"triton": TritonBackend(device), "memcpy": MemcpyBackend(), "torch": TorchBackend()}
    configs = (
        [(m, 16, 4) for m in bk.MODELS]
        if tiny
        else [(m, bs, n) for m in bk.MODELS for bs, n in ((16, 64), (16, 1024), (128, 8), (128, 128))]
    )
    rows: list[dict[str, object]] = []
    for model, bs, n in configs:
        layers = 2 if tiny else model.layers
        save_bytes = 2 * layers * n * bs * model.heads * model.head_size * torch.empty(0, dtype=model.dtype).element_size()
        if save_bytes > 2e9:  # keeps the whole check within a few minutes and well inside device memory
            continue
        planes = bk.make_cache(model, layers, 2 * n + 1, bs, device)
        chosen = torch.randperm(2 * n + 1)[:n]
        slots = (chosen[:, None] * bs + torch.arange(bs)).reshape(-1)
        # one stored value per block, back to back in value-major staging (what a V1 save gathers)
        tok_start = np.arange(n + 1, dtype=np.int64) * bs
        part_base = np.arange(n, dtype=np.int64) * bs * planes.token_bytes
        pieces = torch.from_numpy(value_pieces(slots.numpy(), bs, tok_start, part_base)[0])
        out = torch.empty(slots.numel() * planes.token_bytes, dtype=torch.uint8, device=device)
        src = torch.empty_like(out)
        dst = torch.empty_like(out)
        moved = 2 * out.numel()  # read + write
        row: dict[str, object] = {
            "model": model.name,
            "layers": layers,
            "block_size": bs,
            "blocks": n,
            "row_bytes": planes.row_bytes,
            "save_MB": out.numel() / 1e6,
        }
        limit = _best(lambda d=dst, s=src: d.copy_(s), device, reps)
        row["d2d_copy_GBps"] = moved / limit / 1e9
        for name, backend in paths.items():
            before = backend.ops_issued
            backend.gather_pieces(planes, pieces, out)
            row[f"{name}_ops"] = backend.ops_issued - before
            t = _best(
                lambda b=backend, p=planes, q=pieces, o=out: b.gather_pieces(p, q, o), device, 1 if name == "memcpy" else reps
            )
            row[f"{name}_GBps"] = moved / t / 1e9
            row[f"{name}/copy"] = limit / t
        rows.append(row)
        print("  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), file=sys.stderr)
        del planes, out, src, dst
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="file for the figures (JSON)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (for --device cpu: the Triton interpreter)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        if not args.tiny:
            ap.error("--device cpu runs the Triton interpreter: add --tiny")
        os.environ["TRITON_INTERPRET"] = "1"  # before the first kernel is built (kernels are built lazily)
    elif device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    t0 = time.perf_counter()
    failures = correctness(device, args.tiny)
    print(f"correctness: {'PASS' if not failures else 'FAIL'} ({time.perf_counter() - t0:.1f} s)")
    for f in failures:
        print("  mismatch:", f)
    rows = speed(device, args.tiny, 1 if args.tiny else args.reps)
    cols = [
        "model",
        "layers",
        "block_size",
        "blocks",
        "row_bytes",
        "save_MB",
        "d2d_copy_GBps",
        "triton_GBps",
        "triton/copy",
        "memcpy_GBps",
        "triton_ops",
        "memcpy_ops",
        "torch_GBps",
        "torch_ops",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    Path(args.out).write_text(
        json.dumps(
            {
                "device": name,
                "torch": torch.__version__,
                "tiny": args.tiny,
                "correct": not failures,
                "failures": failures,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"figures written to {args.out} ({time.perf_counter() - t0:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

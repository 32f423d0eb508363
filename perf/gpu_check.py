"""One unattended check of the copy paths on an accelerator: `python perf/gpu_check.py OUT [--device cuda|npu]`.

Written to run in one command, within 5 minutes on one H200, without anyone watching: it never skips a part. A
part that cannot run (no device, no triton, a kernel that fails to build, a wrong byte) is recorded with its error
and the exit status is 1; the figures of every part that did run are still written (JSON, to OUT, after each
part) and printed. `--device cpu --tiny` runs the same code at toy sizes through the Triton interpreter (a smoke
test of this script; its figures mean nothing). Parts:

1. correctness: the Triton kernels against the torch path on device tensors, gather and scatter of value-major
   pieces (whole blocks, runs through blocks, repeats, header gaps) over dtypes (fp16, bf16, fp32, int8, fp8 e4m3
   bytes), odd rows, K/V-interleaved, padded and block-major (cross-layer) views, values 64- and 8-byte aligned (so
   every `VEC` specialisation runs: the part fails if one did not), cross-layer block runs, raw segments;
2. kernel vs device-to-device copy: saves of n whole blocks (one value per block, random order) for the MHA/GQA/
   MLA layouts of perf/bench_kernels.py at their real layer counts, per-layer allocations and block-major ones:
   Triton GB/s vs one contiguous `copy_` of the same bytes (the limit), vs the memcpy and torch paths, ops per save;
3. kernel vs DMA, cross-layer blocks (~2 MiB a block, as vLLM measured): a save as the kernel path does it (one
   gather launch into device staging, then one device-to-pinned-host copy) vs the DMA path (one `cudaMemcpyAsync`
   per block run, cache to pinned host, queued back to back on one side stream: copy engines, no kernel), and a
   load each way back; with one plain copy of the same bytes each way (the link's limit);
4. the public API on device tensors: `Ems.init` (embedded pool), `register_kvcache` of a block-major `[layers, 2,
   blocks, ...]` view and of per-layer tensors, `save` then `load` into a poisoned cache, byte-exact, with
   `kernel_backend` triton and memcpy: the package's pinned staging and side streams (the job records must show the
   device-to-host and host-to-device copy stages);
4b. the vLLM connector's layer-wise transfers vs its step-wise ones (`layer_vs_step`): its worker half around a
   simulated forward, a producer's and a consumer's step each way, byte-exact; the last row names the winner of
   each side (the first lent device decides `transfer_granularity`'s default);
5. decode-step slowdown while saves run: a decode-like step (bf16 GEMMs of a 64-token batch through 1 GiB of
   weights) timed alone, then while saves run back to back on a side stream by the kernel path and by the DMA path:
   the step's slowdown and the saves' GB/s for each;
6. (cuda) the kernels this run compiled, as the driver loaded them: PTX payload accesses (128-bit only on the
   16-byte aligned variants), registers, spills (none).

GB/s counts the bytes a copy writes (a save's bytes), the same for every path of a row, so ratios are time ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from ems.kernels.base import CopyBackend
    from ems.kernels.planes import PlaneSet

sys.path.insert(0, str(Path(__file__).resolve().parent))


class CheckFailed(RuntimeError):
    """A part ran and found something wrong (a mismatch, a missing variant, a path not taken)."""


@dataclass
class Context:
    device: torch.device
    tiny: bool
    reps: int

    def sync(self) -> None:
        if self.device.type != "cpu":
            _module(self.device).synchronize(self.device)


def _module(device: torch.device) -> Any:
    from ems.datapath.devices import device_module

    return device_module(device)


def _best(ctx: Context, fn: Callable[[], object], reps: int | None = None) -> float:
    """Best wall time of `fn` (device work included), after one warm-up run."""
    fn()
    ctx.sync()
    best = float("inf")
    for _ in range(reps or ctx.reps):
        t = time.perf_counter()
        fn()
        ctx.sync()
        best = min(best, time.perf_counter() - t)
    return best


def _rand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    t.view(torch.uint8).random_(1, 255)
    return t


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _pinned(nbytes: int, device: torch.device) -> torch.Tensor:
    from ems.staging import host_buffer

    out = host_buffer(nbytes, device)
    if device.type != "cpu" and not out.is_pinned():
        raise CheckFailed("pinned host memory is not available: the staging and DMA paths would be pageable copies")
    return out


# ------------------------------------------------------------------------------------------------ 1. correctness


def _layout(kind: str, layers: int, blocks: int, bs: int, heads: int, head_size: int, dtype: torch.dtype, device: torch.device):
    from ems.kernels.planes import PlaneSet

    bases: list[torch.Tensor] = []
    planes: list[torch.Tensor] = []
    if kind == "block_major":
        t = _rand((blocks, layers, 2, bs, heads, head_size), dtype, device)
        return [t], PlaneSet(tuple(t[:, layer, kv] for layer in range(layers) for kv in range(2)))
    for _ in range(layers):
        if kind == "plain":
            for _kv in range(2):
                t = _rand((blocks, bs, heads, head_size), dtype, device)
                bases.append(t)
                planes.append(t)
        elif kind == "kv_interleaved":
            t = _rand((blocks, 2, bs, heads, head_size), dtype, device)
            bases.append(t)
            planes += [t[:, 0], t[:, 1]]
        else:  # padded_slot
            row = heads * head_size
            for _kv in range(2):
                t = _rand((blocks, bs, row + 3), dtype, device)
                bases.append(t)
                planes.append(t[:, :, :row].unflatten(-1, (heads, head_size)))
    return bases, PlaneSet(tuple(planes))


def _values(planes: PlaneSet, slots: torch.Tensor, counts: list[int], lead: int) -> tuple[torch.Tensor, int]:
    """Pieces of `slots` cut into values of `counts` tokens, each value `lead` bytes after a 64-byte boundary
    (40: a header before each payload, the payload 8-byte aligned; 64: 64-byte aligned)."""
    from ems.datapath.planning import value_pieces

    tok_start = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    sizes = (lead + np.asarray(counts) * planes.token_bytes + 63) // 64 * 64
    starts = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    table, _ = value_pieces(slots.numpy(), planes.block_size, tok_start, starts[:-1] + lead)
    return torch.from_numpy(table), int(starts[-1])


def _pieces_check(
    tri: CopyBackend,
    ref: CopyBackend,
    bases: list[torch.Tensor],
    planes: PlaneSet,
    slots: torch.Tensor,
    unique: torch.Tensor,
    lead: int,
) -> list[str]:
    """Triton vs torch: a gather into poisoned staging; a scatter into the cache vs the torch scatter into a copy
    (every byte of every allocation, padding included). Returns the failed checks."""
    from ems.kernels.planes import PlaneSet

    device = planes.device
    failures: list[str] = []
    t = slots.numel()
    pieces, total = _values(planes, slots, [t // 3, t // 3, t - 2 * (t // 3)], lead)
    a = torch.full((total,), 0xA5, dtype=torch.uint8, device=device)
    b = a.clone()
    tri.gather_pieces(planes, pieces, a)
    ref.gather_pieces(planes, pieces, b)
    if not torch.equal(a, b):
        failures.append("gather_pieces")
    t = unique.numel()
    pieces, total = _values(planes, unique, [t // 2, t - t // 2], lead)
    src = _rand((total,), torch.uint8, device)
    copies = [x.clone() for x in bases]
    owner = [
        next(i for i, x in enumerate(bases) if x.untyped_storage().data_ptr() == p.untyped_storage().data_ptr())
        for p in planes.planes
    ]
    twin = PlaneSet(tuple(copies[o].as_strided(p.shape, p.stride(), p.storage_offset()) for o, p in zip(owner, planes.planes)))
    tri.scatter_pieces(planes, pieces, src)
    ref.scatter_pieces(twin, pieces, src)
    if not all(torch.equal(_bytes(x), _bytes(c)) for x, c in zip(bases, copies)):
        failures.append("scatter_pieces")
    return failures


def _block_runs_check(tri: CopyBackend, ref: CopyBackend, planes: PlaneSet, blocks: torch.Tensor, lead: int) -> list[str]:
    """Cross-layer block runs (one span per block) gather exactly what the planes' pieces gather."""
    from ems.datapath.planning import block_run_pieces

    runs = planes.block_runs
    if runs is None:
        return ["block_major layout not detected as cross-layer blocks"]
    bs = planes.block_size
    slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)
    pieces, total = _values(planes, slots, [bs] * blocks.numel(), lead)
    table = block_run_pieces(pieces.numpy(), bs)
    if table is None:
        return ["whole blocks gave no block-run pieces"]
    a = torch.full((total,), 0xA5, dtype=torch.uint8, device=planes.device)
    b = a.clone()
    tri.gather_pieces(runs, torch.from_numpy(table), a)
    ref.gather_pieces(planes, pieces, b)
    return [] if torch.equal(a, b) else ["block runs gather"]


def correctness(ctx: Context) -> dict[str, Any]:
    import ems.kernels.triton_backend as tb
    from ems.kernels.torch_backend import TorchBackend

    device = ctx.device
    tri, ref = tb.TritonBackend(device), TorchBackend()
    ran: set[tuple[str, int, int]] = set()
    pieces_constexprs, segments_constexprs = tb.pieces_constexprs, tb.segments_constexprs

    def seen_pieces(elems: int, move: tb.MoveShape, row_units: int, block_size: int, gather: bool) -> dict[str, Any]:
        ran.add(("pieces", move.width, move.vec))
        return pieces_constexprs(elems, move, row_units, block_size, gather)

    def seen_segments(elems: int, move: tb.MoveShape, gather: bool) -> dict[str, Any]:
        ran.add(("segments", move.width, move.vec))
        return segments_constexprs(elems, move, gather)

    tb.pieces_constexprs, tb.segments_constexprs = seen_pieces, seen_segments  # type: ignore[assignment]
    failures: list[str] = []
    cases = 0
    try:
        dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn]
        shapes = [(3, 5), (1, 7), (4, 128)] if ctx.tiny else [(3, 5), (1, 7), (8, 128), (1, 576), (40, 128)]
        blocks, bs = (6, 8) if ctx.tiny else (64, 16)
        gen = torch.Generator().manual_seed(0)
        for dtype in dtypes:
            for heads, head_size in shapes:
                for kind in ("plain", "kv_interleaved", "padded_slot", "block_major"):
                    bases, planes = _layout(kind, 2, blocks, bs, heads, head_size, dtype, device)
                    n = planes.num_slots
                    slots = torch.cat(
                        [torch.arange(bs, 3 * bs), torch.arange(1, 2 * bs + 3), torch.randint(0, n, (2 * bs,), generator=gen)]
                    )
                    uniq = torch.randperm(n, generator=gen)[: 2 * bs]
                    for lead in (64, 40):
                        case = f"{dtype} {heads}x{head_size} {kind} lead {lead}"
                        failures += [f"{f}: {case}" for f in _pieces_check(tri, ref, bases, planes, slots, uniq, lead)]
                        if kind == "block_major":
                            chosen = torch.randperm(blocks, generator=gen)[:4]
                            failures += [f"{f}: {case}" for f in _block_runs_check(tri, ref, planes, chosen, lead)]
                        cases += 1
        buf = _rand((1 << 16,), torch.uint8, device)
        segment_cases = (  # every move shape: 1-, 2-, 4-, 8- and 16-byte aligned ranges
            ([3, 1000, 40000], [997, 5, 20001]),
            ([2, 102], [6, 50]),
            ([4, 100], [12, 400]),
            ([8, 1000], [24, 4000]),
            ([0, 4096, 8192], [4096, 64, 40000]),
        )
        for offs, lens in segment_cases:
            ptrs = torch.tensor([buf.data_ptr() + o for o in offs])
            ln = torch.tensor(lens)
            out = _rand((int(ln.sum()),), torch.uint8, device)
            tri.gather_segments(ptrs, ln, out)
            if not torch.equal(out, torch.cat([buf[o : o + k] for o, k in zip(offs, lens)])):
                failures.append(f"gather_segments {offs}")
        ctx.sync()
    finally:
        tb.pieces_constexprs, tb.segments_constexprs = pieces_constexprs, segments_constexprs  # type: ignore[assignment]
    if tri.describe() != ("triton-interpreter" if device.type == "cpu" else f"triton ({device.type})"):
        failures.append(f"the Triton backend fell back ({tri.describe()}): a kernel failed to build or launch")
    want = {(k, m.width, m.vec) for k in ("pieces", "segments") for m in tb.MOVE_SHAPES}
    missing = sorted(want - ran)
    if missing:
        failures.append(f"kernel variants that never ran: {missing}")
    if failures:
        raise CheckFailed(f"{len(failures)} mismatches: " + "; ".join(failures[:20]))
    return {"cases": cases, "variants_run": sorted(ran)}


# ------------------------------------------------------------------------------------------------ 2. kernel vs copy


def kernel_vs_copy(ctx: Context) -> list[dict[str, Any]]:
    import bench_kernels as bk

    from ems.datapath.planning import block_run_pieces, value_pieces
    from ems.kernels.memcpy_backend import MemcpyBackend
    from ems.kernels.torch_backend import TorchBackend
    from ems.kernels.triton_backend import TritonBackend

    device = ctx.device
    paths: dict[str, CopyBackend] = {"triton": TritonBackend(device), "memcpy": MemcpyBackend(), "torch": TorchBackend()}
    configs = (
        [(m, 16, 4) for m in bk.MODELS]
        if ctx.tiny
        else [(m, bs, n) for m in bk.MODELS for bs, n in ((16, 64), (16, 1024), (128, 128))]
    )
    rows: list[dict[str, Any]] = []
    for model, bs, n in configs:
        layers = 2 if ctx.tiny else model.layers
        esize = torch.empty(0, dtype=model.dtype).element_size()
        save_bytes = 2 * layers * n * bs * model.heads * model.head_size * esize
        if save_bytes > 2e9:  # keeps the part within its minute and well inside device memory
            continue
        for kind in ("per_layer", "block_major"):
            if kind == "per_layer":
                planes = bk.make_cache(model, layers, 2 * n + 1, bs, device)
            else:
                _, planes = _layout("block_major", layers, 2 * n + 1, bs, model.heads, model.head_size, model.dtype, device)
            chosen = torch.randperm(2 * n + 1)[:n]
            slots = (chosen[:, None] * bs + torch.arange(bs)).reshape(-1)
            tok_start = np.arange(n + 1, dtype=np.int64) * bs
            part_base = np.arange(n, dtype=np.int64) * bs * planes.token_bytes
            table = value_pieces(slots.numpy(), bs, tok_start, part_base)[0]
            moved_planes, pieces = planes, torch.from_numpy(table)
            if kind == "block_major":  # what `ems.datapath.planning` hands the backends for whole-block values
                runs, run_table = planes.block_runs, block_run_pieces(table, bs)
                if runs is None or run_table is None:
                    raise CheckFailed(f"{model.name}: block-major cache not detected as cross-layer blocks")
                moved_planes, pieces = runs, torch.from_numpy(run_table)
            out = torch.empty(slots.numel() * planes.token_bytes, dtype=torch.uint8, device=device)
            src = _rand((out.numel(),), torch.uint8, device)
            dst = torch.empty_like(out)
            row: dict[str, Any] = {"model": model.name, "layout": kind, "layers": layers, "block_size": bs, "blocks": n}
            row["save_MB"] = out.numel() / 1e6
            limit = _best(ctx, lambda d=dst, s=src: d.copy_(s))
            row["d2d_copy_GBps"] = out.numel() / limit / 1e9
            for name, backend in paths.items():
                before = backend.ops_issued
                backend.gather_pieces(moved_planes, pieces, out)
                row[f"{name}_ops"] = backend.ops_issued - before
                t = _best(
                    ctx,
                    lambda b=backend, p=moved_planes, q=pieces, o=out: b.gather_pieces(p, q, o),
                    1 if name == "memcpy" else None,
                )
                row[f"{name}_GBps"] = out.numel() / t / 1e9
                row[f"{name}/copy"] = limit / t
            rows.append(row)
            print(
                "  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), file=sys.stderr
            )
            del planes, moved_planes, out, src, dst
    return rows


# ------------------------------------------------------------------------------------------------ 3. kernel vs DMA


@dataclass
class CrossLayerSave:
    """A save of `n` whole blocks of a block-major cache, by the kernel path or by DMA, and its load back."""

    ctx: Context
    planes: PlaneSet
    chosen: list[int]
    pieces: torch.Tensor  # block-run pieces (one per block)
    staging: torch.Tensor  # device staging (kernel path)
    host: torch.Tensor  # pinned host staging, the values back to back
    kernel: CopyBackend

    @classmethod
    def build(cls, ctx: Context, layers: int, heads: int, head_size: int, bs: int, n: int, dtype: torch.dtype) -> CrossLayerSave:
        from ems.datapath.planning import block_run_pieces, value_pieces
        from ems.kernels.triton_backend import TritonBackend

        _, planes = _layout("block_major", layers, 2 * n + 1, bs, heads, head_size, dtype, ctx.device)
        chosen = torch.randperm(2 * n + 1)[:n]
        slots = (chosen[:, None] * bs + torch.arange(bs)).reshape(-1)
        run = planes.block_run_bytes
        table = value_pieces(slots.numpy(), bs, np.arange(n + 1, dtype=np.int64) * bs, np.arange(n, dtype=np.int64) * run)[0]
        run_table = block_run_pieces(table, bs)
        if planes.block_runs is None or run_table is None:
            raise CheckFailed("block-major cache not detected as cross-layer blocks")
        staging = torch.empty(n * run, dtype=torch.uint8, device=ctx.device)
        return cls(
            ctx,
            planes,
            chosen.tolist(),
            torch.from_numpy(run_table),
            staging,
            _pinned(n * run, ctx.device),
            TritonBackend(ctx.device),
        )

    @property
    def runs(self) -> torch.Tensor:
        """`[num_blocks, run_bytes]` view of the cache's block runs."""
        assert self.planes.block_runs is not None
        return self.planes.block_runs.planes[0].view(self.planes.num_blocks, -1)

    @property
    def nbytes(self) -> int:
        return int(self.host.numel())

    def kernel_to_device(self) -> None:
        assert self.planes.block_runs is not None
        self.kernel.gather_pieces(self.planes.block_runs, self.pieces, self.staging)

    def kernel_save(self) -> None:
        """One gather launch into device staging, then one device-to-host copy."""
        self.kernel_to_device()
        self.host.copy_(self.staging, non_blocking=True)

    def dma_to_device(self) -> None:
        run = self.planes.block_run_bytes
        runs = self.runs
        for i, b in enumerate(self.chosen):
            self.staging[i * run : (i + 1) * run].copy_(runs[b], non_blocking=True)

    def dma_save(self) -> None:
        """One cudaMemcpyAsync per block run, cache to pinned host: copy engines, no kernel."""
        run = self.planes.block_run_bytes
        runs = self.runs
        for i, b in enumerate(self.chosen):
            self.host[i * run : (i + 1) * run].copy_(runs[b], non_blocking=True)

    def kernel_load(self) -> None:
        """One host-to-device copy, then one scatter launch."""
        assert self.planes.block_runs is not None
        self.staging.copy_(self.host, non_blocking=True)
        self.kernel.scatter_pieces(self.planes.block_runs, self.pieces, self.staging)

    def dma_load(self) -> None:
        run = self.planes.block_run_bytes
        runs = self.runs
        for i, b in enumerate(self.chosen):
            runs[b].copy_(self.host[i * run : (i + 1) * run], non_blocking=True)


def _cross_layer_configs(tiny: bool) -> list[tuple[str, int, int, int, int, int, torch.dtype]]:
    """(name, layers, heads, head_size, block size, blocks, dtype): blocks of ~2 MiB, saves of ~256 MiB."""
    if tiny:
        return [("GQA tiny", 2, 2, 8, 4, 6, torch.bfloat16)]
    return [
        ("GQA 32L 8x128 bf16", 32, 8, 128, 16, 128, torch.bfloat16),  # 2 MiB a block
        ("MLA 61L 1x576 bf16", 61, 1, 576, 16, 128, torch.bfloat16),  # 2.1 MiB a block (K and V: the latent)
        ("GQA 32L 8x128 bf16, 64 tok", 32, 8, 128, 64, 32, torch.bfloat16),  # 8 MiB a block
    ]


def kernel_vs_dma(ctx: Context) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    module = _module(ctx.device) if ctx.device.type != "cpu" else None
    for name, layers, heads, head_size, bs, n, dtype in _cross_layer_configs(ctx.tiny):
        save = CrossLayerSave.build(ctx, layers, heads, head_size, bs, n, dtype)
        stream = module.Stream(device=ctx.device) if module is not None else None

        def on_side(fn: Callable[[], None], stream: Any = stream) -> Callable[[], None]:
            if stream is None:
                return fn

            def run() -> None:
                stream.wait_stream(module.current_stream(ctx.device))
                with module.stream(stream):
                    fn()
                stream.synchronize()

            return run

        # the two paths give the same bytes, both ways
        save.kernel_save()
        ctx.sync()
        by_kernel = save.host.clone()
        save.host.fill_(0)
        save.dma_save()
        ctx.sync()
        if not torch.equal(save.host, by_kernel):
            raise CheckFailed(f"{name}: the DMA save's bytes differ from the kernel's")
        before = save.runs.clone()
        save.host.copy_(_rand((save.nbytes,), torch.uint8, torch.device("cpu")))
        save.dma_load()
        ctx.sync()
        by_dma = save.runs.clone()
        save.runs.copy_(before)
        save.kernel_load()
        ctx.sync()
        if not torch.equal(save.runs, by_dma):
            raise CheckFailed(f"{name}: the DMA load wrote other bytes than the kernel's")
        host_src = _pinned(save.nbytes, ctx.device)
        device_src = torch.empty(save.nbytes, dtype=torch.uint8, device=ctx.device)
        times = {
            "kernel → device staging": _best(ctx, on_side(save.kernel_to_device)),
            "memcpy per block → device staging": _best(ctx, on_side(save.dma_to_device)),
            "kernel + one D2H (save)": _best(ctx, on_side(save.kernel_save)),
            "DMA per block → pinned host (save)": _best(ctx, on_side(save.dma_save)),
            "one D2H copy (limit)": _best(ctx, on_side(lambda h=host_src, s=save: h.copy_(s.staging, non_blocking=True))),
            "one H2D + scatter kernel (load)": _best(ctx, on_side(save.kernel_load)),
            "DMA per block ← pinned host (load)": _best(ctx, on_side(save.dma_load)),
            "one H2D copy (limit)": _best(ctx, on_side(lambda d=device_src, h=host_src: d.copy_(h, non_blocking=True))),
        }
        row: dict[str, Any] = {
            "config": name,
            "blocks": n,
            "block_MiB": save.planes.block_run_bytes / 2**20,
            "save_MiB": save.nbytes / 2**20,
        }
        row.update({f"{k} GB/s": save.nbytes / t / 1e9 for k, t in times.items()})
        rows.append(row)
        print("  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), file=sys.stderr)
    return rows


# ------------------------------------------------------------------------------------------------ 4. public API


def api_roundtrip(ctx: Context) -> list[dict[str, Any]]:
    from ems import CcConfig, CcKvOption, Ems, EmsConfig
    from ems.records import JobKind, Stage

    layers, blocks, bs, heads, head_size = (2, 8, 4, 2, 8) if ctx.tiny else (32, 256, 16, 8, 128)
    n = 4 if ctx.tiny else 64
    rows: list[dict[str, Any]] = []
    option = CcKvOption(timeout=60_000)
    for backend in ("triton", "memcpy"):
        for kind in ("block_major", "per_layer"):
            capacity = 4 * n * bs * layers * 2 * heads * head_size * 2 + (64 << 20)
            Ems.init(
                EmsConfig(cc_config=CcConfig(0, 0, f"gpu-check-{backend}-{kind}"), kernel_backend=backend, pool_capacity=capacity)
            )
            try:
                cc = Ems.get_cc()
                if cc is None:
                    raise CheckFailed("Ems.get_cc() gave None")
                if kind == "block_major":
                    store = _rand((blocks, layers, 2, bs, heads, head_size), torch.bfloat16, ctx.device)
                    kvcache: Any = store.permute(1, 2, 0, 3, 4, 5)
                    tensors = [store]
                else:
                    kvcache = [
                        [_rand((blocks, bs, heads, head_size), torch.bfloat16, ctx.device) for _ in range(2)]
                        for _ in range(layers)
                    ]
                    tensors = [t for pair in kvcache for t in pair]
                cc.register_kvcache(kvcache)
                cross = [g.cross_layer for g in cc.layout.groups]
                if cross != [kind == "block_major"]:
                    raise CheckFailed(f"{kind}: cross-layer detection gave {cross}")
                chosen = torch.randperm(blocks)[:n]
                slots = (chosen[:, None] * bs + torch.arange(bs)).reshape(-1).tolist()
                hashes = list(range(1000, 1000 + n))
                saved = [t.clone() for t in tensors]
                ctx.sync()
                t0 = time.perf_counter()
                result = cc.save(slots, hashes, [bs] * n, option)
                save_s = time.perf_counter() - t0
                if result.success != n:
                    raise CheckFailed(f"{backend} {kind}: save {result}")
                save_record = cc.jobs.last(JobKind.SAVE)
                for t in tensors:
                    t.view(torch.uint8).random_(1, 255)
                poisoned = [t.clone() for t in tensors]
                ctx.sync()
                t0 = time.perf_counter()
                result = cc.load(slots, hashes, [bs] * n, option)
                ctx.sync()
                load_s = time.perf_counter() - t0
                if result.success != n:
                    raise CheckFailed(f"{backend} {kind}: load {result}")
                load_record = cc.jobs.last(JobKind.LOAD)
                mask = torch.zeros(blocks, dtype=torch.bool)
                mask[chosen] = True
                for t, s, p in zip(tensors, saved, poisoned):
                    dim = 0  # blocks are dim 0 of every tensor here
                    got, want_in, want_out = t.movedim(dim, 0), s.movedim(dim, 0), p.movedim(dim, 0)
                    if not (
                        torch.equal(_bytes(got[mask]), _bytes(want_in[mask]))
                        and torch.equal(_bytes(got[~mask]), _bytes(want_out[~mask]))
                    ):
                        raise CheckFailed(f"{backend} {kind}: the loaded cache differs from the saved one")
                if save_record is None or load_record is None:
                    raise CheckFailed(f"{backend} {kind}: no job records")
                summaries = {"save": save_record.summary(), "load": load_record.summary()}
                copied = [r.stages.get(Stage.COPY) for r in (save_record, load_record)]
                if ctx.device.type != "cpu" and not all(c is not None and c.nbytes > 0 for c in copied):
                    raise CheckFailed(f"{backend} {kind}: no device/host staging copy in the job records: {summaries}")
                nbytes = n * bs * layers * 2 * heads * head_size * 2
                rows.append(
                    {
                        "backend": cc.kernel_backend,
                        "layout": kind,
                        "MiB": nbytes / 2**20,
                        "save_GBps": nbytes / save_s / 1e9,
                        "load_GBps": nbytes / load_s / 1e9,
                        **summaries,
                    }
                )
                print(f"  {rows[-1]}", file=sys.stderr)
            finally:
                Ems.shutdown()
    return rows


# ------------------------------------------------------------------------------------------------ 4b. layer vs step


def layer_vs_step(ctx: Context) -> list[dict[str, Any]]:
    """The vLLM connector's worker half (`EmsWorker`, fed its metadata as vLLM would; embedded pool) with
    `transfer_granularity` "step" and "layer", around a simulated forward (per layer a GEMM, then a read of that
    layer's KV of the step's blocks, so a layer's attention depends on its load): a producer step (the forward with
    `save_kv_layer` per layer, then `wait_for_save`; and until the pool holds the step's blocks) and a consumer step
    (an in-step load of the same blocks, `wait_for_layer_load` before each layer), byte-exact against what was
    saved. The last row names the faster granularity for each side: the connector's default follows it."""
    from ems import Ems
    from ems.integrations import kv_layouts
    from ems.integrations.connector_config import ConnectorConfig
    from ems.integrations.transfer_stats import StatsSink
    from ems.integrations.vllm.context import ConnectorContext
    from ems.integrations.vllm.metadata import BlockTransfer, EmsConnectorMetadata
    from ems.integrations.vllm.worker import EmsWorker

    layers, blocks, bs, heads, hs, n, hidden = (2, 16, 4, 2, 8, 4, 64) if ctx.tiny else (32, 256, 16, 8, 128, 64, 4096)
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
    weight = _rand((hidden, hidden), torch.bfloat16, ctx.device)
    act = _rand((256 if not ctx.tiny else 8, hidden), torch.bfloat16, ctx.device)
    ids = list(range(n))
    rows: list[dict[str, Any]] = []

    def forward(worker: EmsWorker | None, meta: Any, caches: dict[str, torch.Tensor], saving: bool) -> float:
        x = act
        sink = torch.zeros((), device=ctx.device, dtype=torch.float32)
        for name in names:
            if worker is not None and not saving:
                worker.wait_for_layer_load(name)
                sink += caches[name][:, n : 2 * n].float().sum()  # this layer's attention reads its loaded blocks
            x = torch.tanh(x @ weight)
            if worker is not None and saving:
                caches[name][:, :n].add_(1)  # the layer writes its KV of the step's blocks
                worker.save_kv_layer(name, meta)
        if worker is not None:
            worker.wait_for_save(meta)
        ctx.sync()
        return float(sink)

    compute_s = _best(ctx, lambda: forward(None, None, {}, True))
    for granularity in ("step", "layer"):
        config = ConnectorConfig.from_extra(
            {
                "local_pool": "off",
                "transfer_granularity": granularity,
                "step_policy": "in_step",
                "in_step_ms": 60_000,
                "timeout_ms": 60_000,
                "read_cache_capacity": 0,
                "pool_capacity": 64 * n * layers * 4 * bs * heads * hs + (256 << 20),
            }
        )
        Ems.init(config.ems_config(f"gpu-check-layers-{granularity}", "MHA", config.resolve_pool()))
        try:
            cc = Ems.get_cc()
            if cc is None:
                raise CheckFailed("Ems.get_cc() gave None")
            caches = {name: _rand((2, blocks, bs, heads, hs), torch.bfloat16, ctx.device) for name in names}
            planes = kv_layouts.block_planes(caches[names[0]], blocks)
            cctx = ConnectorContext(
                config=config,
                block_size=bs,
                hash_stride=1,
                tp_size=1,
                mla=False,
                num_blocks=blocks,
                layer_names=names,
                shapes=(kv_layouts.shape_of(planes),) * layers,
                backend="FLASH_ATTN",
                model_id="gpu-check-layers",
                pool=config.resolve_pool(),
                cc=cc,
                stats=StatsSink(),
            )
            worker = EmsWorker(cctx)
            worker.register_kv_caches(caches, 0, set())
            rep = [0]

            def produce() -> None:
                rep[0] += 1
                hashes = [(rep[0] << 32 | i).to_bytes(16, "little") for i in ids]
                forward(worker, EmsConnectorMetadata(saves=[BlockTransfer(f"p{rep[0]}", ids, hashes)]), caches, True)

            step_s = _best(ctx, produce)
            t0 = time.perf_counter()
            produce()
            if not worker.wait_saves(120):
                raise CheckFailed(f"{granularity}: saves still pending after 120 s")
            to_pool_s = time.perf_counter() - t0
            saved = {name: caches[name][:, :n].contiguous() for name in names}
            hashes = [(rep[0] << 32 | i).to_bytes(16, "little") for i in ids]
            dst = list(range(n, 2 * n))

            def consume() -> None:
                for name in names:
                    caches[name][:, n : 2 * n].fill_(0)
                ctx.sync()
                meta = EmsConnectorMetadata(loads=[BlockTransfer("c", dst, hashes, in_step=True)])
                worker.start_load_kv(meta)
                forward(worker, meta, caches, False)
                errors = worker.get_block_ids_with_load_errors()
                worker.get_finished(set(), meta)
                if errors:
                    raise CheckFailed(f"{granularity}: load errors {sorted(errors)[:8]}")

            load_s = _best(ctx, consume)
            for name in names:
                if not torch.equal(_bytes(caches[name][:, n : 2 * n].contiguous()), _bytes(saved[name])):
                    raise CheckFailed(f"{granularity}: layer {name} loaded differs from what was saved")
            worker.shutdown()
            rows.append(
                {
                    "granularity": granularity,
                    "blocks": n,
                    "MiB": n * cctx.block_bytes / 2**20,
                    "forward_ms": compute_s * 1e3,
                    "producer_step_ms": step_s * 1e3,
                    "to_pool_ms": to_pool_s * 1e3,
                    "consumer_step_ms": load_s * 1e3,
                }
            )
            print(f"  {rows[-1]}", file=sys.stderr)
        finally:
            Ems.shutdown()
    step, layer = rows
    rows.append(
        {
            "granularity": "winner",
            "producer_step_ms": "layer" if layer["producer_step_ms"] < step["producer_step_ms"] else "step",
            "to_pool_ms": "layer" if layer["to_pool_ms"] < step["to_pool_ms"] else "step",
            "consumer_step_ms": "layer" if layer["consumer_step_ms"] < step["consumer_step_ms"] else "step",
        }
    )
    print(f"  layer vs step: {rows[-1]}", file=sys.stderr)
    return rows


# ------------------------------------------------------------------------------------------------ 5. decode slowdown


def decode_slowdown(ctx: Context) -> list[dict[str, Any]]:
    device = ctx.device
    hidden, batch, matrices, per_step = (64, 4, 2, 4) if ctx.tiny else (8192, 64, 8, 32)
    weights = [torch.randn(hidden, hidden, dtype=torch.bfloat16, device=device) / hidden**0.5 for _ in range(matrices)]
    x = torch.randn(batch, hidden, dtype=torch.bfloat16, device=device)
    steps = 8 if ctx.tiny else 40
    module = _module(device) if device.type != "cpu" else None

    def step() -> None:
        y = x
        for i in range(per_step):
            y = torch.matmul(y, weights[i % matrices])

    min_saves = 1 if ctx.tiny else 3

    def timed_steps(saves: Callable[[], int] = lambda: min_saves) -> list[float]:
        """At least `steps` steps, and (while saves run) until `min_saves` saves have ended too, at most 60 s."""
        out: list[float] = []
        first, limit = saves(), time.perf_counter() + 60
        while len(out) < steps or (saves() - first < min_saves and time.perf_counter() < limit):
            if module is None:
                t = time.perf_counter()
                step()
                out.append(time.perf_counter() - t)
                continue
            start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        return out

    _, layers, heads, head_size, bs, n, dtype = _cross_layer_configs(ctx.tiny)[0]
    save = CrossLayerSave.build(ctx, layers, heads, head_size, bs, n, dtype)
    timed_steps()  # warm-up (GEMM heuristics, allocator)
    alone = statistics.median(timed_steps())
    rows: list[dict[str, Any]] = [{"path": "none", "step_ms": alone * 1e3, "slowdown": 0.0, "saves": 0, "save_GBps": 0.0}]
    for path, fn in (("kernel + one D2H", save.kernel_save), ("DMA per block", save.dma_save)):
        stop = threading.Event()
        done = [0]
        errors: list[BaseException] = []

        def saver(fn: Callable[[], None] = fn) -> None:
            try:
                stream = module.Stream(device=device) if module is not None else None
                while not stop.is_set():
                    if stream is None:
                        fn()
                    else:
                        with module.stream(stream):
                            fn()
                        stream.synchronize()
                    done[0] += 1
            except BaseException as err:  # reported by the main thread
                errors.append(err)

        thread = threading.Thread(target=saver, name=f"gpu-check-{path}", daemon=True)
        thread.start()
        time.sleep(0.05)
        t0, before = time.perf_counter(), done[0]
        during = timed_steps(lambda: done[0])
        elapsed, saves = time.perf_counter() - t0, done[0] - before
        stop.set()
        thread.join(60)
        if errors:
            raise CheckFailed(f"{path}: the saves failed: {errors[0]!r}")
        if thread.is_alive():
            raise CheckFailed(f"{path}: the save thread did not stop within 60 s")
        if saves == 0:
            raise CheckFailed(f"{path}: no save completed while the steps ran")
        med = statistics.median(during)
        rows.append(
            {
                "path": path,
                "step_ms": med * 1e3,
                "slowdown": med / alone - 1.0,
                "saves": saves,
                "save_GBps": saves * save.nbytes / elapsed / 1e9,
            }
        )
        print(f"  {rows[-1]}", file=sys.stderr)
    return rows


# ------------------------------------------------------------------------------------------------ 6. what ran


def _access_widths(ptx: str) -> dict[str, int]:
    """Global loads and stores of a PTX module by kind and width (as tests/kernels/aot_compile.py counts them)."""
    import collections
    import re

    found: collections.Counter[str] = collections.Counter()
    for op, quals in re.findall(r"\b(ld|st)\.global((?:\.[A-Za-z0-9_:]+)*)", ptx):
        kept = [q for q in quals.split(".") if re.fullmatch(r"v\d|[bsuf]\d+", q)]
        found[".".join([op, *kept])] += 1
    return dict(found)


def device_kernels(ctx: Context) -> list[dict[str, Any]]:
    """The kernels this process compiled and ran on the card (cuda): their constexprs, PTX payload accesses,
    registers and spills as the driver loaded them. Fails if a 16-byte aligned variant (VEC=4 on int32) moved
    payload in anything but 128-bit accesses, if any variant spilled, or if no 128-bit variant ran."""
    from ems.kernels.triton_backend import _build

    if ctx.device.type != "cuda":
        raise CheckFailed(f"PTX is read on cuda only, not {ctx.device.type}")
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for name in ("pieces", "segments"):
        fn = _build()[name]
        for caches in fn.device_caches.values():
            for kernel in caches[0].values():
                names = kernel.src.fn.arg_names
                consts = {names[k[0]]: v for k, v in kernel.src.constants.items() if isinstance(k, tuple) and len(k) == 1}
                payload = {k: n for k, n in _access_widths(kernel.asm["ptx"]).items() if k != "ld.b64"}
                shown = ("GATHER", "ROWS", "COLS", "SPAN", "TILE", "VEC")
                row = {
                    "kernel": name,
                    "constexprs": {k: v for k, v in consts.items() if k in shown},
                    "payload_accesses": payload,
                    "n_regs": getattr(kernel, "n_regs", None),
                    "n_spills": getattr(kernel, "n_spills", None),
                }
                rows.append(row)
                if row["n_spills"]:
                    problems.append(f"{name} {row['constexprs']}: {row['n_spills']} spills")
                if consts.get("VEC") == 4 and payload and set(payload) != {"ld.v4.b32", "st.v4.b32"}:
                    problems.append(f"{name} {row['constexprs']}: payload accesses {payload} on a 16-byte aligned path")
    if not any(r["constexprs"].get("VEC") == 4 for r in rows):
        problems.append("no 16-byte aligned (VEC=4) variant was compiled: run the correctness part first")
    if problems:
        raise CheckFailed("; ".join(problems))
    return rows


# ------------------------------------------------------------------------------------------------ main


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append(
            "| " + " | ".join(f"{r.get(c):.3g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols) + " |"
        )
    return "\n".join(lines)


PARTS: dict[str, Callable[[Context], Any]] = {
    "correctness": correctness,
    "kernel_vs_copy": kernel_vs_copy,
    "kernel_vs_dma": kernel_vs_dma,
    "api_roundtrip": api_roundtrip,
    "layer_vs_step": layer_vs_step,
    "decode_slowdown": decode_slowdown,
    "device_kernels": device_kernels,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="file for the figures (JSON), rewritten after each part")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (with --device cpu: the Triton interpreter)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--parts", default="", help="comma-separated, of: " + ", ".join(PARTS) + " (default: all; the last on cuda)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    started = time.perf_counter()
    report: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "tiny": args.tiny, "parts": {}, "errors": {}}

    def write() -> None:
        report["seconds"] = time.perf_counter() - started
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))

    if device.type == "cpu":
        if not args.tiny:
            ap.error("--device cpu runs the Triton interpreter: add --tiny")
        os.environ["TRITON_INTERPRET"] = "1"  # before the first kernel is built (kernels are built lazily)
    else:
        from ems.datapath.devices import device_module

        try:
            module = device_module(device)
            if not module.is_available():
                raise RuntimeError(f"torch sees no {device.type} device")
            report["device"] = str(module.get_device_name(device)) if hasattr(module, "get_device_name") else device.type
            module.set_device(device)
        except Exception as err:
            report["errors"]["device"] = repr(err)
            write()
            print(f"FAIL: no usable {device}: {err!r}", file=sys.stderr)
            return 1
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        report["errors"]["triton"] = "no triton module installed"
        write()
        print("FAIL: no triton module installed (pip install triton for cuda, triton-ascend for npu)", file=sys.stderr)
        return 1
    ctx = Context(device, args.tiny, 1 if args.tiny else args.reps)
    parts = args.parts.split(",") if args.parts else [p for p in PARTS if p != "device_kernels" or device.type == "cuda"]
    for name in parts:
        t0 = time.perf_counter()
        print(f"== {name}", file=sys.stderr)
        try:
            report["parts"][name] = PARTS[name](ctx)
            status = "ok"
        except Exception as err:
            report["errors"][name] = "".join(traceback.format_exception(err))
            status = f"FAILED: {err!r}"
        report.setdefault("part_seconds", {})[name] = time.perf_counter() - t0
        print(f"== {name}: {status} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
        write()
    for name, rows in report["parts"].items():
        print(f"\n### {name}\n")
        print(_table(rows) if isinstance(rows, list) else json.dumps(rows, default=str))
    total = time.perf_counter() - started
    if report["errors"]:
        print(f"\nFAIL ({total:.0f} s): " + ", ".join(report["errors"]), file=sys.stderr)
        for name, text in report["errors"].items():
            print(f"--- {name}\n{text}", file=sys.stderr)
        return 1
    print(f"\nPASS: every part ran ({total:.0f} s); figures in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

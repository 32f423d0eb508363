"""Vectorised torch gather/scatter: the CPU production path, and the fallback on any device.

Contract: `TorchBackend` implements `CopyBackend` (base.py) with one indexing op per plane, whatever the number
of blocks or tokens (plus one host→device copy of the row indices off CPU); `ops_issued` counts them.

How (CPU, the common case): all planes are rows of ONE table: a view of the address span from the lowest to
the highest plane byte, with the widest int element (8/4/2/1 bytes) and a row stride that divides every plane's
address offset and strides. Row index `[t, p]` is computed for all tokens and planes at once (broadcast), and a
gather is ONE `index_select(span, 0, idx, out=out.view(T * P, row))` into the contiguous staging buffer (torch's
per-row fast path), a scatter one `index_copy_`. The span view only ever touches the indexed rows; it is used
within the call and never outlives the planes. Measured on this 2-core host (1 thread, 1 KiB rows, 16 planes):
gather 6.9 vs 5.3 GB/s per-plane, scatter 4.3 vs 2.3 GB/s.

Otherwise (other devices, or a span too odd to view): plane p is viewed as a 2-D row table `[N, row_elems]` over its own storage with row stride
`g = gcd(block_stride, slot_stride)`, so slot s is row `(s // block_size) * block_stride / g +
(s % block_size) * slot_stride / g` of it — one row index per token, shared by every plane with the same
strides. A gather is then `index_select(table, 0, rows, out=out[:, p, :])`, which writes straight into the
strided staging slice in one pass (no temporary); a scatter is `index_copy_`. Elements move as a signed int of
the element's width, so every dtype (fp8 included) is copied bit for bit. Raw V0 segments are the exception:
torch has no batched copy between arbitrary addresses, so they cost one copy each (the Triton backend does them
in one launch).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ems.kernels.base import CopyBackend, PlaneSet
from ems.kernels.plan import runs_to_slots
from ems.kernels.raw_memory import raw_tensor

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_SPAN = 1 << 44  # never view an address span larger than this (planes from unrelated mappings)


_span_cache: Dict[Tuple[object, ...], Optional[Tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray, torch.dtype]]] = {}


def _span_layout(planes: PlaneSet, stage: torch.Tensor) -> Optional[Tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray, torch.dtype]]:
    """(table, plane row offsets [P], block steps [P], slot steps [P], int dtype), cached per addresses and strides:
    the table is an address view that owns no memory, so the cache never keeps a freed cache alive."""
    esize = planes.element_size
    addrs = [int(p.data_ptr()) for p in planes.planes]
    bstr = [b * esize for b in planes.block_strides]
    sstr = [s * esize for s in planes.slot_strides]
    key = (tuple(addrs), tuple(bstr), tuple(sstr), planes.num_blocks, planes.block_size, planes.row_bytes,
           int(stage.data_ptr()) % 8)
    if key in _span_cache:
        return _span_cache[key]
    lo = min(addrs)
    hi = max(a + (planes.num_blocks - 1) * b + (planes.block_size - 1) * s + planes.row_bytes
             for a, b, s in zip(addrs, bstr, sstr))
    result = None
    if hi - lo <= _MAX_SPAN:
        offs = [a - lo for a in addrs]
        width = next(w for w in (8, 4, 2, 1)
                     if all(q % w == 0 for q in offs + bstr + sstr + [planes.row_bytes, lo, int(stage.data_ptr())]))
        g = 0
        for q in offs + bstr + sstr:
            g = math.gcd(g, q)
        g = g or width
        units = planes.row_bytes // width
        n_rows = ((hi - lo) // width - units) // (g // width) + 1
        dtype = _INT_OF_WIDTH[width]
        table = raw_tensor(lo, hi - lo, planes.device).view(dtype).as_strided((n_rows, units), (g // width, 1))
        result = (table, np.array(offs, np.int64) // g, np.array(bstr, np.int64) // g, np.array(sstr, np.int64) // g,
                  dtype)
    if len(_span_cache) > 256:
        _span_cache.clear()
    _span_cache[key] = result
    return result


def _span_table(planes: PlaneSet, slots: torch.Tensor, stage: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.dtype]]:
    """CPU only: (table `[N, row_units]`, row index `[T * P]` int64, int dtype) viewing every plane in one span,
    or None when the layout does not allow it."""
    if planes.device.type != "cpu":
        return None
    layout = _span_layout(planes, stage)
    if layout is None:
        return None
    table, offs, bstep, sstep, dtype = layout
    s = slots.numpy() if slots.device.type == "cpu" else slots.cpu().numpy()
    blocks = s // planes.block_size
    within = s - blocks * planes.block_size
    idx = offs[None, :] + blocks[:, None] * bstep[None, :] + within[:, None] * sstep[None, :]
    return table, torch.from_numpy(idx.reshape(-1)), dtype


def plane_rows(planes: PlaneSet, p: int) -> torch.Tensor:
    """Plane p as `[num_blocks, block_size, row_elems]`, aliasing the registered memory."""
    plane = planes.planes[p]
    return plane.as_strided(
        (planes.num_blocks, planes.block_size, planes.row_elems),
        (plane.stride(0), plane.stride(1), 1),
    )


def _row_table(planes: PlaneSet, p: int) -> Tuple[torch.Tensor, int, int]:
    """Plane p as an int `[N, row_elems]` row table with row stride g; returns (table, block_step, slot_step)
    where slot s is row `(s // block_size) * block_step + (s % block_size) * slot_step`."""
    plane = planes.planes[p]
    bstride, sstride = int(plane.stride(0)), int(plane.stride(1))
    g = math.gcd(bstride, sstride) or 1
    rows = (planes.num_blocks - 1) * (bstride // g) + (planes.block_size - 1) * (sstride // g) + 1
    table = plane.as_strided((rows, planes.row_elems), (g, 1)).view(_INT_OF_WIDTH[planes.element_size])
    return table, bstride // g, sstride // g


class TorchBackend(CopyBackend):
    name = "torch"

    def __init__(self) -> None:
        self.ops_issued = 0

    def _plan(self, planes: PlaneSet, slots: torch.Tensor) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Per plane: (row table, row indices on the device); planes with equal strides share the indices."""
        slots = slots.to("cpu", torch.int64)
        blocks = torch.div(slots, planes.block_size, rounding_mode="floor")
        offsets = slots - blocks * planes.block_size
        index_of: Dict[Tuple[int, int], torch.Tensor] = {}
        plan = []
        for p in range(planes.num_planes):
            table, bstep, sstep = _row_table(planes, p)
            rows = index_of.get((bstep, sstep))
            if rows is None:
                rows = (blocks * bstep + offsets * sstep).to(planes.device, non_blocking=True)
                if planes.device.type != "cpu":
                    self.ops_issued += 1
                index_of[(bstep, sstep)] = rows
            plan.append((table, rows))
        return plan

    @staticmethod
    def _int_view(planes: PlaneSet, stage: torch.Tensor) -> torch.Tensor:
        expected = (stage.shape[0], planes.num_planes, planes.row_elems)
        if stage.dim() != 3 or tuple(stage.shape) != expected or stage.dtype != planes.dtype:
            raise ValueError(f"staging must be {planes.dtype} {expected}, got {stage.dtype} {tuple(stage.shape)}")
        return stage.view(_INT_OF_WIDTH[planes.element_size])

    def gather_slots(self, planes: PlaneSet, slots: torch.Tensor, out: torch.Tensor) -> None:
        out_int = self._int_view(planes, out)
        if slots.numel() == 0:
            return
        span = _span_table(planes, slots, out)
        if span is not None:
            table, idx, dtype = span
            torch.index_select(table, 0, idx, out=out.view(-1).view(torch.uint8).view(dtype).view(idx.numel(), -1))
            self.ops_issued += 1
            return
        for p, (table, rows) in enumerate(self._plan(planes, slots)):
            torch.index_select(table, 0, rows, out=out_int[:, p, :])
            self.ops_issued += 1

    def scatter_slots(self, planes: PlaneSet, slots: torch.Tensor, src: torch.Tensor) -> None:
        src_int = self._int_view(planes, src)
        if slots.numel() == 0:
            return
        span = _span_table(planes, slots, src)
        if span is not None:
            table, idx, dtype = span
            table.index_copy_(0, idx, src.reshape(-1).view(torch.uint8).view(dtype).view(idx.numel(), -1))
            self.ops_issued += 1
            return
        for p, (table, rows) in enumerate(self._plan(planes, slots)):
            table.index_copy_(0, rows, src_int[:, p, :])
            self.ops_issued += 1

    def gather_runs(
        self, planes: PlaneSet, starts: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor
    ) -> None:
        self.gather_slots(planes, runs_to_slots(starts, lengths), out)

    def scatter_runs(
        self, planes: PlaneSet, starts: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor
    ) -> None:
        self.scatter_slots(planes, runs_to_slots(starts, lengths), src)

    def gather_segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> None:
        position = 0
        for ptr, length in zip(ptrs.tolist(), lengths.tolist()):
            out[position : position + length].copy_(raw_tensor(ptr, length, out.device))
            position += length
            self.ops_issued += 1

    def scatter_segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor) -> None:
        position = 0
        for ptr, length in zip(ptrs.tolist(), lengths.tolist()):
            raw_tensor(ptr, length, src.device).copy_(src[position : position + length])
            position += length
            self.ops_issued += 1

"""Vectorised torch gather/scatter: the CPU production path, and the fallback on any device.

Contract: `TorchBackend` implements `CopyBackend` (base.py) with one indexing op per plane, whatever the number
of blocks or tokens (plus one host→device copy of the row indices off CPU); `ops_issued` counts them.

How: plane p is viewed as a 2-D row table `[N, row_elems]` over its own storage with row stride
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
from typing import Dict, List, Tuple

import torch

from ems.kernels.base import CopyBackend, PlaneSet
from ems.kernels.plan import runs_to_slots  # noqa: F401 - also re-exported for older imports
from ems.kernels.raw_memory import raw_tensor

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
        for p, (table, rows) in enumerate(self._plan(planes, slots)):
            torch.index_select(table, 0, rows, out=out_int[:, p, :])
            self.ops_issued += 1

    def scatter_slots(self, planes: PlaneSet, slots: torch.Tensor, src: torch.Tensor) -> None:
        src_int = self._int_view(planes, src)
        if slots.numel() == 0:
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

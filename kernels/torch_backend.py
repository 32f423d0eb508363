"""Vectorised torch gather/scatter: the CPU production path, and the fallback on any device.

Each plane is viewed as `[num_blocks, block_size, row_elems]` with its own strides and indexed by
(block, offset) pairs, so one indexing op per plane moves all tokens whatever their number: the number of
device operations grows with planes, never with blocks or tokens. Raw V0 segments are the exception: torch has no
batched copy between arbitrary addresses, so they cost one copy each (the Triton backend does them in one launch).
"""

from __future__ import annotations

import torch

from ems.kernels.base import CopyBackend, PlaneSet
from ems.kernels.raw_memory import raw_tensor


def plane_rows(planes: PlaneSet, p: int) -> torch.Tensor:
    """Plane p as `[num_blocks, block_size, row_elems]`, aliasing the registered memory."""
    plane = planes.planes[p]
    return plane.as_strided(
        (planes.num_blocks, planes.block_size, planes.row_elems),
        (plane.stride(0), plane.stride(1), 1),
    )


def runs_to_slots(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Expand runs into their slots: int64 `[sum(lengths)]` (CPU, vectorised)."""
    total = int(lengths.sum())
    run_of_token = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=total)
    first_token = torch.cumsum(lengths, 0) - lengths
    return starts[run_of_token] + (torch.arange(total) - first_token[run_of_token])


def _split(planes: PlaneSet, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    slots = slots.to(planes.device, non_blocking=True)
    return torch.div(slots, planes.block_size, rounding_mode="floor"), torch.remainder(slots, planes.block_size)


class TorchBackend(CopyBackend):
    name = "torch"

    def gather_slots(self, planes: PlaneSet, slots: torch.Tensor, out: torch.Tensor) -> None:
        blocks, offsets = _split(planes, slots)
        for p in range(planes.num_planes):
            out[:, p, :] = plane_rows(planes, p)[blocks, offsets]

    def scatter_slots(self, planes: PlaneSet, slots: torch.Tensor, src: torch.Tensor) -> None:
        blocks, offsets = _split(planes, slots)
        for p in range(planes.num_planes):
            plane_rows(planes, p)[blocks, offsets] = src[:, p, :]

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

    def scatter_segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor) -> None:
        position = 0
        for ptr, length in zip(ptrs.tolist(), lengths.tolist()):
            raw_tensor(ptr, length, src.device).copy_(src[position : position + length])
            position += length

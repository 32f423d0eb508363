"""The registered tensors of one layer group as the copy backends see them (`PlaneSet`): the cache's geometry.

Contract: a `PlaneSet` is built once per registered layer group (`ems.datapath.layout`) and never changes: its
planes, their shapes, strides and dtypes, and everything derived from them (row bytes, each plane's offset inside a
token of value-major staging, the cross-layer block runs) are computed on first use and kept on the instance, so a
call reads them as attributes. What the backends do with it (gather and scatter of pieces) is `base.py`'s contract.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PlaneSet:
    """The registered tensors of one layer group, as the copy backends see them.

    planes: P tensors; plane `2*i + kv` is the K (kv=0) or V (kv=1) tensor of the group's i-th layer. Each is
        `[num_blocks, block_size, heads_p, head_size_p]` on one device, all with the same `num_blocks` and
        `block_size` (a slot names the same row of every plane); heads, head size and dtype may differ per plane
        (MLA with split K/V). Each token row (`heads_p * head_size_p` elements) is contiguous; blocks and slots may
        be strided (views such as K and V interleaved per block).
    Slot s of plane p is the row at element offset
        `(s // block_size) * block_strides[p] + (s % block_size) * slot_strides[p]` from `planes[p]`'s data pointer.
    """

    planes: tuple[torch.Tensor, ...]
    # (the shape and stride properties are cached per instance: a PlaneSet's tensors never change shape)

    def __post_init__(self) -> None:
        if not self.planes:
            raise ValueError("a PlaneSet needs at least one plane")
        first = self.planes[0]
        for p in self.planes:
            if p.dim() != 4 or p.shape[:2] != first.shape[:2] or p.device != first.device:
                raise ValueError(
                    "every plane of a PlaneSet must be [num_blocks, block_size, heads, head_size] with the same "
                    f"num_blocks, block_size and device; got {tuple(p.shape)} on {p.device} and "
                    f"{tuple(first.shape)} on {first.device}"
                )

    @functools.cached_property
    def num_planes(self) -> int:
        return len(self.planes)

    @functools.cached_property
    def num_blocks(self) -> int:
        return int(self.planes[0].shape[0])

    @functools.cached_property
    def block_size(self) -> int:
        return int(self.planes[0].shape[1])

    @functools.cached_property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @functools.cached_property
    def uniform(self) -> bool:
        """Whether every plane has one row shape and dtype (then `row_elems`, `dtype`, ... describe them all)."""
        first = self.planes[0]
        return all(p.shape[2:] == first.shape[2:] and p.dtype == first.dtype for p in self.planes)

    def _uniform_only(self, what: str) -> torch.Tensor:
        if not self.uniform:
            raise ValueError(f"PlaneSet.{what} is per plane here (planes differ in row size or dtype): use plane_{what}")
        return self.planes[0]

    @property
    def row_elems(self) -> int:
        first = self._uniform_only("row_elems")
        return int(first.shape[2] * first.shape[3])

    @property
    def dtype(self) -> torch.dtype:
        return self._uniform_only("dtype").dtype

    @property
    def element_size(self) -> int:
        return self._uniform_only("element_size").element_size()

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.element_size

    @functools.cached_property
    def plane_row_elems(self) -> tuple[int, ...]:
        return tuple(int(p.shape[2] * p.shape[3]) for p in self.planes)

    @functools.cached_property
    def plane_element_sizes(self) -> tuple[int, ...]:
        return tuple(p.element_size() for p in self.planes)

    @functools.cached_property
    def plane_row_bytes(self) -> tuple[int, ...]:
        return tuple(r * e for r, e in zip(self.plane_row_elems, self.plane_element_sizes))

    @functools.cached_property
    def plane_offsets(self) -> tuple[int, ...]:
        """Byte offset of plane p's row inside one token of staging."""
        offsets, position = [], 0
        for nbytes in self.plane_row_bytes:
            offsets.append(position)
            position += nbytes
        return tuple(offsets)

    @functools.cached_property
    def token_bytes(self) -> int:
        """Bytes of one token in staging: every plane's row."""
        return sum(self.plane_row_bytes)

    @functools.cached_property
    def device(self) -> torch.device:
        return self.planes[0].device

    @functools.cached_property
    def block_strides(self) -> tuple[int, ...]:
        """Per plane, in that plane's elements."""
        return tuple(int(p.stride(0)) for p in self.planes)

    @functools.cached_property
    def slot_strides(self) -> tuple[int, ...]:
        """Per plane, in that plane's elements."""
        return tuple(int(p.stride(1)) for p in self.planes)

    @functools.cached_property
    def block_stride_bytes(self) -> tuple[int, ...]:
        return tuple(s * e for s, e in zip(self.block_strides, self.plane_element_sizes))

    @functools.cached_property
    def slot_stride_bytes(self) -> tuple[int, ...]:
        return tuple(s * e for s, e in zip(self.slot_strides, self.plane_element_sizes))

    @functools.cached_property
    def block_run_bytes(self) -> int:
        """Bytes of one block of every plane: `block_size * token_bytes`."""
        return self.block_size * self.token_bytes

    @functools.cached_property
    def block_runs(self) -> PlaneSet | None:
        """Cross-layer blocks: where the planes (two or more) keep each block's rows together, one contiguous run
        per block, plane after plane with each plane's rows back to back (`[planes][block_size][row]`, the order
        of a stored value's part), this run as the single row of a `[num_blocks, 1, 1, block_run_bytes]` uint8
        PlaneSet over the same memory; else None. A value of one whole block is then exactly its block's run:
        the copy backends move it as ONE run (one copy, one kernel span), wherever the planes were registered from
        (e.g. `[layers, 2, blocks, ...]` views of block-major storage, or vLLM's block-outermost layouts).
        Requires one allocation (never two that happen to be adjacent) and blocks that do not overlap."""
        if self.num_planes < 2:
            return None
        first = self.planes[0]
        storage = first.untyped_storage().data_ptr()
        start = int(first.data_ptr())
        stride = self.block_stride_bytes[0]
        for p, plane in enumerate(self.planes):
            if plane.untyped_storage().data_ptr() != storage:
                return None
            if self.block_size > 1 and self.slot_stride_bytes[p] != self.plane_row_bytes[p]:
                return None
            if self.num_blocks > 1 and self.block_stride_bytes[p] != stride:
                return None
            if int(plane.data_ptr()) != start + self.block_size * self.plane_offsets[p]:
                return None
        run = self.block_run_bytes
        if self.num_blocks > 1 and stride < run:
            return None
        raw = torch.empty(0, dtype=torch.uint8, device=first.device)
        raw.set_(
            first.untyped_storage(),
            first.storage_offset() * first.element_size(),
            (self.num_blocks, 1, 1, run),
            (stride if self.num_blocks > 1 else run, run, run, 1),
        )
        return PlaneSet((raw,))

"""The copy-backend contract: what every gather/scatter implementation (Triton, torch, memcpy) must do.

A save gathers the scattered token rows it names out of the registered paged KV cache into a contiguous staging
buffer; a load scatters them back. Three request forms reduce to three pairs of operations:

* slots (V1 slot_mapping): token t is the row at slot `slots[t]` of every plane;
* runs (V1 chunk_descs): run r is `lengths[r]` consecutive slots from `starts[r]`; runs are laid out one after the
  other, so the tokens of run r are `cumsum(lengths)[r-1] ...`;
* segments (V0 KvBufferWrapper): raw device address ranges, concatenated.

Layout of a group's staging region: `[tokens, planes, row_elems]`, token-major, so that the rows of consecutive
tokens of one block (all layers' K and V) form one contiguous byte range: that range is the stored value.

Rules every backend keeps:
* A gather writes every element of `out`; a scatter writes exactly the rows it names and nothing else.
* Plan arrays (`slots`, `starts`, `lengths`, `ptrs`, segment `lengths`) arrive as int64 CPU tensors, already
  validated (every slot inside the cache); a backend moves them to the device itself.
* Work is queued on the caller's current stream of the device; the caller synchronises.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Tuple

import torch

from ems.kernels.plan import runs_to_slots


class KernelBackend(str, enum.Enum):
    """Which implementation moves the bytes (`EMS_KERNEL_BACKEND`)."""

    AUTO = "auto"  # Triton on cuda/npu, torch on CPU
    TRITON = "triton"  # Triton kernels; on CPU tensors this is the (slow) Triton interpreter
    TORCH = "torch"  # vectorised torch indexing
    MEMCPY = "memcpy"  # one copy per (block or run, plane), as engines without kernels do it


@dataclass(frozen=True)
class PlaneSet:
    """The registered tensors of one layer group, as the copy backends see them.

    planes: P tensors; plane `2*i + kv` is the K (kv=0) or V (kv=1) tensor of the group's i-th layer. Each is
        `[num_blocks, block_size, heads, head_size]`, all of one dtype, device and shape. Each token row
        (`heads * head_size` elements) is contiguous; blocks and slots may be strided (views such as K and V
        interleaved per block).
    Slot s of plane p is the row at element offset
        `(s // block_size) * block_strides[p] + (s % block_size) * slot_strides[p]` from `planes[p]`'s data pointer.
    """

    planes: Tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        if not self.planes:
            raise ValueError("a PlaneSet needs at least one plane")

    @property
    def num_planes(self) -> int:
        return len(self.planes)

    @property
    def num_blocks(self) -> int:
        return int(self.planes[0].shape[0])

    @property
    def block_size(self) -> int:
        return int(self.planes[0].shape[1])

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def row_elems(self) -> int:
        return int(self.planes[0].shape[2] * self.planes[0].shape[3])

    @property
    def dtype(self) -> torch.dtype:
        return self.planes[0].dtype

    @property
    def element_size(self) -> int:
        return self.planes[0].element_size()

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.element_size

    @property
    def device(self) -> torch.device:
        return self.planes[0].device

    @property
    def block_strides(self) -> Tuple[int, ...]:
        return tuple(int(p.stride(0)) for p in self.planes)

    @property
    def slot_strides(self) -> Tuple[int, ...]:
        return tuple(int(p.stride(1)) for p in self.planes)


class CopyBackend(abc.ABC):
    """Moves token rows between a `PlaneSet` and staging memory on the same device."""

    #: the name shown in logs and in the demo's table, e.g. "triton", "torch", "memcpy"
    name: str = "abstract"
    #: device operations (kernel launches, copies, plan-table uploads) this backend has queued so far; perf
    #: scripts read differences of it. Counting only: never used for control flow.
    ops_issued: int = 0

    @abc.abstractmethod
    def gather_slots(self, planes: PlaneSet, slots: torch.Tensor, out: torch.Tensor) -> None:
        """out[t, p, :] = row `slots[t]` of plane p.

        slots: int64 `[T]` (CPU); repeats and any order allowed.
        out: `[T, P, row_elems]`, contiguous, `planes.dtype`, on `planes.device`.
        """

    @abc.abstractmethod
    def scatter_slots(self, planes: PlaneSet, slots: torch.Tensor, src: torch.Tensor) -> None:
        """Row `slots[t]` of plane p = src[t, p, :]; no other row changes.

        slots: int64 `[T]` (CPU), no repeats. src: `[T, P, row_elems]`, contiguous, on `planes.device`.
        """

    @abc.abstractmethod
    def gather_runs(
        self, planes: PlaneSet, starts: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Run r (slots `starts[r] .. starts[r] + lengths[r] - 1`) fills tokens `sum(lengths[:r]) ...` of out.

        starts, lengths: int64 `[R]` (CPU), lengths >= 1. out: `[sum(lengths), P, row_elems]`, contiguous.
        """

    @abc.abstractmethod
    def scatter_runs(
        self, planes: PlaneSet, starts: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor
    ) -> None:
        """The inverse of `gather_runs`: writes exactly the slots the runs name."""

    @abc.abstractmethod
    def gather_segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> None:
        """Concatenate raw device ranges: out[sum(lengths[:i]) : ... + lengths[i]] = bytes at ptrs[i].

        ptrs, lengths: int64 `[S]` (CPU), addresses on `out.device`. out: uint8 `[sum(lengths)]`.
        """

    @abc.abstractmethod
    def scatter_segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor) -> None:
        """The inverse of `gather_segments`: bytes at ptrs[i] = src[sum(lengths[:i]) : ... + lengths[i]]."""

    def describe(self) -> str:
        return self.name


class DirectionalCopyBackend(CopyBackend):
    """A backend written as two directional primitives: rows by slot, and raw segments.

    Runs become slots (`plan.runs_to_slots`); the primitive regroups consecutive slots into contiguous pieces.
    """

    @abc.abstractmethod
    def _rows(self, planes: PlaneSet, slots: torch.Tensor, stage: torch.Tensor, gather: bool) -> None:
        """gather: stage[t, p] = row slots[t] of plane p; otherwise the inverse."""

    @abc.abstractmethod
    def _segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, stage: torch.Tensor, gather: bool) -> None:
        """gather: concatenate the raw ranges into stage; otherwise the inverse."""

    def gather_slots(self, planes: PlaneSet, slots: torch.Tensor, out: torch.Tensor) -> None:
        self._rows(planes, slots, out, gather=True)

    def scatter_slots(self, planes: PlaneSet, slots: torch.Tensor, src: torch.Tensor) -> None:
        self._rows(planes, slots, src, gather=False)

    def gather_runs(
        self, planes: PlaneSet, starts: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor
    ) -> None:
        self._rows(planes, runs_to_slots(starts, lengths), out, gather=True)

    def scatter_runs(
        self, planes: PlaneSet, starts: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor
    ) -> None:
        self._rows(planes, runs_to_slots(starts, lengths), src, gather=False)

    def gather_segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> None:
        self._segments(ptrs, lengths, out, gather=True)

    def scatter_segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor) -> None:
        self._segments(ptrs, lengths, src, gather=False)

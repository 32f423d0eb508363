"""The copy-backend contract: what every gather/scatter implementation (Triton, torch, memcpy) must do.

A save gathers the token rows it names out of the registered paged KV cache into a contiguous staging buffer; a
load scatters them back. Two request forms reduce to two pairs of operations:

* pieces (V1 plans, value format 3: `gather_pieces` / `scatter_pieces`);
* segments (V0 KvBufferWrapper): raw device address ranges, concatenated (`gather_segments` / `scatter_segments`).

Value-major staging: the staging buffer holds whole stored values; inside one value's part of a group, plane p's
rows of that value's `n` tokens are one contiguous run at `base + n * plane_offsets[p]` (plane-major:
`[planes][tokens][row]`; `PlaneSet.token_bytes` is the sum of every plane's row bytes). Planes may differ in row
size and dtype (MLA with split K/V: K = the 512-wide latent, V = the 64-wide rope part). A *piece* is a run of
consecutive slots inside one cache block and one value: int64 row `(start_slot, count, base, value_tokens,
index_in_value)`, its plane-p rows at `base + value_tokens * plane_offsets[p] + (index_in_value + k) * row_bytes[p]`
(`ems.datapath.planning.value_pieces` builds the table). Where a plane's rows are contiguous in the cache (`slot_stride ==
row_elems`), a piece of that plane is ONE span of `count * row_bytes` bytes on both sides: backends move it as a
span, not row by row. Where every plane of a block lies in one run in plane order (cross-layer blocks,
`PlaneSet.block_runs`), a whole-block value is that run: the planner hands the backends the runs as one plane
(`ems.datapath.planning.block_run_pieces`), so each such value is ONE span or copy.

Rules every backend keeps:
* A gather writes exactly the staging bytes its pieces name (a segment gather: all of `out`); a scatter writes
  exactly the rows it names and nothing else.
* Plan arrays (piece tables, segment `ptrs` and `lengths`) arrive as int64 CPU tensors; a backend validates piece
  tables (`check_pieces`: a bad piece is memory corruption) and moves plan arrays to the device itself.
* Work is queued on the caller's current stream of the device; the caller synchronises.
"""

from __future__ import annotations

import abc
import enum
import functools
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch

from ems.kernels.host_copy import host_array, raw_tensor
from ems.settings import KernelBackend as KernelBackend  # the setting's values, kept with the settings


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

    @property
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


# a piece table: int64 `[5, N]` on the host (see `CopyBackend.gather_pieces`)
PieceTable = np.ndarray | torch.Tensor
# value-major staging: a contiguous tensor on the planes' device, or (CPU planes) a contiguous numpy array, e.g. the
# embedded store's own buffer (no round trip through torch for a small call's one value)
Staging = torch.Tensor | np.ndarray


@dataclass(frozen=True)
class Placement:
    """Where a same-host load's node publishes how many of the request's leading values it has placed
    (`progress`: the address of a u32 in the shared region), what interrupts the wait for the next one (`fd`: the
    region's channel, readable once any reply is there or the node hung up), and until when (`deadline_ns`,
    CLOCK_MONOTONIC nanoseconds)."""

    progress: int
    fd: int
    deadline_ns: int


class PlacedStop(enum.IntEnum):
    """Why `scatter_pieces_as_placed` returned (`host_copy.c` `ems_verify_scatter_as_placed`'s codes)."""

    ALL = 0  # every value verified and written
    DAMAGED = 1  # the value at the count failed its check: the load stops there
    INTERRUPTED = 2  # the value at the count had not arrived (a reply came, or the deadline): go on from the reply


class Fusion(enum.Enum):
    """Whether a backend's copies also hash the values (`CopyBackend.fusion`); the data path picks its copier from it
    once per job (`ems.datapath.copier.copier_for`)."""

    #: copies only: a save gathers, then encodes; a load verifies, then scatters (passes of their own)
    SEPARATE = "separate"
    #: also the one-pass copies over bytes still in cache: `gather_pieces_encoded` (a save's gather and encode),
    #: `scatter_pieces_verified` and `scatter_pieces_as_placed` (a load's verify and scatter)
    FUSED = "fused"


class CopyBackend(abc.ABC):
    """Moves token rows between a `PlaneSet` and value-major staging (and raw segments) on the same device."""

    #: the name shown in logs and in the demo's table, e.g. "triton", "host", "torch", "memcpy"
    name: str = "abstract"
    #: device operations (kernel launches, copies, plan-table uploads) this backend has queued so far; perf
    #: scripts read differences of it. Counting only: never used for control flow.
    ops_issued: int = 0
    #: whether the one-pass copies (`gather_pieces_encoded`, `scatter_pieces_verified`, `scatter_pieces_as_placed`)
    #: run here; where they do not, the caller gathers then encodes, verifies then scatters
    fusion: Fusion = Fusion.SEPARATE

    @abc.abstractmethod
    def gather_segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> None:
        """Concatenate raw device ranges: out[sum(lengths[:i]) : ... + lengths[i]] = bytes at ptrs[i].

        ptrs, lengths: int64 `[S]` (CPU), addresses on `out.device`. out: uint8 `[sum(lengths)]`.
        """

    @abc.abstractmethod
    def scatter_segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor) -> None:
        """The inverse of `gather_segments`: bytes at ptrs[i] = src[sum(lengths[:i]) : ... + lengths[i]]."""

    @abc.abstractmethod
    def _pieces(self, planes: PlaneSet, pieces: PieceTable, stage: torch.Tensor, gather: bool) -> None:
        """gather: plane rows of every piece into value-major staging; otherwise the inverse (see the docstring)."""

    def _host_pieces(self, planes: PlaneSet, pieces: PieceTable, stage: np.ndarray, gather: bool) -> None:
        """`_pieces` with numpy staging (CPU planes): through a tensor over it, unless a backend moves numpy itself."""
        self._pieces(planes, pieces, tensor_over(stage), gather)

    def gather_pieces(self, planes: PlaneSet, pieces: PieceTable, out: Staging) -> None:
        """Copy every piece (int64 `[5, N]` on the host, a numpy array or a CPU tensor: start slot, count, base,
        value tokens, index in value) of every plane into value-major staging `out` (contiguous, any dtype: a
        tensor, or for CPU planes a numpy array); bytes no piece names are left unchanged."""
        if isinstance(out, np.ndarray):
            self._host_pieces(planes, pieces, out, gather=True)
        else:
            self._pieces(planes, pieces, out, gather=True)

    def scatter_pieces(self, planes: PlaneSet, pieces: PieceTable, src: Staging) -> None:
        """The inverse of `gather_pieces`: writes exactly the rows the pieces name, nothing else (`src` may be a
        read-only numpy array)."""
        if isinstance(src, np.ndarray):
            self._host_pieces(planes, pieces, src, gather=False)
        else:
            self._pieces(planes, pieces, src, gather=False)

    def gather_pieces_encoded(
        self,
        planes: PlaneSet,
        pieces: PieceTable,
        out: Staging,
        values: np.ndarray,
        heads: np.ndarray,
        piece_end: np.ndarray,
        hash_function: int,
    ) -> None:
        """A save's gather and encode in one pass (only where `fusion` is `Fusion.FUSED`): value v is `out` bytes
        `values[0, v] .. + 40 + values[1, v]` (int64 `[2, V]`: offset, payload length; its 40-byte header first);
        from v = 0 on, its pieces, columns `piece_end[v - 1] .. piece_end[v] - 1` of `pieces` (int64 `[V]`,
        non-decreasing, the last one the number of pieces), are gathered as `gather_pieces` does, then its header
        is written: `heads[v]` (uint8 `[V, 32]`) and the `hash_function` digest of its payload."""
        raise NotImplementedError(f"the {self.name} backend does not encode while gathering")

    def scatter_pieces_verified(
        self,
        planes: PlaneSet,
        pieces: PieceTable,
        src: Staging,
        payloads: np.ndarray,
        expected: np.ndarray,
        piece_end: np.ndarray,
        hash_function: int,
    ) -> int:
        """A load's verify and scatter in one pass (only where `fusion` is `Fusion.FUSED`): value v's payload is
        `src` bytes `payloads[0, v] .. + payloads[1, v]` (int64 `[2, V]`: offset, length); from v = 0 on, it is
        hashed with `hash_function` (a C function `uint64_t (const void *, size_t)`), and if the digest is
        `expected[v]` (uint64 `[V]`) its pieces, columns `piece_end[v - 1] .. piece_end[v] - 1` of `pieces`
        (int64 `[V]`, non-decreasing, the last one the number of pieces), are scattered as `scatter_pieces` does;
        at the first value whose digest is not, it stops. Returns how many values were verified and written."""
        raise NotImplementedError(f"the {self.name} backend does not verify while scattering")

    def scatter_pieces_as_placed(
        self,
        planes: PlaneSet,
        pieces: PieceTable,
        src: Staging,
        values: np.ndarray,
        heads: np.ndarray,
        piece_end: np.ndarray,
        hash_function: int,
        placement: Placement,
    ) -> tuple[int, PlacedStop]:
        """`scatter_pieces_verified` of values that a same-host node is still copying into `src` (only where
        `fusion` is `Fusion.FUSED`): value v is `src` bytes `values[0, v] .. + values[1, v]` (int64 `[2, V]`:
        offset, payload length; its 40-byte header first), taken once `placement`'s progress word exceeds v; its
        header must begin with `heads[v]` (uint8 `[V, 32]`) and its payload hash to the checksum the header states.
        (How many values were verified and written, from the first; why it stopped.)"""
        raise NotImplementedError(f"the {self.name} backend does not verify while scattering")

    def describe(self) -> str:
        return self.name


def tensor_over(array: np.ndarray) -> torch.Tensor:
    """A tensor over a contiguous numpy array's memory (read-only arrays too: a scatter never writes its source)."""
    if not array.flags.c_contiguous:
        raise ValueError("staging must be contiguous")
    flat = array.reshape(-1).view(np.uint8)
    if flat.flags.writeable:
        return torch.from_numpy(flat)
    return raw_tensor(flat.ctypes.data, flat.nbytes, torch.device("cpu")) if flat.size else torch.empty(0, dtype=torch.uint8)


@overload
def check_pieces(planes: PlaneSet, pieces: PieceTable, stage: torch.Tensor, what: str) -> tuple[np.ndarray, torch.Tensor]: ...


@overload
def check_pieces(planes: PlaneSet, pieces: PieceTable, stage: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]: ...


@overload
def check_pieces(planes: PlaneSet, pieces: PieceTable, stage: Staging, what: str) -> tuple[np.ndarray, Staging]: ...


def check_pieces(planes: PlaneSet, pieces: PieceTable, stage: Staging, what: str) -> tuple[np.ndarray, Staging]:
    """Validate a piece table against the planes and the staging buffer; return it as int64 numpy `[5, N]` and the
    staging as flat uint8 (a numpy array stays one). ValueError naming `what` on anything out of range (a bad piece
    is memory corruption)."""
    flat: Staging
    if isinstance(stage, np.ndarray):
        if planes.device.type != "cpu" or not stage.flags.c_contiguous:
            raise ValueError(f"{what} must be a contiguous tensor on {planes.device} (numpy staging: CPU planes only)")
        flat = stage if stage.dtype == np.uint8 and stage.ndim == 1 else stage.reshape(-1).view(np.uint8)
        nbytes = flat.size
    else:
        if stage.device != planes.device or not stage.is_contiguous():
            raise ValueError(f"{what} must be a contiguous tensor on {planes.device}")
        flat = stage if stage.dtype == torch.uint8 and stage.dim() == 1 else stage.reshape(-1).view(torch.uint8)
        nbytes = flat.numel()
    if isinstance(pieces, np.ndarray):  # the planner's own tables (no round trip through torch)
        table = pieces if pieces.dtype == np.int64 else pieces.astype(np.int64)
    elif pieces.dtype == torch.int64 and pieces.device.type == "cpu" and not pieces.requires_grad:
        table = host_array(pieces)  # not .numpy(): it gives the GIL away
    else:
        table = pieces.detach().to("cpu", torch.int64).numpy()
    if table.ndim != 2 or table.shape[0] != 5:
        raise ValueError(f"pieces must be int64 [5, N], got {tuple(table.shape)}")
    if table.shape[1] == 0:
        return table, flat
    if table.shape[1] == 1:  # one piece (a one-block value): the same checks on Python ints, no numpy calls
        start, count, base, tokens, index = table[:, 0].tolist()
        bs = planes.block_size
        if count < 1 or start < 0 or base < 0 or index < 0:
            raise ValueError("pieces need slots >= 0, counts >= 1, bases >= 0 and indices >= 0")
        if start + count > planes.num_slots:
            raise ValueError(f"piece slots out of range [0, {planes.num_slots})")
        if start % bs + count > bs:
            raise ValueError("a piece must stay inside one cache block")
        if index + count > tokens:
            raise ValueError("a piece must stay inside its value")
        if base + tokens * planes.token_bytes > nbytes:
            raise ValueError(f"pieces reach past the end of {what} ({nbytes} bytes)")
        return table, flat
    start, count, base, tokens, index = table
    bs = planes.block_size
    end = index + count
    # every lower bound in one reduction, every upper bound (as a difference that must be <= 0) in another
    if int(count.min()) < 1 or int(table[[0, 2, 4]].min()) < 0:
        raise ValueError("pieces need slots >= 0, counts >= 1, bases >= 0 and indices >= 0")
    over = np.stack(
        [
            start + count - planes.num_slots,
            start % bs + count - bs,
            end - tokens,
            base + tokens * planes.token_bytes - nbytes,
        ]
    ).max(axis=1)
    if int(over[0]) > 0:
        raise ValueError(f"piece slots out of range [0, {planes.num_slots})")
    if int(over[1]) > 0:
        raise ValueError("a piece must stay inside one cache block")
    if int(over[2]) > 0:
        raise ValueError("a piece must stay inside its value")
    if int(over[3]) > 0:
        raise ValueError(f"pieces reach past the end of {what} ({nbytes} bytes)")
    return table, flat

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
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch

from ems.kernels.host_copy import host_array, raw_tensor
from ems.kernels.planes import PlaneSet
from ems.settings import KernelBackend as KernelBackend  # the setting's values, kept with the settings

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

"""The compiled host path: every piece of a CPU request in one C call (`host_copy`), the CPU default where it builds.

Contract: `HostBackend` implements `CopyBackend` (base.py) for CPU planes and staging. A gather or scatter of pieces
is ONE call whatever the number of pieces, planes and piece lengths (`ops_issued` counts calls), except a lone
piece, which takes the torch path's prepared one-piece move (one op, less Python per call); raw V0 segments are
one call too. `CompiledMoves.SCATTERS` (the CPU default) leaves gathers to the torch path. Planes may differ in
row size and dtype (MLA with split K/V), and rows may be strided inside a block: bytes move as they are, by
address, so every dtype (fp8 included) is copied bit for bit. A call keeps the GIL when it moves less than
`host_copy.GIL_HELD_BELOW` bytes and releases it otherwise (see `host_copy`). Per-plane addresses and strides are
computed once per `PlaneSet` and kept on it.

Why: the torch path issues an op per (piece length, plane) or per few hundred rows, each holding the GIL and
giving it away between ops, and runs at 5-8 GB/s on this path's many 64 KiB spans; one memcpy loop runs at the
host's copy speed (perf/RESULTS.md, "The compiled host copy").

Why gathers stay on torch by default: in a vLLM engine (`perf/bench_vllm.py`), compiled gathers made a pooled
request that arrives right after a cold one, whose saves are in flight, wait 0.32-0.48 s for its first token
instead of 0.12-0.16 s, while compiled scatters alone changed nothing there (the quiet pooled load got slightly
faster). The gathers themselves took 5-13 ms; what the engine waited for is not pinned down (a guess: the saves
reach the node sooner and the load queues behind them). Until it is, a save's gather keeps the torch path.
"""

from __future__ import annotations

import enum

import numpy as np
import torch

from ems.kernels.base import CopyBackend, PieceTable, PlacedStop, Placement, PlaneSet, Staging, check_pieces
from ems.kernels.host_copy import GIL_HELD_BELOW, HostCopy, PlaneAddresses
from ems.kernels.raw_memory import address_of, host_array
from ems.kernels.torch_backend import move_pieces


class CompiledMoves(str, enum.Enum):
    """Which piece moves go through the C loop (the others take the torch path)."""

    BOTH = "both"  # gathers and scatters (`EMS_KERNEL_BACKEND=host`)
    SCATTERS = "scatters"  # loads only: the CPU default (AUTO), see the module docstring


VALUE_HEADER = 40  # bytes before a value's payload (`ems.value_format.HEADER_SIZE`; kernels import nothing of ems)


def _plane_addresses(planes: PlaneSet) -> PlaneAddresses:
    cached: PlaneAddresses | None = planes.__dict__.get("_host_plane_addresses")
    if cached is None:
        cached = PlaneAddresses(
            [int(p.data_ptr()) for p in planes.planes],
            list(planes.block_stride_bytes),
            list(planes.slot_stride_bytes),
            list(planes.plane_offsets),
            list(planes.plane_row_bytes),
            planes.block_size,
        )
        planes.__dict__["_host_plane_addresses"] = cached  # lives and dies with the PlaneSet
    return cached


def _staging_address(flat: Staging) -> int:
    return address_of(flat) if isinstance(flat, np.ndarray) else int(flat.data_ptr())


class HostBackend(CopyBackend):
    name = "host"

    def __init__(self, library: HostCopy, moves: CompiledMoves = CompiledMoves.BOTH) -> None:
        self.library = library
        self.moves = moves
        self.ops_issued = 0

    def describe(self) -> str:
        return self.name if self.moves == CompiledMoves.BOTH else f"{self.name} (scatters; gathers by torch)"

    def _pieces(self, planes: PlaneSet, pieces: PieceTable, stage: Staging, gather: bool) -> None:
        if planes.device.type != "cpu":
            raise ValueError(f"the host backend copies CPU tensors only, not {planes.device}")
        table, flat = check_pieces(planes, pieces, stage, "out" if gather else "src")
        m = table.shape[1]
        if m == 0:
            return
        if m == 1 or (gather and self.moves == CompiledMoves.SCATTERS):
            # a lone piece (the embedded pool's one-block call): the torch path's move prepared once per piece and
            # direction costs less Python per call (about 3.5 µs against 8.5 through ctypes' argument conversion)
            self.ops_issued += move_pieces(planes, table, flat, gather)
            return
        if table.strides[1] != 8:
            table = np.ascontiguousarray(table)
        # the bytes moved decide the GIL; a sum over a long table would itself give the GIL away (numpy releases
        # it from 500 elements on), and a table that long moves far more than the threshold anyway
        nbytes = GIL_HELD_BELOW if m >= 500 else sum(table[1].tolist()) * planes.token_bytes
        self.library.move_pieces(table, _plane_addresses(planes), _staging_address(flat), gather, nbytes)
        self.ops_issued += 1

    _host_pieces = _pieces  # numpy staging as it is: the C loop takes an address

    verifies_while_scattering = True

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
        if planes.device.type != "cpu":
            raise ValueError(f"the host backend copies CPU tensors only, not {planes.device}")
        table, flat = check_pieces(planes, pieces, src, "src")
        if table.strides[1] != 8:
            table = np.ascontiguousarray(table)
        m = table.shape[1]
        payloads = np.ascontiguousarray(payloads, dtype=np.int64)
        expected = np.ascontiguousarray(expected, dtype=np.uint64)
        piece_end = np.ascontiguousarray(piece_end, dtype=np.int64)
        n = expected.size
        if payloads.shape != (2, n) or piece_end.shape != (n,):
            raise ValueError(f"payloads must be int64 [2, {n}] and piece_end [{n}], got {payloads.shape} and {piece_end.shape}")
        if n == 0:
            return 0
        # the C loop trusts every range: each payload inside the staging, the piece ranges ordered and complete
        size = flat.nbytes if isinstance(flat, np.ndarray) else flat.numel() * flat.element_size()
        offsets, lengths = payloads[0], payloads[1]
        if int(offsets.min()) < 0 or int(lengths.min()) < 0 or int((offsets + lengths).max()) > size:
            raise ValueError(f"payload ranges outside a staging buffer of {size} bytes")
        if int(piece_end[0]) < 0 or bool((np.diff(piece_end) < 0).any()) or int(piece_end[-1]) != m:
            raise ValueError(f"piece_end must be non-decreasing and end at the {m} pieces")
        base = _staging_address(flat)
        verified = self.library.verify_scatter_pieces(
            hash_function, offsets + base, lengths, expected, piece_end, table, _plane_addresses(planes), base
        )
        self.ops_issued += 1
        return verified

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
        if planes.device.type != "cpu":
            raise ValueError(f"the host backend copies CPU tensors only, not {planes.device}")
        table, flat = check_pieces(planes, pieces, src, "src")
        if table.strides[1] != 8:
            table = np.ascontiguousarray(table)
        m = table.shape[1]
        values = np.ascontiguousarray(values, dtype=np.int64)
        heads = np.ascontiguousarray(heads, dtype=np.uint8)
        piece_end = np.ascontiguousarray(piece_end, dtype=np.int64)
        n = piece_end.size
        if values.shape != (2, n) or heads.shape != (n, 32):
            raise ValueError(f"values must be int64 [2, {n}] and heads uint8 [{n}, 32], got {values.shape} and {heads.shape}")
        if n == 0:
            return 0, PlacedStop.ALL
        # the C loop trusts every range: each whole value (header and payload) inside the staging, the piece
        # ranges ordered and complete
        size = flat.nbytes if isinstance(flat, np.ndarray) else flat.numel() * flat.element_size()
        offsets, lengths = values[0], values[1]
        if int(offsets.min()) < 0 or int(lengths.min()) < 0 or int((offsets + lengths).max()) + VALUE_HEADER > size:
            raise ValueError(f"value ranges outside a staging buffer of {size} bytes")
        if int(piece_end[0]) < 0 or bool((np.diff(piece_end) < 0).any()) or int(piece_end[-1]) != m:
            raise ValueError(f"piece_end must be non-decreasing and end at the {m} pieces")
        base = _staging_address(flat)
        done, why = self.library.verify_scatter_as_placed(
            hash_function,
            placement.progress,
            placement.fd,
            placement.deadline_ns,
            heads,
            offsets + base,
            lengths,
            piece_end,
            table,
            _plane_addresses(planes),
            base,
        )
        self.ops_issued += 1
        return done, PlacedStop(why)

    def _segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, flat: torch.Tensor, gather: bool) -> None:
        if flat.device.type != "cpu":
            raise ValueError(f"the host backend copies CPU tensors only, not {flat.device}")
        ptrs, lengths = ptrs.to("cpu", torch.int64).contiguous(), lengths.to("cpu", torch.int64).contiguous()
        p, n = host_array(ptrs), host_array(lengths)  # views: the tensors above stay alive through the call
        if p.shape != n.shape or p.ndim != 1:
            raise ValueError(f"ptrs and lengths must be int64 [S] alike, got {tuple(p.shape)} and {tuple(n.shape)}")
        total = int(n.sum())
        if int(n.min(initial=0)) < 0 or total > flat.numel():
            raise ValueError(f"segments of {total} bytes do not fit a staging buffer of {flat.numel()} bytes")
        self.library.move_segments(p, n, int(flat.data_ptr()), gather, total)
        self.ops_issued += 1

    def gather_segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> None:
        self._segments(ptrs, lengths, out, gather=True)

    def scatter_segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor) -> None:
        self._segments(ptrs, lengths, src, gather=False)

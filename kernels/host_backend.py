"""The compiled host path: every piece of a CPU request in one C call (`host_copy.c`), the CPU default where it builds.

Contract: `HostBackend` implements `CopyBackend` (base.py) for CPU planes and staging. A gather or scatter of pieces
is ONE call whatever the number of pieces, planes and piece lengths (`ops_issued` counts calls), except a lone
piece, which takes the torch path's prepared one-piece move (one op, less Python per call); raw V0 segments are
one call too. Planes may differ in row size and dtype (MLA with split K/V), and rows may be strided inside a
block: bytes move as they are, by address, so every dtype (fp8 included) is copied bit for bit. A call keeps the
GIL when it moves less than `host_copy.GIL_HELD_BELOW` bytes and releases it otherwise (see `host_copy`).
The C calls between planes and staging are made here, through the loaded library's `HostCopy.for_bytes`, once the
arguments are checked (the C loops trust every range); per-plane addresses and strides are computed once per
`PlaneSet` and kept on it. A load verifies while it scatters (`scatter_pieces_verified`, `scatter_pieces_as_placed`)
and a save encodes while it gathers (`gather_pieces_encoded`): one pass over each value's bytes, hashed while they
are in cache.

Why: the torch path issues an op per (piece length, plane) or per few hundred rows, each holding the GIL and
giving it away between ops, and runs at 5-8 GB/s on this path's many 64 KiB spans; one memcpy loop runs at the
host's copy speed (perf/RESULTS.md, "The compiled host copy").

Gathers were left to torch for a while: in a vLLM engine, compiled gathers made a pooled request arriving right
after a cold one wait 0.3-0.5 s for its first token instead of about 0.1 s. The cause was not the gather: its
faster saves moved the pool node's background populate of its arena into the engine's next prefill step, which a
core taken by that populate slowed four- to fivefold; the populate now runs on spare CPU only
(`ems.buffers.SpareCpuPacer`; perf/RESULTS.md, "A node's background populate and an engine's step").
"""

from __future__ import annotations

import numpy as np
import torch

from ems.kernels.base import CopyBackend, Fusion, PieceTable, PlacedStop, Placement, Staging, check_pieces
from ems.kernels.host_copy import GIL_HELD_BELOW, HostCopy, address_of, batch_bytes, host_array
from ems.kernels.planes import PlaneSet
from ems.kernels.torch_backend import move_pieces

VALUE_HEADER = 40  # bytes before a value's payload (`ems.store.value_format.HEADER_SIZE`; kernels import nothing of ems)


class _PlaneAddresses:
    """A PlaneSet's per-plane numbers as int64 arrays (kept alive here) and `arguments`: what every piece move of
    `host_copy.c` takes after its table (the addresses of plane_addr, block_stride, slot_stride, plane_offset and
    row_bytes, then the number of planes and block_size)."""

    def __init__(self, planes: PlaneSet) -> None:
        numbers = (
            [int(p.data_ptr()) for p in planes.planes],
            planes.block_stride_bytes,
            planes.slot_stride_bytes,
            planes.plane_offsets,
            planes.plane_row_bytes,
        )
        self.arrays = [np.array(v, dtype=np.int64) for v in numbers]
        self.arguments = (*(address_of(a) for a in self.arrays), planes.num_planes, planes.block_size)


def _plane_arguments(planes: PlaneSet) -> tuple[int, ...]:
    cached: _PlaneAddresses | None = planes.__dict__.get("_host_plane_addresses")
    if cached is None:
        cached = planes.__dict__["_host_plane_addresses"] = _PlaneAddresses(planes)  # lives and dies with the PlaneSet
    return cached.arguments


def _staging_address(flat: Staging) -> int:
    return address_of(flat) if isinstance(flat, np.ndarray) else int(flat.data_ptr())


class HostBackend(CopyBackend):
    name = "host"

    def __init__(self, library: HostCopy) -> None:
        self.library = library
        self.ops_issued = 0

    def _pieces(self, planes: PlaneSet, pieces: PieceTable, stage: Staging, gather: bool) -> None:
        if planes.device.type != "cpu":
            raise ValueError(f"the host backend copies CPU tensors only, not {planes.device}")
        table, flat = check_pieces(planes, pieces, stage, "out" if gather else "src")
        m = table.shape[1]
        if m == 0:
            return
        if m == 1:
            # a lone piece (the embedded pool's one-block call): the torch path's move prepared once per piece and
            # direction costs less Python per call (about 3.5 µs against 8.5 through ctypes' argument conversion)
            self.ops_issued += move_pieces(planes, table, flat, gather)
            return
        if table.strides[1] != 8:
            table = np.ascontiguousarray(table)
        # the bytes moved decide the GIL; a sum over a long table would itself give the GIL away (numpy releases
        # it from 500 elements on), and a table that long moves far more than the threshold anyway
        nbytes = GIL_HELD_BELOW if m >= 500 else sum(table[1].tolist()) * planes.token_bytes
        layout = _plane_arguments(planes)
        self.library.for_bytes(nbytes).ems_move_pieces(
            address_of(table), m, table.strides[0] // 8, *layout, _staging_address(flat), int(gather)
        )
        self.ops_issued += 1

    _host_pieces = _pieces  # numpy staging as it is: the C loop takes an address

    fusion = Fusion.FUSED

    def _value_ranges(
        self,
        planes: PlaneSet,
        pieces: PieceTable,
        stage: Staging,
        values: np.ndarray,
        heads: np.ndarray,
        piece_end: np.ndarray,
        what: str,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """The checks a one-pass call over whole values needs before its C loop, which trusts every range: each
        value (header and payload) inside the staging, a header's 32 leading bytes per value, the piece ranges
        ordered and complete. (Its contiguous table, values, heads and piece_end, and the staging's address.)"""
        if planes.device.type != "cpu":
            raise ValueError(f"the host backend copies CPU tensors only, not {planes.device}")
        table, flat = check_pieces(planes, pieces, stage, what)
        if table.strides[1] != 8:
            table = np.ascontiguousarray(table)
        m = table.shape[1]
        values = np.ascontiguousarray(values, dtype=np.int64)
        heads = np.ascontiguousarray(heads, dtype=np.uint8)
        piece_end = np.ascontiguousarray(piece_end, dtype=np.int64)
        n = piece_end.size
        if values.shape != (2, n) or heads.shape != (n, 32):
            raise ValueError(f"values must be int64 [2, {n}] and heads uint8 [{n}, 32], got {values.shape} and {heads.shape}")
        if n:
            size = flat.nbytes if isinstance(flat, np.ndarray) else flat.numel() * flat.element_size()
            offsets, lengths = values[0], values[1]
            if int(offsets.min()) < 0 or int(lengths.min()) < 0 or int((offsets + lengths).max()) + VALUE_HEADER > size:
                raise ValueError(f"value ranges outside a staging buffer of {size} bytes")
            if int(piece_end[0]) < 0 or bool((np.diff(piece_end) < 0).any()) or int(piece_end[-1]) != m:
                raise ValueError(f"piece_end must be non-decreasing and end at the {m} pieces")
        return table, values, heads, piece_end, _staging_address(flat)

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
        table, values, heads, piece_end, base = self._value_ranges(planes, pieces, out, values, heads, piece_end, "out")
        if piece_end.size == 0:
            return
        # value v's pieces gathered, then its header written at its address with its payload's digest
        value_addrs, payload_lens = values[0] + base, values[1]  # (kept alive through the C call)
        layout = _plane_arguments(planes)
        self.library.for_bytes(batch_bytes(payload_lens)).ems_gather_encode_pieces(
            hash_function,
            address_of(heads),
            address_of(value_addrs),
            address_of(payload_lens),
            address_of(piece_end),
            piece_end.size,
            address_of(table),
            table.strides[0] // 8,
            *layout,
            base,
        )
        self.ops_issued += 1

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
        payload_addrs = offsets + base  # (kept alive through the C call)
        layout = _plane_arguments(planes)
        verified: int = self.library.for_bytes(batch_bytes(lengths)).ems_verify_scatter_pieces(
            hash_function,
            address_of(payload_addrs),
            address_of(lengths),
            address_of(expected),
            address_of(piece_end),
            n,
            address_of(table),
            table.strides[0] // 8,
            *layout,
            base,
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
        table, values, heads, piece_end, base = self._value_ranges(planes, pieces, src, values, heads, piece_end, "src")
        if piece_end.size == 0:
            return 0, PlacedStop.ALL
        if placement.progress % 4:
            raise ValueError("progress must be a 4-byte aligned address")
        # each value waited for on the progress word, its header checked against heads[v] and its payload against
        # the checksum the header states; `why` gets the reason it stopped. Releases the GIL (it may wait).
        why = np.zeros(1, dtype=np.int64)
        value_addrs, payload_lens = values[0] + base, values[1]  # (kept alive through the C call)
        layout = _plane_arguments(planes)
        done: int = self.library.releasing_gil.ems_verify_scatter_as_placed(
            hash_function,
            placement.progress,
            placement.fd,
            placement.deadline_ns,
            address_of(heads),
            address_of(value_addrs),
            address_of(payload_lens),
            address_of(piece_end),
            piece_end.size,
            address_of(why),
            address_of(table),
            table.strides[0] // 8,
            *layout,
            base,
        )
        self.ops_issued += 1
        return done, PlacedStop(int(why[0]))

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

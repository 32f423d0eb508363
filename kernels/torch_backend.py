"""Vectorised torch gather/scatter: the CPU production path, and the fallback on any device.

Contract: `TorchBackend` implements `CopyBackend` (base.py) with one indexing op per save on CPU when every
plane has one row size, else one per plane, whatever the number of blocks or tokens (plus one host→device copy of
the row indices off CPU); `ops_issued` counts them. Planes may differ in row size and dtype (MLA with split K/V).

How (CPU, planes of one row size: the common case): all planes are rows of ONE table: a view of the address span
from the lowest to the highest plane byte, with the widest int element (8/4/2/1 bytes) and a row stride that
divides every plane's address offset and strides. Row index `[t, p]` is computed for all tokens and planes at once
(broadcast), and since staging holds each token's plane rows back to back, a gather is ONE
`index_select(span, 0, idx, out=staging.view(T * P, row))` into the contiguous staging buffer (torch's per-row fast
path), a scatter one `index_copy_`. The span view only ever touches the indexed rows; it is used within the call
and never outlives the planes. Measured on this 2-core host (1 thread, 1 KiB rows, 16 planes): gather 6.9 vs
5.3 GB/s per-plane, scatter 4.3 vs 2.3 GB/s. Planes of different row sizes (MLA split K/V) take the per-plane path
below: one span table of gcd-sized sub-rows would also be one op, but measured slower (DeepSeek rows 1024 + 128
bytes, 8 layers, 4096 tokens, 1 thread: gather 0.73 GB/s as 128-byte sub-rows vs 2.62 GB/s per plane).

Value-major pieces (`gather_pieces`, what V1 plans use): the same span table, with rows as long as a whole run of
a (block, plane) (`count * row` bytes, the rows of a plane being contiguous in a block), so a one-block value is ONE
`index_select` of P runs into the value's contiguous plane-major part (`_move_one_piece`, the embedded pool's
per-block call: a few µs of Python around the copy); several values' runs go in one op when the staging runs sit
at a constant step, else through a temporary (two passes). Per-layout numbers (addresses, strides, the span tables)
are computed once and kept on the `PlaneSet`. Planes whose rows are strided inside a block move token by token.

Otherwise (other devices, a span too odd to view, or planes of different row sizes): plane p is viewed as a 2-D row
table `[N, row_units_p]` over its own storage with row stride `g = gcd(block_stride, slot_stride)`, so slot s is row
`(s // block_size) * block_stride / g + (s % block_size) * slot_stride / g` of it — one row index per token, shared
by every plane with the same strides. A gather is then `index_select(table, 0, rows, out=<plane p's column range of
staging>)`, which writes straight into the strided staging slice in one pass (no temporary); a scatter is
`index_copy_`. Elements move as the widest signed int dividing the plane's row, strides and addresses, so every
dtype (fp8 included) is copied bit for bit. Raw V0 segments are the exception: torch has no batched copy between
arbitrary addresses, so they cost one copy each (the Triton backend does them in one launch).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from ems.kernels.base import CopyBackend, PlaneSet, check_pieces
from ems.kernels.plan import runs_to_slots
from ems.kernels.raw_memory import raw_tensor

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_SPAN = 1 << 44  # never view an address span larger than this (planes from unrelated mappings)


SpanLayout = tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray]
# Least-recently-used span layouts. An engine uses one registered cache (a few entries: staging alignments); every
# re-registration adds entries for new addresses, each costing ~0.06 MiB of RSS (its address-view objects), so the
# cache keeps only the most recent few.
SPAN_CACHE_ENTRIES = 16
_span_cache: "OrderedDict[tuple[object, ...], Optional[SpanLayout]]" = OrderedDict()
_span_lock = threading.Lock()


def _widest(quantities: list[int], widths: tuple[int, ...] = (8, 4, 2, 1)) -> int:
    return next(w for w in widths if all(q % w == 0 for q in quantities))


def _span_layout(planes: PlaneSet, stage_addr: int) -> Optional[SpanLayout]:
    """(table, plane row offsets [P], block steps [P], slot steps [P]) for planes of ONE row size, cached per
    addresses and strides: the table is an address view that owns no memory, so the cache never keeps a freed cache
    alive. None when no span view fits."""
    addrs = [int(p.data_ptr()) for p in planes.planes]
    bstr, sstr = list(planes.block_stride_bytes), list(planes.slot_stride_bytes)
    row_bytes = planes.plane_row_bytes[0]
    key = (tuple(addrs), tuple(bstr), tuple(sstr), row_bytes, planes.num_blocks, planes.block_size, stage_addr % 8)
    with _span_lock:
        if key in _span_cache:
            _span_cache.move_to_end(key)
            return _span_cache[key]
    lo = min(addrs)
    hi = max(a + (planes.num_blocks - 1) * b + (planes.block_size - 1) * s + row_bytes
             for a, b, s in zip(addrs, bstr, sstr))
    result = None
    if hi - lo <= _MAX_SPAN:
        offs = [a - lo for a in addrs]
        width = _widest(offs + bstr + sstr + [row_bytes, lo, stage_addr])
        g = 0
        for q in offs + bstr + sstr:
            g = math.gcd(g, q)
        g = g or width
        units = row_bytes // width
        n_rows = ((hi - lo) // width - units) // (g // width) + 1
        table = raw_tensor(lo, hi - lo, planes.device).view(_INT_OF_WIDTH[width]).as_strided((n_rows, units), (g // width, 1))
        result = (table, np.array(offs, np.int64) // g, np.array(bstr, np.int64) // g, np.array(sstr, np.int64) // g)
    with _span_lock:
        _span_cache[key] = result
        while len(_span_cache) > SPAN_CACHE_ENTRIES:
            _span_cache.popitem(last=False)
    return result


def _span_table(planes: PlaneSet, slots: torch.Tensor, stage: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """CPU only: (table `[N, row_units]`, row index `[T * P]` int64) viewing every plane in one span, or None when
    the layout does not allow it (planes of different row sizes included: see the module docstring)."""
    if planes.device.type != "cpu" or len(set(planes.plane_row_bytes)) != 1:
        return None
    layout = _span_layout(planes, int(stage.data_ptr()))
    if layout is None:
        return None
    table, offs, bstep, sstep = layout
    s = slots.numpy() if slots.device.type == "cpu" else slots.cpu().numpy()
    blocks = s // planes.block_size
    within = s - blocks * planes.block_size
    idx = offs[None, :] + blocks[:, None] * bstep[None, :] + within[:, None] * sstep[None, :]
    return table, torch.from_numpy(idx.reshape(-1))


def plane_rows(planes: PlaneSet, p: int) -> torch.Tensor:
    """Plane p as `[num_blocks, block_size, row_elems_p]`, aliasing the registered memory."""
    plane = planes.planes[p]
    return plane.as_strided(
        (planes.num_blocks, planes.block_size, planes.plane_row_elems[p]),
        (plane.stride(0), plane.stride(1), 1),
    )


def _plane_width(planes: PlaneSet, p: int, stage_addr: int) -> int:
    """The widest int moving plane p between the cache and its column range of staging."""
    return _widest([planes.plane_row_bytes[p], planes.block_stride_bytes[p], planes.slot_stride_bytes[p],
                    int(planes.planes[p].data_ptr()), stage_addr + planes.plane_offsets[p], planes.token_bytes])


def _row_table(planes: PlaneSet, p: int, width: int) -> tuple[torch.Tensor, int, int]:
    """Plane p as an int `[N, row_units]` row table (ints of `width` bytes) with row stride g; returns
    (table, block_step, slot_step) where slot s is row `(s // block_size) * block_step + (s % block_size) * slot_step`."""
    bstride, sstride = planes.block_stride_bytes[p] // width, planes.slot_stride_bytes[p] // width
    g = math.gcd(bstride, sstride) or 1
    rows = (planes.num_blocks - 1) * (bstride // g) + (planes.block_size - 1) * (sstride // g) + 1
    units = planes.plane_row_bytes[p] // width
    flat = plane_rows(planes, p).view(torch.uint8).view(_INT_OF_WIDTH[width])
    table = flat.as_strided((rows, units), (g, 1))
    return table, bstride // g, sstride // g


def _stage_columns(planes: PlaneSet, stage_bytes: torch.Tensor, p: int, width: int) -> torch.Tensor:
    """Plane p's rows in staging: `[T, row_units_p]` ints of `width` bytes, a strided view of `stage_bytes`."""
    off = planes.plane_offsets[p]
    return stage_bytes[:, off : off + planes.plane_row_bytes[p]].view(_INT_OF_WIDTH[width])


def single_row_pieces(table: np.ndarray) -> np.ndarray:
    """Pieces cut into one-token pieces (for planes whose rows are strided inside a block): vectorised."""
    start, count, base, tokens, index = table
    piece = np.repeat(np.arange(count.size), count)
    step = np.arange(piece.size, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    return np.stack([start[piece] + step, np.ones(piece.size, np.int64), base[piece], tokens[piece], index[piece] + step])


def _gcd(values: np.ndarray, also: int = 0) -> int:
    return int(np.gcd.reduce(np.append(values, also).astype(np.int64)))


def _spans_view(flat: torch.Tensor, first: int, rows: int, row_units: int, step_units: int, dtype: torch.dtype
                ) -> torch.Tensor:
    """`rows` rows of `row_units` ints at `first` bytes + k * step_units of the flat uint8 buffer (a strided view)."""
    width = torch.empty(0, dtype=dtype).element_size()
    end = first + ((rows - 1) * step_units + row_units) * width
    return flat[first:end].view(dtype).as_strided((rows, row_units), (step_units, 1))


@dataclass
class _PieceLayout:
    """What `move_pieces` needs about one PlaneSet, computed once and kept on it (per-layout tables: the per-call
    work is then a few vectorised numpy expressions and one op)."""

    contiguous: bool  # every plane's rows are contiguous inside a block
    one_span: bool  # planes of one row size, CPU, one address span: one table for all planes
    lo: int  # lowest plane address (one_span) ...
    span: int  # ... and the bytes from it to the end of the highest plane
    off: np.ndarray  # int64 [P]: plane address - lo
    bstr: np.ndarray
    sstr: np.ndarray
    poffs: np.ndarray
    rbytes: np.ndarray
    g: int  # gcd of every plane offset and stride (one_span): the table's row stride
    unit: int  # gcd of g, the lowest address and every plane's row bytes and token offset: divides every span
    tables: Dict[Tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (length, width) → table


def _piece_layout(planes: PlaneSet) -> _PieceLayout:
    layout = planes.__dict__.get("_torch_piece_layout")
    if layout is not None:
        return layout
    addrs = np.array([int(p.data_ptr()) for p in planes.planes], dtype=np.int64)
    bstr, sstr = np.array(planes.block_stride_bytes, np.int64), np.array(planes.slot_stride_bytes, np.int64)
    rbytes = np.array(planes.plane_row_bytes, np.int64)
    lo = int(addrs.min())
    hi = int((addrs + (planes.num_blocks - 1) * bstr + (planes.block_size - 1) * sstr + rbytes).max())
    one_span = planes.device.type == "cpu" and len(set(planes.plane_row_bytes)) == 1 and hi - lo <= _MAX_SPAN
    off = addrs - lo
    layout = _PieceLayout(
        contiguous=bool(np.all(sstr == rbytes)), one_span=one_span, lo=lo, span=hi - lo, off=off, bstr=bstr,
        sstr=sstr, poffs=np.array(planes.plane_offsets, np.int64), rbytes=rbytes,
        g=_gcd(np.concatenate([off, bstr, sstr])) or int(rbytes[0]),
        unit=_gcd(np.concatenate([off, bstr, sstr, rbytes, np.array(planes.plane_offsets, np.int64)]), lo),
    )
    planes.__dict__["_torch_piece_layout"] = layout  # lives and dies with the PlaneSet (never keeps a cache alive)
    return layout


def _move_spans(table: torch.Tensor, src_idx: np.ndarray, flat: torch.Tensor, dst_off: np.ndarray, length: int,
                width: int, gather: bool) -> int:
    """Move M spans of `length` bytes between rows `src_idx` of `table` and staging offsets `dst_off` (bytes): ONE
    op when the staging spans sit at a constant step (a strided view), else two (through a temporary)."""
    dtype = table.dtype
    idx = torch.from_numpy(src_idx)
    if flat.device.type != "cpu":
        idx = idx.to(flat.device, non_blocking=True)
    units = length // width
    m = dst_off.size
    step = int(dst_off[1] - dst_off[0]) if m > 1 else length
    if step >= length and (m <= 2 or bool(np.all(np.diff(dst_off) == step))):
        staged = _spans_view(flat, int(dst_off[0]), m, units, step // width, dtype)
        if gather:
            torch.index_select(table, 0, idx, out=staged)
        else:
            table.index_copy_(0, idx, staged)
        return 1
    gd = _gcd(dst_off) or length
    dst_table = _spans_view(flat, 0, int(dst_off.max()) // gd + 1, units, gd // width, dtype)
    dst_idx = torch.from_numpy(dst_off // gd).to(flat.device, non_blocking=True)
    if gather:
        dst_table.index_copy_(0, dst_idx, table.index_select(0, idx))
    else:
        table.index_copy_(0, idx, dst_table.index_select(0, dst_idx))
    return 2


def _one_span_rows(planes: PlaneSet, lay: _PieceLayout, length: int, width: int) -> torch.Tensor:
    """The cached table viewing every plane as rows of `length` bytes at a stride of `lay.g` (ints of `width`)."""
    key = (length, width)
    rows = lay.tables.get(key)
    if rows is None:
        n = (lay.span - length) // lay.g + 1
        rows = raw_tensor(lay.lo, lay.span, planes.device).view(_INT_OF_WIDTH[width]).as_strided(
            (n, length // width), (lay.g // width, 1))
        lay.tables[key] = rows
    return rows


def _move_one_piece(planes: PlaneSet, lay: _PieceLayout, piece: list, flat: torch.Tensor, gather: bool) -> int:
    """One piece (a one-block value) of every plane: P spans, the staging ones back to back at a constant step
    (plane-major value): one op, a handful of numpy and torch calls (the per-call cost of a small save)."""
    start, count, base, tokens, index = piece
    blk, within = divmod(start, planes.block_size)
    row = int(lay.rbytes[0])
    length = count * row
    first = base + index * row
    width = _widest([math.gcd(lay.unit, base), length, int(flat.data_ptr())])
    rows = _one_span_rows(planes, lay, length, width)
    idx = torch.from_numpy((lay.off + (blk * lay.bstr + within * lay.sstr)) // lay.g)
    staged = _spans_view(flat, first, planes.num_planes, length // width, tokens * row // width, rows.dtype)
    if gather:
        torch.index_select(rows, 0, idx, out=staged)
    else:
        rows.index_copy_(0, idx, staged)
    return 1


def move_pieces(planes: PlaneSet, table: np.ndarray, flat: torch.Tensor, gather: bool) -> int:
    """The torch path of `CopyBackend.gather_pieces` / `scatter_pieces` (table and flat already checked): each
    (piece, plane) is one span where the plane's rows are contiguous in a block; every piece of one length of every
    plane moves in one op when the planes share one row size and one address span (CPU), else one op per plane.
    Returns the number of ops issued."""
    lay = _piece_layout(planes)
    if table.shape[1] == 1 and lay.one_span and lay.contiguous:
        return _move_one_piece(planes, lay, table[:, 0].tolist(), flat, gather)
    if not lay.contiguous:
        table = single_row_pieces(table)
    start, count, base, tokens, index = table
    bs = planes.block_size
    blocks, within = np.divmod(start, bs)
    lengths = [int(count[0])] if int(count.min()) == int(count.max()) else np.unique(count).tolist()
    flat_addr = int(flat.data_ptr())
    ops = 0
    for c in lengths:
        sel = slice(None) if len(lengths) == 1 else (count == c)
        b, w, bb, tt, ii = blocks[sel], within[sel], base[sel], tokens[sel], index[sel]
        if lay.one_span:
            length = c * int(lay.rbytes[0])
            dst = (bb[:, None] + tt[:, None] * lay.poffs[None, :] + ii[:, None] * lay.rbytes[None, :]).reshape(-1)
            # every staging offset is a part base plus multiples of `unit`: their gcd divides unit and the bases
            width = _widest([math.gcd(lay.unit, int(bb[0]) if bb.size == 1 else _gcd(bb)), length, flat_addr])
            rows = _one_span_rows(planes, lay, length, width)
            src = (lay.off[None, :] + b[:, None] * lay.bstr[None, :] + w[:, None] * lay.sstr[None, :]).reshape(-1)
            ops += _move_spans(rows, src // lay.g, flat, dst, length, width, gather)
            continue
        for p in range(planes.num_planes):
            length = c * int(lay.rbytes[p])
            g = math.gcd(int(lay.bstr[p]), int(lay.sstr[p])) or length
            dst = bb + tt * lay.poffs[p] + ii * lay.rbytes[p]
            width = _widest([g, length, int(planes.planes[p].data_ptr()), flat_addr, _gcd(dst)])
            plane = plane_rows(planes, p).view(torch.uint8).view(_INT_OF_WIDTH[width])
            span = (planes.num_blocks - 1) * int(lay.bstr[p]) + (bs - 1) * int(lay.sstr[p]) + int(lay.rbytes[p])
            rows = plane.as_strided(((span - length) // g + 1, length // width), (g // width, 1))
            ops += _move_spans(rows, (b * lay.bstr[p] + w * lay.sstr[p]) // g, flat, dst, length, width, gather)
    return ops


class TorchBackend(CopyBackend):
    name = "torch"

    def __init__(self) -> None:
        self.ops_issued = 0

    def _plan(self, planes: PlaneSet, slots: torch.Tensor, stage_addr: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Per plane: (move width, row table, row indices on the device); planes with equal steps share indices."""
        slots = slots.to("cpu", torch.int64)
        blocks = torch.div(slots, planes.block_size, rounding_mode="floor")
        offsets = slots - blocks * planes.block_size
        index_of: dict[tuple[int, int], torch.Tensor] = {}
        plan = []
        for p in range(planes.num_planes):
            width = _plane_width(planes, p, stage_addr)
            table, bstep, sstep = _row_table(planes, p, width)
            rows = index_of.get((bstep, sstep))
            if rows is None:
                rows = (blocks * bstep + offsets * sstep).to(planes.device, non_blocking=True)
                if planes.device.type != "cpu":
                    self.ops_issued += 1
                index_of[(bstep, sstep)] = rows
            plan.append((width, table, rows))
        return plan

    def _rows(self, planes: PlaneSet, slots: torch.Tensor, stage: torch.Tensor, gather: bool) -> None:
        stage_bytes = planes.staging_bytes(stage, int(slots.numel()), "out" if gather else "src")
        if slots.numel() == 0:
            return
        span = _span_table(planes, slots, stage)
        if span is not None:
            table, idx = span
            flat = stage_bytes.view(-1).view(table.dtype).view(idx.numel(), -1)
            if gather:
                torch.index_select(table, 0, idx, out=flat)
            else:
                table.index_copy_(0, idx, flat)
            self.ops_issued += 1
            return
        for p, (width, table, rows) in enumerate(self._plan(planes, slots, int(stage.data_ptr()))):
            columns = _stage_columns(planes, stage_bytes, p, width)
            if gather:
                torch.index_select(table, 0, rows, out=columns)
            else:
                table.index_copy_(0, rows, columns)
            self.ops_issued += 1

    def gather_slots(self, planes: PlaneSet, slots: torch.Tensor, out: torch.Tensor) -> None:
        self._rows(planes, slots, out, gather=True)

    def scatter_slots(self, planes: PlaneSet, slots: torch.Tensor, src: torch.Tensor) -> None:
        self._rows(planes, slots, src, gather=False)

    def gather_runs(
        self, planes: PlaneSet, starts: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor
    ) -> None:
        self.gather_slots(planes, runs_to_slots(starts, lengths), out)

    def scatter_runs(
        self, planes: PlaneSet, starts: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor
    ) -> None:
        self.scatter_slots(planes, runs_to_slots(starts, lengths), src)

    def _pieces(self, planes: PlaneSet, pieces: torch.Tensor, stage: torch.Tensor, gather: bool) -> None:
        table, flat = check_pieces(planes, pieces, stage, "out" if gather else "src")
        if table.shape[1]:
            self.ops_issued += move_pieces(planes, table, flat, gather)

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

"""Vectorised torch gather/scatter: the CPU production path, and the fallback on any device.

Contract: `TorchBackend` implements `CopyBackend` (base.py); `ops_issued` counts its indexing ops (and host→device
index copies off CPU). Planes may differ in row size and dtype (MLA with split K/V). Every dtype (fp8 included) is
copied bit for bit: elements move as the widest signed int dividing the rows, strides, offsets and addresses.

Value-major pieces (`gather_pieces`, what V1 plans use; `move_pieces`): on CPU, when every plane has one row size,
all planes are rows of ONE table, a view of the address span from the lowest to the highest plane byte whose rows
are as long as a whole run of a (block, plane) (`count * row` bytes, the rows of a plane being contiguous in a
block), at a row stride dividing every plane's address offset and strides. A one-block value is then ONE
`index_select` of P runs into the value's contiguous plane-major part (`_move_one_piece`, the embedded pool's
per-block call: a few µs of Python around the copy); several values' runs go in one op per piece length when the
staging runs sit at a constant step, else in one op per plane (values of one size) or per value (a value's runs
are back to back), whichever is fewer, and only otherwise through a temporary (two passes: measured 7x slower for
32 one-block values, whose 40-byte headers break the constant step). Otherwise (other devices, a span too
far apart to view, planes of different row sizes) each plane is its own run table: one op per (plane, piece
length). Per-layout numbers (addresses, strides, the span tables) are computed once and kept on the `PlaneSet`
(`torch_layout`). Planes whose rows are strided inside a block move token by token (`single_row_pieces`).

Raw V0 segments are the exception: torch has no batched copy between arbitrary addresses, so they cost one copy
each (the Triton backend does them in one launch).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ems.kernels.base import CopyBackend, PieceTable, Staging, check_pieces, tensor_over
from ems.kernels.host_copy import address_of, host_array, raw_tensor
from ems.kernels.planes import PlaneSet
from ems.kernels.torch_layout import (
    INT_OF_WIDTH,
    LAYOUT_KEY,
    PieceLayout,
    one_span_rows,
    one_span_rows_np,
    piece_layout,
    prepare_one_piece,
    void_of,
)

_NP_INT_OF_WIDTH = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_MIN_OP_BYTES = 64 << 10  # below this per op, the two-pass path through a temporary is cheaper
_NUMPY_GATHER_BELOW = 64 << 10  # a CPU gather smaller than this is cheaper by numpy indexing than by a torch op
# numpy keeps the GIL through an indexed copy of fewer than 500 elements (its NPY_BEGIN_THREADS_THRESHOLDED), and a
# copy that gives the GIL away waits up to a switch interval (5 ms) for it beside a busy Python thread (an engine's
# loop): 0.2 -> 5.4 ms per 2 MiB row assignment. So a CPU scatter moves rows as single void elements, in ops of
# fewer than 500 rows and at most _GIL_HELD_OP_BYTES (the GIL is then held for well under a switch interval).
_GIL_KEPT_BELOW_ELEMENTS = 500
_GIL_HELD_OP_BYTES = 1 << 20


def _widest(quantities: list[int], widths: tuple[int, ...] = (8, 4, 2, 1)) -> int:
    return next(w for w in widths if all(q % w == 0 for q in quantities))


def plane_rows(planes: PlaneSet, p: int) -> torch.Tensor:
    """Plane p as `[num_blocks, block_size, row_elems_p]`, aliasing the registered memory."""
    plane = planes.planes[p]
    return plane.as_strided(
        (planes.num_blocks, planes.block_size, planes.plane_row_elems[p]),
        (plane.stride(0), plane.stride(1), 1),
    )


def single_row_pieces(table: np.ndarray) -> np.ndarray:
    """Pieces cut into one-token pieces (for planes whose rows are strided inside a block): vectorised."""
    start, count, base, tokens, index = table
    piece = np.repeat(np.arange(count.size), count)
    step = np.arange(piece.size, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    return np.stack([start[piece] + step, np.ones(piece.size, np.int64), base[piece], tokens[piece], index[piece] + step])


def _gcd(values: np.ndarray) -> int:
    return int(np.gcd.reduce(np.append(values, 0).astype(np.int64)))


def _spans_view(flat: torch.Tensor, first: int, rows: int, row_units: int, step_units: int, dtype: torch.dtype) -> torch.Tensor:
    """`rows` rows of `row_units` ints at `first` bytes + k * step_units of the flat uint8 buffer (a strided view)."""
    width = dtype.itemsize
    end = first + ((rows - 1) * step_units + row_units) * width
    return flat[first:end].view(dtype).as_strided((rows, row_units), (step_units, 1))


def _piece_layout(planes: PlaneSet) -> PieceLayout:
    """The PlaneSet's layout (`torch_layout`), computed on its first move and kept on it."""
    layout: PieceLayout | None = planes.__dict__.get(LAYOUT_KEY)
    return layout if layout is not None else piece_layout(planes)


def _constant_step(offsets: np.ndarray, length: int) -> int | None:
    """The step between consecutive `offsets` (int64 `[M]`) when it is constant and at least `length`, else None."""
    if offsets.size < 2:
        return length
    step = int(offsets[1] - offsets[0])
    return step if step >= length and (offsets.size == 2 or bool(np.all(np.diff(offsets) == step))) else None


def _move_run(
    table: torch.Tensor, src_idx: np.ndarray, flat: torch.Tensor, first: int, step: int, length: int, width: int, gather: bool
) -> None:
    """ONE op: M spans between rows `src_idx` of `table` and the staging spans at `first + k * step` (bytes)."""
    if not gather and table.device.type == "cpu":  # numpy views only: a torch call may give the GIL away
        staged_rows = np.ndarray((src_idx.size,), np.dtype((np.void, length)), host_array(flat), first, (step,))
        _place_rows_keeping_gil(_void_rows(host_array(table)), src_idx, staged_rows)
        return
    staged = _spans_view(flat, first, src_idx.size, length // width, step // width, table.dtype)
    _select_or_place(table, src_idx, staged, gather)


def _select_or_place(table: torch.Tensor, idx: np.ndarray, staged: torch.Tensor, gather: bool) -> None:
    """gather: staged = table[idx]; else table[idx] = staged (rows). On CPU the scatter is numpy's indexed
    assignment of whole rows, kept to ops that hold the GIL (`_place_rows_keeping_gil`; faster than torch's
    `index_copy_` too); torch's `index_select` is the faster large gather (than numpy's), numpy's indexing the
    cheaper small one (per call, below `_NUMPY_GATHER_BELOW`). Figures: perf/RESULTS.md, "Figures behind design
    choices", "The embedded call's fixed cost", "Which ops give the GIL away" and "A load beside a busy Python
    thread, and the first load after start-up"."""
    if gather and table.device.type == "cpu" and staged.numel() * staged.element_size() < _NUMPY_GATHER_BELOW:
        host_array(staged)[...] = host_array(table)[idx]  # a small gather: numpy's indexing costs less per call
    elif gather:
        index = torch.from_numpy(idx)
        torch.index_select(table, 0, index if table.device.type == "cpu" else index.to(table.device), out=staged)
    elif table.device.type == "cpu":
        _place_rows_keeping_gil(_void_rows(host_array(table)), idx, _void_rows(host_array(staged)))
    else:
        table.index_copy_(0, torch.from_numpy(idx).to(table.device, non_blocking=True), staged)


def _void_rows(rows: np.ndarray) -> np.ndarray:
    """`rows` `[N, K]` (last axis contiguous) as `[N]` elements of one K-item void each (same memory)."""
    return rows.view(void_of(rows.shape[1] * rows.itemsize))[:, 0]


def _place_rows_keeping_gil(table_rows: np.ndarray, idx: np.ndarray, staged_rows: np.ndarray) -> None:
    """table_rows[idx] = staged_rows (void rows, `_void_rows`: table `[N]`, idx int64 `[M]`, staged `[M]`) in ops
    that numpy runs without giving the GIL away (see _GIL_KEPT_BELOW_ELEMENTS). numpy gives it away for an indexed
    assignment from a strided source whatever its size, so a strided part is first copied (a plain copy keeps it)
    into a contiguous one of at most _GIL_HELD_OP_BYTES, which stays in cache for the second pass."""
    if idx.size == 0:
        return
    per_op = max(1, min(_GIL_KEPT_BELOW_ELEMENTS - 1, _GIL_HELD_OP_BYTES // staged_rows.itemsize))
    strided = idx.size > 1 and staged_rows.strides[0] != staged_rows.itemsize
    if idx.size <= per_op and not strided:  # one op (a small call's scatter): no slicing
        table_rows[idx] = staged_rows
        return
    for a in range(0, idx.size, per_op):  # one op per up to 499 rows and _GIL_HELD_OP_BYTES: never per row
        part = staged_rows[a : a + per_op]
        table_rows[idx[a : a + per_op]] = part.copy() if strided else part


def _move_spans(
    table: torch.Tensor, src_idx: np.ndarray, flat: torch.Tensor, dst_off: np.ndarray, length: int, width: int, gather: bool
) -> int:
    """Move the spans of a grid `[M, P]` (M pieces × P planes; P may be 1) of `length` bytes between rows `src_idx`
    of `table` and staging offsets `dst_off` (bytes). The staging side of one op must be spans at a constant step
    (a strided view), so: ONE op when every span is; else one op per plane when each plane's spans are (values of
    one size: the pieces of one plane sit a value apart), or one per piece when each piece's are (a piece's planes
    are back to back in a plane-major value), whichever is fewer; else two (through a temporary). Returns ops."""
    m, p = int(dst_off.shape[0]), int(dst_off.shape[1])
    flat_dst, flat_src = dst_off.reshape(-1), src_idx.reshape(-1)
    step = _constant_step(flat_dst, length)
    if step is not None:
        _move_run(table, flat_src, flat, int(flat_dst[0]), step, length, width, gather)
        return 1
    for axis in (1, 0) if p <= m else (0, 1):  # fewer, larger ops first
        ops = p if axis == 1 else m
        if ops > 16 and m * p * length < ops * _MIN_OP_BYTES:
            continue  # many small ops cost more than the temporary's second pass
        lines = [np.ascontiguousarray(dst_off[:, j] if axis == 1 else dst_off[j]) for j in range(ops)]
        steps = [_constant_step(line, length) for line in lines]
        known = [s for s in steps if s is not None]
        if len(known) == len(steps):
            for j, (line, line_step) in enumerate(zip(lines, known)):
                src_line = np.ascontiguousarray(src_idx[:, j] if axis == 1 else src_idx[j])
                _move_run(table, src_line, flat, int(line[0]), line_step, length, width, gather)
            return ops
    gd = _gcd(flat_dst) or length
    dst_table = _spans_view(flat, 0, int(flat_dst.max()) // gd + 1, length // width, gd // width, table.dtype)
    dst_idx = torch.from_numpy(flat_dst // gd).to(flat.device, non_blocking=True)
    if gather:
        rows = torch.empty((flat_src.size, length // width), dtype=table.dtype, device=table.device)
        _select_or_place(table, flat_src, rows, gather=True)
        dst_table.index_copy_(0, dst_idx, rows)
    else:
        _select_or_place(table, flat_src, dst_table.index_select(0, dst_idx), gather=False)
    return 2


def _one_span_rows(planes: PlaneSet, lay: PieceLayout, length: int, width: int) -> torch.Tensor:
    """The table viewing every plane as rows of `length` bytes at a stride of `lay.g` (ints of `width`; kept)."""
    rows = lay.tables.get((length, width))
    return rows if rows is not None else one_span_rows(planes, lay, length, width)


def _one_span_rows_np(planes: PlaneSet, lay: PieceLayout, length: int, width: int) -> np.ndarray:
    """`_one_span_rows` as a numpy array (kept beside it)."""
    rows = lay.np_tables.get((length, width))
    return rows if rows is not None else one_span_rows_np(planes, lay, length, width)


def _move_one_piece(planes: PlaneSet, lay: PieceLayout, piece: list, flat: np.ndarray, gather: bool) -> int:
    """One piece (a one-block value) of every plane: P spans, the staging ones back to back at a constant step
    (plane-major value): one op. This is the per-call cost of a small save or load: a whole value's move is
    prepared once (`torch_layout.prepare_one_piece`: a whole value's planes back to back, unless a gather is large
    enough for torch's faster copy, which needs the buffer's alignment), then each call is a slice, a view and the
    op."""
    move = lay.one_piece.get((*piece, gather))
    # not prepared yet: a whole value (count == value tokens) on a layout of one block and slot stride
    if move is None and piece[1] == piece[3] and lay.first_rows is not None:
        small = planes.num_planes * piece[1] * int(lay.rbytes[0]) < _NUMPY_GATHER_BELOW
        move = prepare_one_piece(planes, lay, piece, gather) if small or not gather else None
    if move is not None:
        spans = flat[move.begin : move.end].view(move.dtype)
        if gather:
            spans[...] = move.rows[move.index_rows]  # P elements: numpy keeps the GIL
        else:
            move.rows[move.index_rows] = spans
        return 1
    start, count, base, tokens, index = piece
    blk, within = divmod(start, planes.block_size)
    row = int(lay.rbytes[0])
    length = count * row
    first = base + index * row
    common = math.gcd(lay.unit, base, length, address_of(flat))
    width = min(common & -common, 8)  # the widest int (up to 8 bytes) dividing every address and length
    # numpy only (the row indices, the staged view, the copy): in a whole save call a torch op's dispatch costs
    # several µs more, and a torch call may give the GIL away
    first_rows = lay.first_rows
    if first_rows is not None:
        index_rows = first_rows + (blk * lay.block_rows + within * lay.slot_rows)
    else:
        index_rows = (lay.off + (blk * lay.bstr + within * lay.sstr)) // lay.g
    step = tokens * row
    planes_bytes = flat[first : first + (planes.num_planes - 1) * step + length]
    if step == length:  # the value's planes back to back (a whole value): a reshape, not a strided view
        staged = planes_bytes.view(_NP_INT_OF_WIDTH[width]).reshape(planes.num_planes, length // width)
    else:
        staged = np.lib.stride_tricks.as_strided(
            planes_bytes.view(_NP_INT_OF_WIDTH[width]), (planes.num_planes, length // width), (step, width)
        )
    rows = _one_span_rows_np(planes, lay, length, width)
    if gather and staged.nbytes < _NUMPY_GATHER_BELOW:
        staged[...] = rows[index_rows]  # a small gather: numpy's indexing, below its GIL threshold
    elif gather:
        _select_or_place(_one_span_rows(planes, lay, length, width), index_rows, torch.from_numpy(staged), gather)
    else:
        void_rows = lay.void_tables.get((length, width))
        if void_rows is None:
            void_rows = lay.void_tables[(length, width)] = _void_rows(rows)
        _place_rows_keeping_gil(void_rows, index_rows, _void_rows(staged))
    return 1


def _move_grid_by_lines(
    rows: torch.Tensor,
    lay: PieceLayout,
    b: np.ndarray,
    w: np.ndarray,
    bb: np.ndarray,
    tt: np.ndarray,
    ii: np.ndarray,
    flat: torch.Tensor,
    length: int,
    width: int,
    gather: bool,
) -> int:
    """The one-span grid `[M, P]` (M pieces of cache block b, slot w, staging base bb, value tokens tt, index ii;
    P planes) moved line by line along its longer side: a line per plane (or per piece), so that every numpy op
    works on at most max(M, P) elements and keeps the GIL (see _GIL_KEPT_BELOW_ELEMENTS: a [M, P] expression of
    500 elements or more gives it away, a switch interval each beside a busy engine thread). Returns ops."""
    ops = 0
    if b.size >= lay.off.size:  # a line per plane: M spans each
        for p in range(lay.off.size):
            dst = bb + tt * int(lay.poffs[p]) + ii * int(lay.rbytes[p])
            src = (b * int(lay.bstr[p]) + w * int(lay.sstr[p]) + int(lay.off[p])) // lay.g
            ops += _move_spans(rows, src[:, None], flat, dst[:, None], length, width, gather)
        return ops
    for m in range(b.size):  # a line per piece: P spans each (fewer pieces than planes)
        dst = int(bb[m]) + int(tt[m]) * lay.poffs + int(ii[m]) * lay.rbytes
        src = (lay.off + int(b[m]) * lay.bstr + int(w[m]) * lay.sstr) // lay.g
        ops += _move_spans(rows, src[:, None], flat, dst[:, None], length, width, gather)
    return ops


def _move_whole_values(planes: PlaneSet, lay: PieceLayout, table: np.ndarray, flat: torch.Tensor, gather: bool) -> int | None:
    """Pieces that are each a whole value of one token count (the embedded pool's save or load of whole blocks: one
    piece per value), at staging bases a constant step apart (its buffers back to back): plane p's spans are then
    `base + p * length + k * step`, one op per plane, from a few vectorised index expressions. None when the table
    has another shape, or fewer values than planes (the general path runs, one op per value)."""
    start, count, base, _tokens, index = table
    m = count.size
    first_rows = lay.first_rows
    # fewer values than planes: one op per value is fewer (the general path)
    if first_rows is None or m < max(2, planes.num_planes):
        return None
    c = int(count[0])
    step = int(base[1] - base[0])
    length = c * int(lay.rbytes[0])
    if step < planes.num_planes * length or index.any() or not (table[[1, 3]] == c).all() or not (np.diff(base) == step).all():
        return None
    first = int(base[0])
    width = _widest([math.gcd(lay.unit, first, step), length, int(flat.data_ptr())])
    rows = _one_span_rows(planes, lay, length, width)
    blocks, within = np.divmod(start, planes.block_size)
    value_rows = blocks * lay.block_rows + within * lay.slot_rows
    for p, plane_row in enumerate(first_rows.tolist()):
        _move_run(rows, value_rows + plane_row, flat, first + p * length, step, length, width, gather)
    return planes.num_planes


def move_pieces(planes: PlaneSet, table: np.ndarray, flat: Staging, gather: bool) -> int:
    """The torch path of `CopyBackend.gather_pieces` / `scatter_pieces` (table and flat already checked; flat is
    uint8, a tensor or a numpy array over CPU memory): each (piece, plane) is one span where the plane's rows are
    contiguous in a block; every piece of one length of every plane moves in one op when the planes share one row
    size and one address span (CPU), else one op per plane. Returns the number of ops issued."""
    lay = _piece_layout(planes)
    if table.shape[1] == 1 and lay.one_span and lay.contiguous:
        host = flat if isinstance(flat, np.ndarray) else host_array(flat)
        return _move_one_piece(planes, lay, table[:, 0].tolist(), host, gather)
    if isinstance(flat, np.ndarray):
        flat = tensor_over(flat)
    if lay.contiguous:
        ops = _move_whole_values(planes, lay, table, flat, gather)
        if ops is not None:
            return ops
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
            # every staging offset is a part base plus multiples of `unit`: their gcd divides unit and the bases
            width = _widest([math.gcd(lay.unit, int(bb[0]) if bb.size == 1 else _gcd(bb)), length, flat_addr])
            rows = _one_span_rows(planes, lay, length, width)
            if b.size * planes.num_planes >= _GIL_KEPT_BELOW_ELEMENTS and flat.device.type == "cpu":
                ops += _move_grid_by_lines(rows, lay, b, w, bb, tt, ii, flat, length, width, gather)
                continue
            dst = bb[:, None] + tt[:, None] * lay.poffs[None, :] + ii[:, None] * lay.rbytes[None, :]  # [M, P]
            src = lay.off[None, :] + b[:, None] * lay.bstr[None, :] + w[:, None] * lay.sstr[None, :]
            ops += _move_spans(rows, src // lay.g, flat, dst, length, width, gather)
            continue
        for p in range(planes.num_planes):
            length = c * int(lay.rbytes[p])
            g = math.gcd(int(lay.bstr[p]), int(lay.sstr[p])) or length
            dst = bb + tt * lay.poffs[p] + ii * lay.rbytes[p]
            width = _widest([g, length, int(planes.planes[p].data_ptr()), flat_addr, _gcd(dst)])
            plane = plane_rows(planes, p).view(torch.uint8).view(INT_OF_WIDTH[width])
            span = (planes.num_blocks - 1) * int(lay.bstr[p]) + (bs - 1) * int(lay.sstr[p]) + int(lay.rbytes[p])
            rows = plane.as_strided(((span - length) // g + 1, length // width), (g // width, 1))
            ops += _move_spans(
                rows, ((b * lay.bstr[p] + w * lay.sstr[p]) // g)[:, None], flat, dst[:, None], length, width, gather
            )
    return ops


class TorchBackend(CopyBackend):
    name = "torch"

    def __init__(self) -> None:
        self.ops_issued = 0

    def _pieces(self, planes: PlaneSet, pieces: PieceTable, stage: Staging, gather: bool) -> None:
        table, flat = check_pieces(planes, pieces, stage, "out" if gather else "src")
        if table.shape[1]:
            self.ops_issued += move_pieces(planes, table, flat, gather)

    _host_pieces = _pieces  # numpy staging as it is: a one-piece move works on numpy views anyway (`_move_one_piece`)

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

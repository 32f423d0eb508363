"""What the torch path (`torch_backend`) knows about one PlaneSet, computed once and kept on it, and the one-piece
moves it prepares once per piece.

Contract: `piece_layout(planes)` computes a `PieceLayout` (the planes' addresses and strides as int64 arrays, whether
every plane's rows are contiguous in a block, whether all planes are rows of ONE table over one address span, that
table's row stride) and keeps it in the PlaneSet's `__dict__` under `LAYOUT_KEY`, so it lives and dies with the
PlaneSet (never keeping a cache alive); `one_span_rows` builds the view of every plane as rows of one length and
keeps it on the layout, and `prepare_one_piece` a whole value's one-piece move. The torch path looks each of them up
per call and comes here only on a miss: a warm call runs no code of this module. The views only touch the rows a
move indexes and never outlive the planes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ems.kernels.host_copy import host_array, raw_tensor
from ems.kernels.planes import PlaneSet

LAYOUT_KEY = "_torch_piece_layout"  # where a PlaneSet keeps its layout (its `__dict__`)
INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_SPAN = 1 << 47  # never view an address span larger than this (the whole user address space of x86-64)
_MAX_ONE_PIECE_MOVES = 8192  # per layout and direction (an engine's blocks); beyond it the cache starts over


@dataclass(frozen=True)
class OnePiece:
    """A one-piece move of a whole value (its P plane spans back to back: bytes `begin`..`end` of the value's
    staging), prepared once: the spans as `[P]` void elements of `dtype` and the table rows they go to or come
    from (`rows[index_rows]`, void elements of the same size). Independent of the staging buffer's address: void
    elements are copied bytewise, aligned or not."""

    begin: int
    end: int
    dtype: np.dtype
    rows: np.ndarray  # [R] void rows of the one-span table
    index_rows: np.ndarray  # int64 [P]


@dataclass
class PieceLayout:
    """What `torch_backend.move_pieces` needs about one PlaneSet (per-layout tables: the per-call work is then a few
    vectorised numpy expressions and one op)."""

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
    tables: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (length, width) → table
    np_tables: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # the same tables as numpy arrays
    void_tables: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # ... and as rows of one void each
    # one_span with one block and slot stride for every plane (what a one-piece move needs, in table rows):
    # plane p's slot s is row first_rows[p] + (s // block_size) * block_rows + (s % block_size) * slot_rows
    first_rows: np.ndarray | None = None  # int64 [P]
    block_rows: int = 0
    slot_rows: int = 0
    # one-piece moves prepared once per (piece, direction): an engine repeats the same few blocks' pieces
    one_piece: dict[tuple[int, ...], OnePiece] = field(default_factory=dict)


def piece_layout(planes: PlaneSet) -> PieceLayout:
    """The PlaneSet's layout, computed now and kept on it (`LAYOUT_KEY`)."""
    addrs = np.array([int(p.data_ptr()) for p in planes.planes], dtype=np.int64)
    bstr, sstr = np.array(planes.block_stride_bytes, np.int64), np.array(planes.slot_stride_bytes, np.int64)
    rbytes = np.array(planes.plane_row_bytes, np.int64)
    lo = int(addrs.min())
    hi = int((addrs + (planes.num_blocks - 1) * bstr + (planes.block_size - 1) * sstr + rbytes).max())
    one_span = planes.device.type == "cpu" and len(set(planes.plane_row_bytes)) == 1 and hi - lo <= _MAX_SPAN
    off = addrs - lo
    layout = PieceLayout(
        contiguous=bool(np.all(sstr == rbytes)),
        one_span=one_span,
        lo=lo,
        span=hi - lo,
        off=off,
        bstr=bstr,
        sstr=sstr,
        poffs=np.array(planes.plane_offsets, np.int64),
        rbytes=rbytes,
        g=math.gcd(*np.concatenate([off, bstr, sstr]).tolist()) or int(rbytes[0]),
        unit=math.gcd(*np.concatenate([off, bstr, sstr, rbytes]).tolist(), *planes.plane_offsets, lo),
    )
    if one_span and len(set(planes.block_stride_bytes)) == 1 and len(set(planes.slot_stride_bytes)) == 1:
        layout.first_rows = off // layout.g
        layout.block_rows, layout.slot_rows = int(bstr[0]) // layout.g, int(sstr[0]) // layout.g
    planes.__dict__[LAYOUT_KEY] = layout  # lives and dies with the PlaneSet (never keeps a cache alive)
    return layout


def one_span_rows(planes: PlaneSet, lay: PieceLayout, length: int, width: int) -> torch.Tensor:
    """The table viewing every plane as rows of `length` bytes at a stride of `lay.g` (ints of `width`), built now
    and kept in `lay.tables`."""
    n = (lay.span - length) // lay.g + 1
    rows = (
        raw_tensor(lay.lo, lay.span, planes.device)
        .view(INT_OF_WIDTH[width])
        .as_strided((n, length // width), (lay.g // width, 1))
    )
    lay.tables[(length, width)] = rows
    return rows


def one_span_rows_np(planes: PlaneSet, lay: PieceLayout, length: int, width: int) -> np.ndarray:
    """`one_span_rows` as a numpy array, built now (and the tensor table where missing) and kept in `lay.np_tables`."""
    rows = lay.tables.get((length, width))
    table = host_array(rows if rows is not None else one_span_rows(planes, lay, length, width))
    lay.np_tables[(length, width)] = table
    return table


@functools.lru_cache(maxsize=64)
def void_of(nbytes: int) -> np.dtype:
    """The void dtype of `nbytes` (a row length: a layout has a few; building one costs about a µs per call)."""
    return np.dtype((np.void, nbytes))


def prepare_one_piece(planes: PlaneSet, lay: PieceLayout, piece: list, gather: bool) -> OnePiece:
    """The move of `piece` (a whole value: count == tokens, on a layout with `first_rows`), built now and kept in
    `lay.one_piece`."""
    start, count, base, _tokens, index = piece
    row = int(lay.rbytes[0])
    length = count * row
    blk, within = divmod(start, planes.block_size)
    first_rows = lay.first_rows
    if first_rows is None:
        raise ValueError("a one-piece move needs a layout with one block and slot stride for every plane")
    index_rows = first_rows + (blk * lay.block_rows + within * lay.slot_rows)
    index_rows.flags.writeable = False
    begin = base + index * row
    rows = lay.void_tables.get((length, 1))
    if rows is None:
        table = lay.np_tables.get((length, 1))
        table = table if table is not None else one_span_rows_np(planes, lay, length, 1)
        rows = lay.void_tables[(length, 1)] = table.view(void_of(length))[:, 0]
    move = OnePiece(begin, begin + planes.num_planes * length, void_of(length), rows, index_rows)
    if len(lay.one_piece) >= 2 * _MAX_ONE_PIECE_MOVES:
        lay.one_piece.clear()
    lay.one_piece[(*piece, gather)] = move
    return move

"""Call planning: a checked call → storage keys, expected values and the copy plan (host, numpy).

A plan is data (keys, expected values, value places, piece tables or device ranges): nothing in it executes; the
job's copier (`ems.datapath.copier`) runs it.

Staging layout (V1, value format 3). The staging buffer holds the stored values themselves, back to back (each
starting 24 bytes past a 64-byte boundary, so that its payload, after the 40-byte header, starts on one): value i
is `header | part of group 0 | part of group 1 | ...`, and block i's part of group g holds its `n` tokens
plane-major, `[planes][n][row]` (planes may differ in row size and dtype: MLA split K/V). Where a plane's rows are
contiguous in the engine's cache, the rows of one (block, plane) are thus ONE span on both sides, and the copy
backends move whole spans (`CopyBackend.gather_pieces`); where the engine's cache keeps each block's planes together
in that same order (cross-layer blocks, `PlaneSet.block_runs`), a call of whole-block values moves one run per
block (`GroupRegion.planes` are then the block runs). The header's 40 bytes are left for the save job to fill,
so a value goes to the pool as one buffer without any repacking. The same per-value piece tables let a job gather
one value straight into the store's buffer, or scatter straight from a stored value (`Copier.gather_value` /
`scatter_value`: the embedded pool's one pass). A V0 plan concatenates every value's device ranges; its header
travels as a separate part.

Pieces (`ems.kernels.base`: what a copy backend moves): `value_pieces` cuts the tokens of a V1 plan into runs of
consecutive slots inside one cache block and one stored value, so that a piece of one plane is one span (rows
contiguous in a block) or one strided tile loop; whole-block values give one piece per (value, block), scattered
slots one piece per token. `block_run_pieces` rewrites a table of whole-block values for a PlaneSet's `block_runs`
(cross-layer blocks: one run per block, one piece per value); `plane_pieces_of_runs` is its inverse.

No per-token Python loops: token positions, slots, pieces and byte offsets are numpy expressions; only per-block
objects (keys, memoryviews) are built per block.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from ems.buffers import Buffer
from ems.datapath.arguments import ChunkCall, RawCall, SlotCall
from ems.datapath.keys import FORM_CHAIN, FORM_V1, chain_keys, v0_keys, v1_keys
from ems.datapath.layout import LayerGroup, RegisteredLayout
from ems.kernels.planes import PlaneSet
from ems.store.value_format import (
    HEADER_SIZE,
    VALUE_LEAD,
    ExpectedValues,
    ValueKind,
    tokens_digest,
)

ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


_VALUE_ZERO = np.zeros(1, dtype=np.int64)  # the one piece of a one-value request belongs to value 0 (read-only)
_VALUE_ZERO.flags.writeable = False


def value_pieces(
    slots: np.ndarray, block_size: int, tok_start: np.ndarray, part_base: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The pieces of value-major staging (`ems.kernels.base`): runs of consecutive slots inside one cache block AND one value.

    slots: int64 `[T]`, the tokens of every value in order; tok_start: int64 `[n + 1]`, value i's tokens are
    `tok_start[i] .. tok_start[i + 1] - 1`; part_base: int64 `[n]`, where value i's part starts in staging (bytes).
    Returns (table int64 `[5, N]`: start slot, count, base, value tokens, index in value; value of each piece `[N]`).
    Whole-block values give one piece per (value, block); vectorised, no per-token Python.
    """
    s = np.asarray(slots, dtype=np.int64).reshape(-1)
    bounds = np.asarray(tok_start, dtype=np.int64)
    if s.size == 0:
        return np.zeros((5, 0), dtype=np.int64), np.zeros(0, dtype=np.int64)
    if bounds.size == 2:  # one value (a one-block call): one piece when its slots are one run inside a block
        first_slot = int(s[0])
        last_slot = first_slot + s.size - 1
        # a value holds at most a store block of tokens: comparing Python lists beats numpy's per-call overhead
        if first_slot // block_size == last_slot // block_size and s.tolist() == list(range(first_slot, last_slot + 1)):
            table = np.array((first_slot, s.size, int(part_base[0]), s.size, 0), dtype=np.int64).reshape(5, 1)
            return table, _VALUE_ZERO
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = (s[1:] != s[:-1] + 1) | (s[1:] % block_size == 0)
    new[bounds[1:-1][bounds[1:-1] < s.size]] = True  # a value starts a piece (empty values start none)
    first = np.flatnonzero(new).astype(np.int64)
    counts = np.diff(np.append(first, s.size)).astype(np.int64)
    value = np.searchsorted(bounds, first, side="right").astype(np.int64) - 1
    value_tokens = np.diff(bounds)[value]
    table = np.stack([s[first], counts, np.asarray(part_base, dtype=np.int64)[value], value_tokens, first - bounds[value]])
    return table, value


def block_run_pieces(table: np.ndarray, block_size: int) -> np.ndarray | None:
    """Pieces of `PlaneSet.block_runs` moving the same bytes as `table` (pieces of the planes), when every piece is
    one whole block that is a whole value (`count == value tokens == block_size`): block b's run, one token of
    `block_run_bytes`, at the same part base; else None (then the planes' pieces move the values)."""
    start, count, base, tokens, index = table
    whole = (count == block_size) & (tokens == block_size) & (index == 0) & (start % block_size == 0)
    if count.size == 0 or not bool(whole.all()):
        return None
    ones = np.ones(count.size, dtype=np.int64)
    return np.stack([start // block_size, ones, base, ones, np.zeros(count.size, dtype=np.int64)])


def plane_pieces_of_runs(table: np.ndarray, block_size: int) -> np.ndarray:
    """The inverse of `block_run_pieces`: pieces of the planes moving the same bytes as `table` (pieces of
    `block_runs`, block b at part base p) -- each run one whole block of `block_size` tokens."""
    block, _, base, _, _ = table
    full = np.full(block.size, block_size, dtype=np.int64)
    return np.stack([block * block_size, full, base, full, np.zeros(block.size, dtype=np.int64)])


def exclusive_cumsum(counts: np.ndarray) -> np.ndarray:
    """int64 `[len(counts) + 1]`: 0, counts[0], counts[0] + counts[1], ..."""
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _expand_runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The slots of runs (lengths >= 0), in order: int64 `[sum(lengths)]`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    first = np.repeat(np.cumsum(lengths) - lengths, lengths)
    slots: np.ndarray = np.repeat(np.asarray(starts, dtype=np.int64), lengths) + (np.arange(first.size, dtype=np.int64) - first)
    return slots


@dataclass(frozen=True)
class GroupRegion:
    """One layer group's pieces in every value of a call: pieces of the group's planes, or, where the group
    keeps each block's planes together (cross-layer blocks) and every value is one whole block, pieces of its
    `block_runs` (one run per block: one copy each)."""

    group: LayerGroup
    planes: PlaneSet  # what the pieces name: `group.planes` or `group.planes.block_runs`
    pieces: np.ndarray  # int64 [5, N]: start slot, count, part offset INSIDE its value, value tokens, index in value
    piece_start: np.ndarray  # int64 [n + 1]: value i's pieces are pieces[:, piece_start[i] : piece_start[i + 1]]
    piece_value: np.ndarray  # int64 [N]

    def absolute(self, value_start: np.ndarray, a: int, b: int) -> np.ndarray:
        """The pieces of values a..b-1 with bases in staging (value i at value_start[i])."""
        start, end = int(self.piece_start[a]), int(self.piece_start[b])
        table = self.pieces[:, start:end].copy()
        table[2] += value_start[self.piece_value[start:end]]
        return table

    def has_pieces(self, a: int, b: int) -> bool:
        """Whether values a..b-1 hold any of this group's tokens."""
        return bool(self.piece_start[b] > self.piece_start[a])

    def of_value(self, i: int) -> np.ndarray:
        """Value i's pieces with bases inside the value (for a buffer holding just that value)."""
        return self.pieces[:, int(self.piece_start[i]) : int(self.piece_start[i + 1])]


@dataclass(frozen=True)
class BlockPlan:
    """A V1 call: one value per block hash."""

    keys: list[bytes]
    route_keys: list[bytes]
    expected: ExpectedValues
    regions: list[GroupRegion]
    value_start: np.ndarray  # int64 [n + 1]: value i at staging bytes value_start[i] .. + value_len(i)
    staging_bytes: int
    units: np.ndarray | None = None  # u64 [n]: each key's placement unit (`keys.chain_keys`); None: placed per key

    @property
    def total(self) -> int:
        return len(self.keys)

    @property
    def header_in_staging(self) -> bool:
        """Each value's header has its 40 bytes in staging, before the payload."""
        return True

    def value_len(self, i: int) -> int:
        return HEADER_SIZE + int(self.expected.payload_len[i])

    def payloads(self, host: memoryview, a: int = 0, b: int = -1) -> list[Buffer]:
        """The payloads of values a..b-1 (b -1: to the end) in staging (what the checksum covers)."""
        b = self.total if b < 0 else b
        starts = self.value_start[a:b].tolist()
        lens = self.expected.payload_len[a:b].tolist()
        return [host[s + HEADER_SIZE : s + HEADER_SIZE + n] for s, n in zip(starts, lens)]

    def value_views(self, host: memoryview, a: int, b: int) -> list[memoryview]:
        """Values a..b-1's places in staging, header included (where a load receives them in place)."""
        starts = self.value_start[a:b].tolist()
        lens = self.expected.payload_len[a:b].tolist()
        return [host[s : s + HEADER_SIZE + n] for s, n in zip(starts, lens)]


@dataclass(frozen=True)
class RawPlan:
    """A V0 call: value i is the concatenation of its device ranges."""

    keys: list[bytes]
    route_keys: list[bytes]
    expected: ExpectedValues
    call: RawCall
    value_start: np.ndarray  # int64 [n + 1]: byte offsets of each value in staging
    staging_bytes: int
    units: None = None  # V0 keys are placed by their routing key (`distribute_key`) alone

    @property
    def total(self) -> int:
        return len(self.keys)

    @property
    def header_in_staging(self) -> bool:
        return False

    def value_len(self, i: int) -> int:
        return HEADER_SIZE + int(self.expected.payload_len[i])

    def payloads(self, host: memoryview, a: int = 0, b: int = -1) -> list[Buffer]:
        b = self.total if b < 0 else b
        bounds = self.value_start[a : b + 1].tolist()
        return [host[s:e] for s, e in itertools.pairwise(bounds)]

    def segments(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Value i's device ranges: pointers and lengths (int64 tensors)."""
        return self.segments_of(i, i + 1)

    def segments_of(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Values a..b-1's device ranges, in order: pointers and lengths (int64 tensors)."""
        r = self.call
        s, e = int(r.seg_start[a]), int(r.seg_start[b])
        return torch.from_numpy(r.ptrs[s:e]), torch.from_numpy(r.lengths[s:e])


Plan = BlockPlan | RawPlan


@dataclass(frozen=True)
class _CallShape:
    """What a V1 plan derives from its tokens per block and group alone (not from slots or keys): the part that
    repeats from step to step (an engine saves and loads calls of the same few shapes), so it is computed once
    per shape (`_shape_of`) and the arrays are shared, read-only, by every plan of that shape."""

    payload_len: np.ndarray  # int64 [n]
    value_start: np.ndarray  # int64 [n + 1]
    part_offset: np.ndarray  # int64 [n, G]: each group's part inside its value
    token_start: np.ndarray  # int64 [G, n + 1]: each group's first token of each value
    tokens_digest: np.ndarray  # u64 [n]
    staging_bytes: int


_SHAPES: dict[tuple[int, bytes], _CallShape] = {}
_MAX_SHAPES = 256  # a bounded cache: an engine uses a few shapes; anything else is recomputed


def _shape_of(counts: np.ndarray, layout: RegisteredLayout) -> _CallShape:
    """The shape part of a plan for per-block token counts `counts` (int64 `[n, G]`), from the cache if seen."""
    key = (layout.signature, counts.tobytes())
    shape = _SHAPES.get(key)
    if shape is not None:
        return shape
    token_bytes = np.array([g.token_bytes for g in layout.groups], dtype=np.int64)
    part_bytes = counts * token_bytes[None, :]
    payload_len = part_bytes.sum(axis=1)
    value_start = VALUE_LEAD + exclusive_cumsum((HEADER_SIZE + payload_len + ALIGN - 1) // ALIGN * ALIGN)
    part_offset = HEADER_SIZE + np.cumsum(part_bytes, axis=1) - part_bytes
    token_start = np.stack([exclusive_cumsum(counts[:, g]) for g in range(counts.shape[1])])
    shape = _CallShape(
        payload_len, value_start, part_offset, token_start, tokens_digest(counts), max(int(value_start[-1]), ALIGN)
    )
    for array in (shape.payload_len, shape.value_start, shape.part_offset, shape.token_start, shape.tokens_digest):
        array.flags.writeable = False  # shared by every plan of this shape
    if len(_SHAPES) >= _MAX_SHAPES:
        _SHAPES.clear()
    _SHAPES[key] = shape
    return shape


_ONE_PIECE_START = np.arange(2, dtype=np.int64)  # a one-value call of one piece (shared: read-only)
_ONE_PIECE_START.flags.writeable = False


_MAX_ONE_RUN_PLANS = 4096  # per layout: a bounded cache (an engine's blocks times a few token counts)


def plan_blocks(call: SlotCall | ChunkCall, layout: RegisteredLayout, namespace: bytes, form: bytes = FORM_V1) -> BlockPlan:
    """A V1 call's plan: block i is stored under `call.hashes[i]` in `namespace` and the key form `form`
    (`keys.v1_keys`), or with a `chain_prefix` under its placement unit (`keys.chain_keys`: `FORM_CHAIN` for
    `FORM_V1`, else `form`, a unit form)."""
    units = None
    if call.chain_prefix is None:
        keys, route_keys = v1_keys(namespace, call.hashes, form)
    else:
        chain_form = FORM_CHAIN if form == FORM_V1 else form
        keys, route_keys, units = chain_keys(namespace, call.hashes, call.chain_prefix, chain_form)
    one_run = call.one_run if isinstance(call, SlotCall) else None
    if one_run is not None:  # one value whose slots are one run: its shape and pieces depend on the run alone
        cached = layout.one_run_plans.get(one_run)
        if cached is None:
            cached = _shape_and_regions(call, layout)
            if len(layout.one_run_plans) >= _MAX_ONE_RUN_PLANS:
                layout.one_run_plans.clear()
            layout.one_run_plans[one_run] = cached
        shape, regions = cached
    else:
        shape, regions = _shape_and_regions(call, layout)
    expected = ExpectedValues(
        kind=ValueKind.BLOCKS_V1,
        layout_sig=layout.signature,
        tokens_digest=shape.tokens_digest,
        payload_len=shape.payload_len,
    )
    return BlockPlan(keys, route_keys, expected, regions, shape.value_start, shape.staging_bytes, units)


def _shape_and_regions(call: SlotCall | ChunkCall, layout: RegisteredLayout) -> tuple[_CallShape, list[GroupRegion]]:
    """What a plan derives from the call's slots and token counts (not its keys): its shape and, per layer
    group, its pieces (read-only: shared by the plans of a cached run)."""
    n = call.total
    groups = layout.groups
    if isinstance(call, SlotCall):
        counts = np.repeat(call.offsets[:, None], len(groups), axis=1) if len(groups) > 1 else call.offsets[:, None]
    else:
        counts = np.ascontiguousarray(call.lengths.T)
    shape = _shape_of(counts, layout)
    regions: list[GroupRegion] = []
    for g, group in enumerate(groups):
        slots = call.slots if isinstance(call, SlotCall) else _expand_runs(call.starts[g], call.lengths[g])
        planes = group.planes
        table, value = value_pieces(slots, planes.block_size, shape.token_start[g], shape.part_offset[:, g])
        runs = planes.block_runs
        if runs is not None:  # cross-layer blocks: whole-block values move as one run each
            run_table = block_run_pieces(table, planes.block_size)
            if run_table is not None:
                planes, table = runs, run_table
        piece_start = (
            _ONE_PIECE_START
            if n == 1 and value.size == 1
            else np.searchsorted(value, np.arange(n + 1), side="left").astype(np.int64)
        )
        table.flags.writeable = False
        regions.append(GroupRegion(group, planes, table, piece_start, value))
    return shape, regions


def plan_raw(call: RawCall, namespace: bytes) -> RawPlan:
    keys, route_keys = v0_keys(namespace, call.keys)
    seg_bytes = exclusive_cumsum(call.lengths)
    value_start = seg_bytes[call.seg_start]
    payload_len = np.diff(value_start)
    expected = ExpectedValues(
        kind=ValueKind.RAW_V0,
        layout_sig=0,
        tokens_digest=np.zeros(call.total, dtype=np.uint64),
        payload_len=payload_len,
    )
    return RawPlan(keys, route_keys, expected, call, value_start, max(_align(int(value_start[-1])), ALIGN))

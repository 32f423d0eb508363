"""Value-major staging (`gather_pieces` / `scatter_pieces`): every backend against an independent per-token
reference, over uniform, strided and split (MLA) layouts, whole blocks, partial blocks, scattered slots and values
with gaps between them (headers). The Triton case runs in the interpreter: small shapes, and still ONE launch.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
import torch
from ems.kernels.base import CopyBackend, PlaneSet
from ems.kernels.plan import value_pieces
from kernel_cases import POISON, make_layout, random_tensor
from test_split_planes import SPLITS, _split_layout

GAP = 40  # bytes before every value (a header)


def _values(counts: list[int], token_bytes: int, align: int = 8) -> tuple[np.ndarray, np.ndarray, int]:
    """tok_start [n + 1], part_base [n] with a GAP before each value (values `align`-byte aligned), total bytes."""
    tok_start = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    sizes = GAP + np.asarray(counts, np.int64) * token_bytes
    starts = np.concatenate(([0], np.cumsum((sizes + align - 1) // align * align)))
    return tok_start, starts[:-1] + GAP, int(starts[-1])


def _reference_gather(planes: PlaneSet, slots: list[int], tok_start: np.ndarray, part_base: np.ndarray,
                      total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the staging a gather must produce, the mask of the bytes it writes)."""
    out = torch.full((total,), POISON, dtype=torch.uint8)
    mask = torch.zeros(total, dtype=torch.bool)
    bs = planes.block_size
    for i in range(len(part_base)):
        n = int(tok_start[i + 1] - tok_start[i])
        for j in range(n):
            s = slots[int(tok_start[i]) + j]
            for p, plane in enumerate(planes.planes):
                row = planes.plane_row_bytes[p]
                at = int(part_base[i]) + n * planes.plane_offsets[p] + j * row
                out[at : at + row] = plane[s // bs, s % bs].reshape(-1).view(torch.uint8)
                mask[at : at + row] = True
    return out, mask


def _case(planes: PlaneSet, slots: list[int], counts: list[int], align: int = 8
          ) -> tuple[torch.Tensor, np.ndarray, np.ndarray, int]:
    tok_start, part_base, total = _values(counts, planes.token_bytes, align)
    table, _ = value_pieces(np.asarray(slots, np.int64), planes.block_size, tok_start, part_base)
    return torch.from_numpy(table), tok_start, part_base, total


def _check(backend: CopyBackend, bases: list[torch.Tensor], planes: PlaneSet, slots: list[int], counts: list[int],
           gen: torch.Generator, align: int = 8) -> None:
    pieces, tok_start, part_base, total = _case(planes, slots, counts, align)
    expected, written = _reference_gather(planes, slots, tok_start, part_base, total)
    out = torch.full((total,), POISON, dtype=torch.uint8)
    ops = backend.ops_issued
    backend.gather_pieces(planes, pieces, out)
    assert torch.equal(out, expected)
    if backend.name == "triton" and len(slots):
        assert backend.ops_issued - ops == 1  # ONE launch per call (CPU: no table upload)
    if backend.name != "triton":  # piece by piece (the one-piece fast paths) gives the same bytes
        one_by_one = torch.full((total,), POISON, dtype=torch.uint8)
        for k in range(pieces.shape[1]):
            backend.gather_pieces(planes, pieces[:, k : k + 1].contiguous(), one_by_one)
        assert torch.equal(one_by_one, expected)
    # scatter fresh random values back into the same slots: exactly those rows change, to exactly those bytes
    src = random_tensor([total], torch.uint8, gen)
    before = [b.clone() for b in bases]
    backend.scatter_pieces(planes, pieces, src)
    again = torch.full((total,), POISON, dtype=torch.uint8)
    backend.gather_pieces(planes, pieces, again)
    assert torch.equal(again[written], src[written])
    changed = sum(int((b.view(torch.uint8) != a.view(torch.uint8)).sum()) for a, b in zip(before, bases))
    assert changed <= int(written.sum())


def _slot_cases(blocks: int, bs: int, gen: torch.Generator) -> list[tuple[list[int], list[int]]]:
    perm = torch.randperm(blocks, generator=gen).tolist()
    whole = [b * bs + k for b in perm[:3] for k in range(bs)]
    partial = whole[: 2 * bs + bs // 2]
    scattered = torch.randperm(blocks * bs, generator=gen)[:7].tolist()
    return [
        (whole, [bs, bs, bs]),  # whole blocks: one span per (block, plane)
        (partial, [bs, bs, bs // 2]),  # a partial last block
        (whole, [bs // 2, bs, bs + bs // 2]),  # values cutting through cache blocks
        (scattered, [3, 4]),  # scattered slots: one piece per token
        ([], []),
    ]


@pytest.mark.parametrize("kind", ["plain", "kv_interleaved", "padded_block", "padded_slot"])
def test_pieces_uniform_layouts(backend: CopyBackend, kind: str) -> None:
    gen = torch.Generator().manual_seed(7)
    bs = 4
    bases, planes = make_layout(kind, 2, 6, bs, 2, 8, torch.float16, gen)
    for slots, counts in _slot_cases(6, bs, gen):
        _check(backend, bases, planes, slots, counts, gen)


def test_pieces_odd_value_offsets(backend: CopyBackend) -> None:
    """Values at odd byte offsets: every backend must fall back to narrower moves, never misalign."""
    gen = torch.Generator().manual_seed(5)
    bases, planes = make_layout("plain", 2, 6, 4, 2, 8, torch.float16, gen)
    for slots, counts in _slot_cases(6, 4, gen):
        _check(backend, bases, planes, slots, counts, gen, align=1)
    pieces, _, _, total = _case(planes, list(range(8)), [3, 5], align=1)
    out = torch.zeros(total + 3, dtype=torch.uint8)[3:]  # an odd staging address too
    backend.gather_pieces(planes, pieces, out)


@pytest.mark.parametrize("split", SPLITS[:2])
@pytest.mark.parametrize("kind", ["plain", "block_packed"])
def test_pieces_split_planes(backend: CopyBackend, kind: str, split) -> None:
    gen = torch.Generator().manual_seed(11)
    bs = 4
    bases, planes = _split_layout(kind, 2, 6, bs, split, gen)
    for slots, counts in _slot_cases(6, bs, gen):
        _check(backend, bases, planes, slots, counts, gen)


def test_pieces_rejects_out_of_range(backend: CopyBackend) -> None:
    gen = torch.Generator().manual_seed(3)
    _, planes = make_layout("plain", 1, 2, 4, 1, 8, torch.float16, gen)
    good = torch.tensor([[0], [4], [0], [4], [0]], dtype=torch.int64)
    out = torch.zeros(4 * planes.token_bytes, dtype=torch.uint8)
    backend.gather_pieces(planes, good, out)
    for bad in ([[6], [4], [0], [4], [0]], [[0], [4], [8], [4], [0]], [[8], [1], [0], [1], [0]], [[0], [4], [0], [2], [0]]):
        with pytest.raises(ValueError):
            backend.gather_pieces(planes, torch.tensor(bad, dtype=torch.int64), out)


def test_value_pieces_whole_blocks_are_one_piece_per_block() -> None:
    slots = np.concatenate([np.arange(16) + 16 * b for b in (5, 2, 9)])
    table, value = value_pieces(slots, 16, np.array([0, 16, 32, 48]), np.array([40, 2000, 4000]))
    assert table.shape == (5, 3) and table[1].tolist() == [16, 16, 16] and value.tolist() == [0, 1, 2]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(1, 3))
def test_value_pieces_cover_every_slot_in_order(block_size: int, slots: list[int], values: int) -> None:
    """Whatever the slots, the pieces name them all, in order, each inside one block and one value."""
    s = np.asarray(slots, np.int64)
    cuts = np.linspace(0, s.size, values + 1).astype(np.int64)
    table, value = value_pieces(s, block_size, cuts, np.arange(values, dtype=np.int64) * 1000)
    start, count, base, tokens, index = table
    expanded = np.concatenate([np.arange(a, a + c) for a, c in zip(start, count)])
    assert expanded.tolist() == slots
    assert np.all(start // block_size == (start + count - 1) // block_size)
    assert np.all(base == value * 1000) and np.all(tokens == np.diff(cuts)[value])
    assert np.all(cuts[value] + index + count <= cuts[value + 1])

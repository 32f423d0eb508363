"""Layouts, random data and an independent per-token reference (value-major pieces) for the kernel tests.

Every layout factory returns `(bases, planes)`: the allocations that hold the cache (so a test can check that a
scatter touched nothing but the named rows, padding included) and the `PlaneSet` viewing them. Data are random
bytes (never zeros); staging buffers are poisoned with 0xA5 before each run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ems.datapath.planning import value_pieces
from ems.kernels.base import CopyBackend
from ems.kernels.planes import PlaneSet

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn]
POISON = 0xA5


def random_tensor(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes reinterpreted as `dtype` (every bit pattern, never all zeros)."""
    esize = torch.empty(0, dtype=dtype).element_size()
    shape = list(shape)
    raw = torch.randint(1, 256, shape[:-1] + [shape[-1] * esize], dtype=torch.int32, generator=gen)
    return raw.to(torch.uint8).view(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 copy of t's elements, for exact (NaN-safe) comparison."""
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)


def make_layout(
    kind: str,
    layers: int,
    blocks: int,
    block_size: int,
    heads: int,
    head_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[list[torch.Tensor], PlaneSet]:
    """kind: "plain" (one allocation per plane), "kv_interleaved" (one [blocks, 2, bs, h, d] per layer),
    "padded_block" (block stride padded by 3 slots), "padded_slot" (slot stride = row + 2 elements),
    "block_major" (cross-layer blocks: one [blocks, layers, 2, bs, h, d] allocation, each block's planes one run)."""
    bases: list[torch.Tensor] = []
    planes: list[torch.Tensor] = []
    row = heads * head_size
    if kind == "block_major":
        t = random_tensor([blocks, layers, 2, block_size, heads, head_size], dtype, gen)
        return [t], PlaneSet(tuple(t[:, layer, kv] for layer in range(layers) for kv in range(2)))
    for _ in range(layers):
        if kind == "plain":
            for _kv in range(2):
                t = random_tensor([blocks, block_size, heads, head_size], dtype, gen)
                bases.append(t)
                planes.append(t)
        elif kind == "kv_interleaved":
            t = random_tensor([blocks, 2, block_size, heads, head_size], dtype, gen)
            bases.append(t)
            planes += [t[:, 0], t[:, 1]]
        elif kind == "padded_block":
            for _kv in range(2):
                t = random_tensor([blocks, block_size + 3, heads, head_size], dtype, gen)
                bases.append(t)
                planes.append(t[:, :block_size])
        elif kind == "padded_slot":
            for _kv in range(2):
                t = random_tensor([blocks, block_size, row + 2], dtype, gen)
                bases.append(t)
                planes.append(t[:, :, :row].unflatten(-1, (heads, head_size)))
        else:
            raise ValueError(kind)
    return bases, PlaneSet(tuple(planes))


# (K row, K dtype, V row, V dtype): heads x head_size per plane (MLA with split K/V)
SPLITS = [
    ((1, 32), torch.bfloat16, (1, 8), torch.bfloat16),  # DeepSeek's 512/64 shape, scaled down for the interpreter
    ((1, 24), torch.float16, (1, 4), torch.float32),  # V of another dtype (4-byte elements)
    ((1, 7), torch.int8, (2, 3), torch.float16),  # odd byte rows: moved as int8
    ((2, 5), torch.float8_e4m3fn, (1, 6), torch.bfloat16),
]


def split_layout(
    kind: str, layers: int, blocks: int, block_size: int, split, gen: torch.Generator
) -> tuple[list[torch.Tensor], PlaneSet]:
    """kind: "plain" (one allocation per plane) or "block_packed" (one allocation per layer: each block holds its
    K rows then its V rows, as some engines pack a layer's latent and rope per block)."""
    (kh, kd), kdt, (vh, vd), vdt = split
    bases: list[torch.Tensor] = []
    planes: list[torch.Tensor] = []
    for _ in range(layers):
        if kind == "plain":
            k = random_tensor([blocks, block_size, kh, kd], kdt, gen)
            v = random_tensor([blocks, block_size, vh, vd], vdt, gen)
            bases += [k, v]
            planes += [k, v]
        else:
            kbytes = block_size * kh * kd * torch.empty(0, dtype=kdt).element_size()
            vbytes = block_size * vh * vd * torch.empty(0, dtype=vdt).element_size()
            raw = random_tensor([blocks, kbytes + vbytes], torch.uint8, gen)
            bases.append(raw)
            planes.append(raw[:, :kbytes].view(kdt).view(blocks, block_size, kh, kd))
            planes.append(raw[:, kbytes:].view(vdt).view(blocks, block_size, vh, vd))
    return bases, PlaneSet(tuple(planes))


GAP = 40  # bytes before every value (a header)


def values_layout(counts: Sequence[int], token_bytes: int, align: int = 8, gap: int = GAP) -> tuple[np.ndarray, np.ndarray, int]:
    """tok_start [n + 1], part_base [n] with `gap` bytes before each value (values `align`-byte aligned), total bytes."""
    tok_start = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    sizes = gap + np.asarray(counts, np.int64) * token_bytes
    starts = np.concatenate(([0], np.cumsum((sizes + align - 1) // align * align)))
    return tok_start, starts[:-1] + gap, int(starts[-1])


def reference_pieces(
    planes: PlaneSet, slots: Sequence[int], tok_start: np.ndarray, part_base: np.ndarray, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the value-major staging a gather must produce, the mask of the bytes it writes), by a per-token loop
    independent of every backend."""
    out = torch.full((total,), POISON, dtype=torch.uint8)
    mask = torch.zeros(total, dtype=torch.bool)
    for at, row, source in _reference_rows(planes, slots, tok_start, part_base):
        out[at : at + row] = source.reshape(-1).view(torch.uint8)
        mask[at : at + row] = True
    return out, mask


def _reference_rows(
    planes: PlaneSet, slots: Sequence[int], tok_start: np.ndarray, part_base: np.ndarray
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(staging offset, row bytes, the cache row it holds) of every token row of every plane, by a per-token loop
    independent of every backend: value i holds its tokens plane by plane."""
    bs = planes.block_size
    for i in range(len(part_base)):
        n = int(tok_start[i + 1] - tok_start[i])
        for j in range(n):
            s = slots[int(tok_start[i]) + j]
            for p, plane in enumerate(planes.planes):
                row = planes.plane_row_bytes[p]
                yield int(part_base[i]) + n * planes.plane_offsets[p] + j * row, row, plane[s // bs, s % bs]


def pieces_case(
    planes: PlaneSet, slots: Sequence[int], counts: Sequence[int], align: int = 8, gap: int = GAP
) -> tuple[torch.Tensor, np.ndarray, np.ndarray, int]:
    """(piece table, tok_start, part_base, total staging bytes) for `slots` cut into values of `counts` tokens."""
    tok_start, part_base, total = values_layout(counts, planes.token_bytes, align, gap)
    table, _ = value_pieces(np.asarray(slots, np.int64), planes.block_size, tok_start, part_base)
    return torch.from_numpy(table), tok_start, part_base, total


def check_pieces_roundtrip(
    backend: CopyBackend,
    bases: list[torch.Tensor],
    planes: PlaneSet,
    slots: Sequence[int],
    counts: Sequence[int],
    gen: torch.Generator,
    align: int = 8,
    scatter: bool = True,
    gap: int = GAP,
) -> None:
    """Gather like the reference (ONE launch on the Triton path; piece by piece gives the same bytes); then, unless
    `scatter` is False (slots with repeats), scatter fresh bytes: exactly the named rows change, padding and every
    other row stay, and a gather reads the new bytes back."""
    pieces, tok_start, part_base, total = pieces_case(planes, slots, counts, align, gap)
    expected, written = reference_pieces(planes, slots, tok_start, part_base, total)
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
    # numpy staging (the embedded store's own buffers), whole and piece by piece: the same bytes
    host = np.full(total, POISON, dtype=np.uint8)
    backend.gather_pieces(planes, pieces, host)
    assert np.array_equal(host, expected.numpy())
    host_one_by_one = np.full(total, POISON, dtype=np.uint8)
    for k in range(pieces.shape[1]):
        backend.gather_pieces(planes, pieces[:, k : k + 1].contiguous(), host_one_by_one)
    assert np.array_equal(host_one_by_one, expected.numpy())
    if not scatter:
        return
    src = random_tensor([total], torch.uint8, gen)
    before = [as_bytes(b).clone() for b in bases]
    want = [b.clone() for b in before]  # the reference scatter, on byte copies of the bases
    for at, row, target in _reference_rows(planes, slots, tok_start, part_base):
        owner = _owner(bases, target)
        first = target.data_ptr() - bases[owner].data_ptr()
        want[owner][first : first + row] = src[at : at + row]
    backend.scatter_pieces(planes, pieces, src)
    for got, w in zip(bases, want):
        assert torch.equal(as_bytes(got), w)
    # again from a read-only numpy source (a stored value: a scatter never writes its source), piece by piece
    for got, b in zip(bases, before):
        as_bytes(got).copy_(b)
    read_only = src.numpy().copy()
    read_only.flags.writeable = False
    for k in range(pieces.shape[1]):
        backend.scatter_pieces(planes, pieces[:, k : k + 1].contiguous(), read_only)
    for got, w in zip(bases, want):
        assert torch.equal(as_bytes(got), w)
    again = torch.full((total,), POISON, dtype=torch.uint8)
    backend.gather_pieces(planes, pieces, again)
    assert torch.equal(again[written], src[written])


def _owner(bases: list[torch.Tensor], plane: torch.Tensor) -> int:
    for i, b in enumerate(bases):
        if b.untyped_storage().data_ptr() == plane.untyped_storage().data_ptr():
            return i
    raise LookupError("plane without a base")

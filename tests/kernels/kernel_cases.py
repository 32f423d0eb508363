"""Layouts, random data and an independent per-token reference for the kernel tests.

Every layout factory returns `(bases, planes)`: the allocations that hold the cache (so a test can check that a
scatter touched nothing but the named rows, padding included) and the `PlaneSet` viewing them. Data are random
bytes (never zeros); staging buffers are poisoned with 0xA5 before each run.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from ems.kernels.base import PlaneSet

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn]
POISON = 0xA5


def random_tensor(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes reinterpreted as `dtype` (every bit pattern, never all zeros)."""
    esize = torch.empty(0, dtype=dtype).element_size()
    shape = list(shape)
    raw = torch.randint(1, 256, shape[:-1] + [shape[-1] * esize], dtype=torch.int32, generator=gen)
    return raw.to(torch.uint8).view(dtype)


def poisoned(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    esize = torch.empty(0, dtype=dtype).element_size()
    shape = list(shape)
    return torch.full(shape[:-1] + [shape[-1] * esize], POISON, dtype=torch.uint8).view(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 copy of t's elements, for exact (NaN-safe) comparison."""
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)


def make_layout(
    kind: str, layers: int, blocks: int, block_size: int, heads: int, head_size: int, dtype: torch.dtype,
    gen: torch.Generator,
) -> Tuple[List[torch.Tensor], PlaneSet]:
    """kind: "plain" (one allocation per plane), "kv_interleaved" (one [blocks, 2, bs, h, d] per layer),
    "padded_block" (block stride padded by 3 slots), "padded_slot" (slot stride = row + 2 elements)."""
    bases: List[torch.Tensor] = []
    planes: List[torch.Tensor] = []
    row = heads * head_size
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


def reference_gather(planes: PlaneSet, slots: Sequence[int]) -> torch.Tensor:
    """out [T, P, row] by a plain per-token loop (independent of every backend)."""
    bs = planes.block_size
    rows = [
        torch.stack([p[s // bs, s % bs].reshape(-1) for p in planes.planes]) for s in slots
    ]
    if not rows:
        return torch.empty(0, planes.num_planes, planes.row_elems, dtype=planes.dtype)
    return torch.stack(rows)


def reference_scatter(planes: PlaneSet, slots: Sequence[int], src: torch.Tensor) -> None:
    bs = planes.block_size
    for t, s in enumerate(slots):
        for p, plane in enumerate(planes.planes):
            plane[s // bs, s % bs] = src[t, p].reshape(plane.shape[2], plane.shape[3])


def runs_slots(starts: Sequence[int], lengths: Sequence[int]) -> List[int]:
    return [s + k for s, n in zip(starts, lengths) for k in range(n)]

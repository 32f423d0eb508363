"""Planes of one layer group with different row sizes and dtypes (MLA with split K/V: K = the latent, V = the rope
part), on every backend (Triton interpreter, torch, memcpy) against an independent per-token reference.

Staging is token-major, every plane's row back to back (`PlaneSet.plane_offsets`). Interpreter cases are small
(the interpreter is ~1000x slower than torch); the Triton path must stay ONE launch per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from ems.kernels.base import CopyBackend, PlaneSet
from kernel_cases import POISON, as_bytes, random_tensor, runs_slots

# (K row, K dtype, V row, V dtype): heads x head_size per plane
SPLITS = [
    ((1, 32), torch.bfloat16, (1, 8), torch.bfloat16),  # DeepSeek's 512/64 shape, scaled down for the interpreter
    ((1, 24), torch.float16, (1, 4), torch.float32),  # V of another dtype (4-byte elements)
    ((1, 7), torch.int8, (2, 3), torch.float16),  # odd byte rows: moved as int8
    ((2, 5), torch.float8_e4m3fn, (1, 6), torch.bfloat16),
]


def _split_layout(kind: str, layers: int, blocks: int, block_size: int, split, gen: torch.Generator
                  ) -> tuple[list[torch.Tensor], PlaneSet]:
    """kind: "plain" (one allocation per plane) or "block_packed" (one allocation per layer: each block holds its
    K rows then its V rows, as some engines pack a layer's latent and rope per block)."""
    (kh, kd), kdt, (vh, vd), vdt = split
    bases, planes = [], []
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


def _reference(planes: PlaneSet, slots: Sequence[int]) -> torch.Tensor:
    """uint8 `[T, token_bytes]` by a per-token loop: each plane's row bytes, back to back."""
    bs = planes.block_size
    rows = [torch.cat([p[s // bs, s % bs].reshape(-1).view(torch.uint8) for p in planes.planes]) for s in slots]
    return torch.stack(rows) if rows else torch.empty(0, planes.token_bytes, dtype=torch.uint8)


def _poisoned(tokens: int, planes: PlaneSet) -> torch.Tensor:
    return torch.full((tokens, planes.token_bytes), POISON, dtype=torch.uint8)


def _check(backend: CopyBackend, bases: list[torch.Tensor], planes: PlaneSet, read: list[int], write: list[int],
           gen: torch.Generator) -> None:
    out = _poisoned(len(read), planes)
    backend.gather_slots(planes, torch.tensor(read, dtype=torch.int64), out)
    assert torch.equal(out, _reference(planes, read))
    # scatter: exactly the named rows change, every other byte (padding, other planes) stays
    src = random_tensor([len(write), planes.token_bytes], torch.uint8, gen)
    before = [as_bytes(b).clone() for b in bases]
    everything = _reference(planes, range(planes.num_slots))
    backend.scatter_slots(planes, torch.tensor(write, dtype=torch.int64), src)
    after = _reference(planes, range(planes.num_slots))
    untouched = [s for s in range(planes.num_slots) if s not in set(write)]
    assert torch.equal(after[untouched], everything[untouched])
    assert torch.equal(after[write], src)
    changed = sum(int((as_bytes(b) != old).sum()) for b, old in zip(bases, before))
    assert changed <= len(write) * planes.token_bytes


def test_planes_report_their_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    _, planes = _split_layout("plain", 2, 3, 4, SPLITS[1], gen)
    assert not planes.uniform
    assert planes.plane_row_bytes == (48, 16, 48, 16)
    assert planes.plane_offsets == (0, 48, 64, 112) and planes.token_bytes == 128
    with pytest.raises(ValueError, match="per plane"):
        _ = planes.row_elems
    with pytest.raises(ValueError, match="block_size"):
        PlaneSet((torch.zeros(3, 4, 1, 8), torch.zeros(3, 2, 1, 8)))


@pytest.mark.parametrize("split", SPLITS, ids=["bf16", "fp16-fp32", "int8-fp16", "fp8-bf16"])
@pytest.mark.parametrize("kind", ["plain", "block_packed"])
def test_split_kv_slots(backend: CopyBackend, kind: str, split) -> None:
    gen = torch.Generator().manual_seed(len(kind) * 31 + SPLITS.index(split))
    bases, planes = _split_layout(kind, layers=2, blocks=5, block_size=4, split=split, gen=gen)
    # whole blocks, a partial block, repeats and gaps; distinct slots for the scatter
    _check(backend, bases, planes, [4, 5, 6, 7, 12, 13, 19, 0, 0, 9], [8, 9, 10, 11, 3, 17], gen)


def test_split_kv_runs(backend: CopyBackend) -> None:
    gen = torch.Generator().manual_seed(23)
    _bases, planes = _split_layout("block_packed", layers=2, blocks=6, block_size=4, split=SPLITS[0], gen=gen)
    starts, lengths = [2, 9, 16], [5, 3, 8]
    slots = runs_slots(starts, lengths)
    out = _poisoned(len(slots), planes)
    backend.gather_runs(planes, torch.tensor(starts), torch.tensor(lengths), out)
    assert torch.equal(out, _reference(planes, slots))
    src = random_tensor([len(slots), planes.token_bytes], torch.uint8, gen)
    before = _reference(planes, range(planes.num_slots))
    backend.scatter_runs(planes, torch.tensor(starts), torch.tensor(lengths), src)
    after = _reference(planes, range(planes.num_slots))
    untouched = [s for s in range(planes.num_slots) if s not in set(slots)]
    assert torch.equal(after[untouched], before[untouched]) and torch.equal(after[slots], src)


def test_split_kv_is_one_launch(backend: CopyBackend) -> None:
    """Split K/V keeps the kernel path at one launch per call, whatever the planes and blocks."""
    gen = torch.Generator().manual_seed(29)
    _, planes = _split_layout("plain", layers=3, blocks=12, block_size=2, split=SPLITS[1], gen=gen)
    counts = []
    for n_blocks in (1, 10):
        slots = torch.arange(2 * n_blocks, dtype=torch.int64)
        before = backend.ops_issued
        out = _poisoned(len(slots), planes)
        backend.gather_slots(planes, slots, out)
        counts.append(backend.ops_issued - before)
        assert torch.equal(out, _reference(planes, slots.tolist()))
    if backend.name == "triton":
        assert counts == [1, 1]  # CPU: one launch (no table upload), whatever the planes and blocks
    if backend.name == "torch":
        assert counts == [6, 6]  # one index_select per plane: rows of different sizes take the per-plane path
    if backend.name == "memcpy":
        assert counts == [1 * 6, 10 * 6]  # one copy per (block, plane)


def test_split_kv_torch_per_plane_path() -> None:
    """Planes of different row sizes take the torch backend's per-plane path: one op per plane."""
    import ems.kernels.torch_backend as tbk

    gen = torch.Generator().manual_seed(31)
    for split in SPLITS:
        bases, planes = _split_layout("block_packed", layers=2, blocks=4, block_size=4, split=split, gen=gen)
        backend = tbk.TorchBackend()
        _check(backend, bases, planes, [3, 4, 5, 15, 0, 0, 9], [1, 2, 14, 7], gen)
        assert backend.ops_issued == 2 * planes.num_planes


def test_deepseek_sizes(backend: CopyBackend) -> None:
    """The real shapes once: K = [blocks, bs, 1, 512] bf16 latent, V = [blocks, bs, 1, 64] bf16 rope."""
    gen = torch.Generator().manual_seed(37)
    split = ((1, 512), torch.bfloat16, (1, 64), torch.bfloat16)
    bases, planes = _split_layout("plain", layers=1, blocks=3, block_size=2, split=split, gen=gen)
    assert planes.plane_row_bytes == (1024, 128)
    _check(backend, bases, planes, [2, 3, 5, 0], [1, 4], gen)

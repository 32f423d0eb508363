"""Gather/scatter of token rows by slot and by run, on every backend, against a per-token reference."""

from __future__ import annotations

from collections import OrderedDict
from typing import List

import pytest
import torch

from ems.kernels.base import CopyBackend, PlaneSet
from kernel_cases import (
    DTYPES,
    as_bytes,
    make_layout,
    poisoned,
    random_tensor,
    reference_gather,
    reference_scatter,
    runs_slots,
)

LAYOUTS = ["plain", "kv_interleaved", "padded_block", "padded_slot"]


def _gather_check(backend: CopyBackend, planes: PlaneSet, slots: List[int]) -> None:
    out = poisoned([len(slots), planes.num_planes, planes.row_elems], planes.dtype)
    backend.gather_slots(planes, torch.tensor(slots, dtype=torch.int64), out)
    assert torch.equal(as_bytes(out), as_bytes(reference_gather(planes, slots)))


def _scatter_check(backend: CopyBackend, bases: List[torch.Tensor], planes: PlaneSet, slots: List[int],
                   gen: torch.Generator) -> None:
    """Scatter random rows to `slots`; exactly those rows change (padding included), and gather reads them back."""
    src = random_tensor([len(slots), planes.num_planes, planes.row_elems], planes.dtype, gen)
    expected = [b.clone() for b in bases]
    # apply the reference to the same views of the clones
    expected_planes = PlaneSet(tuple(
        torch.as_strided(expected[_owner(bases, p)], p.shape, p.stride(),
                         p.storage_offset() - bases[_owner(bases, p)].storage_offset())
        for p in planes.planes
    ))
    reference_scatter(expected_planes, slots, src)
    backend.scatter_slots(planes, torch.tensor(slots, dtype=torch.int64), src)
    for got, want in zip(bases, expected):
        assert torch.equal(as_bytes(got), as_bytes(want))
    _gather_check(backend, planes, slots)


def _owner(bases: List[torch.Tensor], plane: torch.Tensor) -> int:
    for i, b in enumerate(bases):
        if b.untyped_storage().data_ptr() == plane.untyped_storage().data_ptr():
            return i
    raise LookupError("plane without a base")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_slots_roundtrip_dtypes_layouts(backend: CopyBackend, dtype: torch.dtype, layout: str) -> None:
    gen = torch.Generator().manual_seed(hash((str(dtype), layout)) % 2**31)
    bases, planes = make_layout(layout, layers=2, blocks=6, block_size=8, heads=3, head_size=5, dtype=dtype,
                                gen=gen)
    # whole blocks, a partial block, repeats, unordered slots, gaps
    _gather_check(backend, planes, list(range(8, 24)) + [40, 41, 42])
    _gather_check(backend, planes, [47, 0, 5, 5, 33, 12, 12, 12, 7, 8])
    perm = torch.randperm(planes.num_slots, generator=gen)[:13].tolist()
    _scatter_check(backend, bases, planes, perm, gen)
    _scatter_check(backend, bases, planes, list(range(16, 29)), gen)


@pytest.mark.parametrize("heads,head_size,dtype", [
    (1, 7, torch.int8),  # 7-byte rows: moved as int8
    (3, 5, torch.float16),  # 30-byte rows: int16
    (1, 7, torch.bfloat16),
    (2, 3, torch.float16),  # 12-byte rows: int32 although a head is 6 bytes
    (1, 576, torch.bfloat16),  # MLA latent
])
def test_odd_rows(backend: CopyBackend, heads: int, head_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(heads * 1000 + head_size)
    bases, planes = make_layout("kv_interleaved", layers=1, blocks=4, block_size=4, heads=heads,
                                head_size=head_size, dtype=dtype, gen=gen)
    _gather_check(backend, planes, [3, 4, 5, 6, 7, 8, 15, 2, 2])
    _scatter_check(backend, bases, planes, [9, 10, 11, 0, 14], gen)


def test_tile_edges(backend: CopyBackend) -> None:
    """Rows and blocks larger than one tile: several row tiles per block and several column tiles per row."""
    gen = torch.Generator().manual_seed(7)
    if hasattr(backend, "tile_elems"):
        backend.tile_elems = 64  # tiny tiles, so small data crosses many tile edges
    # row = 3 * 33 = 99 fp32 units -> 2 column tiles of 64; block_size 16 -> 16 row tiles of 1 row
    bases, planes = make_layout("plain", layers=1, blocks=3, block_size=16, heads=3, head_size=33,
                                dtype=torch.float32, gen=gen)
    _gather_check(backend, planes, list(range(0, 48)))
    _scatter_check(backend, bases, planes, list(range(5, 37)), gen)
    # row = 5 units -> COLS 8, ROWS 8: a 16-slot block needs two row tiles, partial pieces need masks
    bases, planes = make_layout("kv_interleaved", layers=1, blocks=4, block_size=16, heads=1, head_size=5,
                                dtype=torch.float32, gen=gen)
    _gather_check(backend, planes, list(range(3, 64)))
    _scatter_check(backend, bases, planes, list(range(1, 40)), gen)


def test_default_tiles_cross_column_edge(backend: CopyBackend) -> None:
    """A row wider than the default interpreter tile (16384 units) is split into column tiles."""
    gen = torch.Generator().manual_seed(11)
    bases, planes = make_layout("plain", layers=1, blocks=2, block_size=2, heads=1, head_size=16389,
                                dtype=torch.float32, gen=gen)
    _gather_check(backend, planes, [3, 0, 1])
    _scatter_check(backend, bases, planes, [2, 1], gen)


@pytest.mark.parametrize("layout", ["plain", "kv_interleaved", "padded_slot"])
def test_runs(backend: CopyBackend, layout: str) -> None:
    gen = torch.Generator().manual_seed(3)
    bases, planes = make_layout(layout, layers=2, blocks=6, block_size=8, heads=2, head_size=4,
                                dtype=torch.bfloat16, gen=gen)
    # runs crossing block boundaries, a run of one, touching runs, a run spanning three blocks
    starts, lengths = [5, 16, 13, 30, 47], [6, 1, 3, 18, 1]
    slots = runs_slots(starts, lengths)
    out = poisoned([len(slots), planes.num_planes, planes.row_elems], planes.dtype)
    backend.gather_runs(planes, torch.tensor(starts), torch.tensor(lengths), out)
    assert torch.equal(as_bytes(out), as_bytes(reference_gather(planes, slots)))
    # scatter of disjoint runs
    starts, lengths = [2, 12, 30], [9, 4, 12]
    slots = runs_slots(starts, lengths)
    src = random_tensor([len(slots), planes.num_planes, planes.row_elems], planes.dtype, gen)
    before = reference_gather(planes, list(range(planes.num_slots)))
    backend.scatter_runs(planes, torch.tensor(starts), torch.tensor(lengths), src)
    after = reference_gather(planes, list(range(planes.num_slots)))
    named = set(slots)
    untouched = [s for s in range(planes.num_slots) if s not in named]
    assert torch.equal(as_bytes(after[untouched]), as_bytes(before[untouched]))
    assert torch.equal(as_bytes(after[slots]), as_bytes(src))


def test_empty_request(backend: CopyBackend) -> None:
    gen = torch.Generator().manual_seed(5)
    _, planes = make_layout("plain", layers=1, blocks=2, block_size=4, heads=1, head_size=4,
                            dtype=torch.float16, gen=gen)
    out = poisoned([0, 2, 4], torch.float16)
    backend.gather_slots(planes, torch.zeros(0, dtype=torch.int64), out)


def test_many_blocks_one_launch(backend: CopyBackend) -> None:
    """Device ops per save do not grow with blocks for the kernel path; they do for the memcpy path."""
    gen = torch.Generator().manual_seed(9)
    _, planes = make_layout("plain", layers=2, blocks=40, block_size=4, heads=1, head_size=8,
                            dtype=torch.float16, gen=gen)
    counts = []
    for n_blocks in (2, 20):
        slots = list(range(0, 4 * n_blocks))
        before = backend.ops_issued
        _gather_check(backend, planes, slots)
        counts.append(backend.ops_issued - before)
    if backend.name == "triton":
        assert counts[0] == counts[1] == 1  # CPU: no table upload, one launch
    if backend.name == "memcpy":
        assert counts == [2 * 4, 20 * 4]  # one copy per (block, plane)
    if backend.name == "torch":
        assert counts[0] == counts[1]


try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    given = None

if given is not None:

    @settings(max_examples=12, deadline=None)
    @given(
        data=st.data(),
        block_size=st.sampled_from([1, 3, 4, 16]),
        head_size=st.integers(1, 9),
        layout=st.sampled_from(LAYOUTS),
    )
    def test_property_gather_scatter(data: st.DataObject, block_size: int, head_size: int, layout: str) -> None:
        """Any slot list (repeats, any order) gathers like the reference; any distinct slots scatter exactly."""
        from ems.kernels.triton_backend import TritonBackend
        from ems.kernels.torch_backend import TorchBackend
        from ems.kernels.memcpy_backend import MemcpyBackend

        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
        bases, planes = make_layout(layout, layers=1, blocks=5, block_size=block_size, heads=2,
                                    head_size=head_size, dtype=torch.float16, gen=gen)
        n = planes.num_slots
        slots = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=12))
        distinct = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=12, unique=True))
        for backend in (TritonBackend(torch.device("cpu")), TorchBackend(), MemcpyBackend()):
            _gather_check(backend, planes, slots)
            _scatter_check(backend, bases, planes, distinct, gen)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_per_plane_path(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch backend's per-plane path (used off CPU, or when planes are too far apart for one span view)."""
    import ems.kernels.torch_backend as tbk

    monkeypatch.setattr(tbk, "_MAX_SPAN", 0)
    monkeypatch.setattr(tbk, "_span_cache", OrderedDict())
    gen = torch.Generator().manual_seed(17)
    bases, planes = make_layout(layout, layers=2, blocks=4, block_size=4, heads=3, head_size=5,
                                dtype=torch.bfloat16, gen=gen)
    backend = tbk.TorchBackend()
    _gather_check(backend, planes, [3, 4, 5, 15, 0, 0, 9])
    _scatter_check(backend, bases, planes, [1, 2, 14, 7], gen)
    assert backend.ops_issued == 3 * planes.num_planes  # two gathers and one scatter, one op per plane each

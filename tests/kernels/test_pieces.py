"""Value-major staging (`gather_pieces` / `scatter_pieces`): every backend against an independent per-token
reference, over uniform, strided and split (MLA) layouts, whole blocks, partial blocks, scattered slots and values
with gaps between them (headers). The Triton case runs in the interpreter: small shapes, and still ONE launch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import DTYPES, SPLITS, as_bytes, check_pieces_roundtrip, make_layout, pieces_case, split_layout

from ems.datapath.planning import block_run_pieces, value_pieces
from ems.kernels.base import CopyBackend
from ems.kernels.planes import PlaneSet

LAYOUTS = ["plain", "kv_interleaved", "padded_block", "padded_slot", "block_major"]


def _check(
    backend: CopyBackend,
    bases: list[torch.Tensor],
    planes: PlaneSet,
    slots: list[int],
    counts: list[int],
    gen: torch.Generator,
    align: int = 8,
    scatter: bool = True,
) -> None:
    check_pieces_roundtrip(backend, bases, planes, slots, counts, gen, align, scatter)


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


@pytest.mark.parametrize("kind", LAYOUTS)
def test_pieces_uniform_layouts(backend: CopyBackend, kind: str) -> None:
    gen = torch.Generator().manual_seed(7)
    bs = 4
    bases, planes = make_layout(kind, 2, 6, bs, 2, 8, torch.float16, gen)
    for slots, counts in _slot_cases(6, bs, gen):
        _check(backend, bases, planes, slots, counts, gen)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_pieces_many_whole_blocks(backend: CopyBackend, kind: str) -> None:
    """Whole blocks in any order, more values than planes (the torch path's one op per plane at the values' common
    step), then the same values with a shorter last one (no common step: the general path), both directions, like
    the reference."""
    gen = torch.Generator().manual_seed(17)
    bs = 4
    bases, planes = make_layout(kind, 2, 12, bs, 2, 8, torch.float16, gen)
    order = torch.randperm(12, generator=gen).tolist()
    slots = [b * bs + j for b in order[:9] for j in range(bs)]
    _check(backend, bases, planes, slots, [bs] * 9, gen)
    _check(backend, bases, planes, slots[:-1], [bs] * 8 + [bs - 1], gen)


@pytest.mark.parametrize("kind", ["plain", "kv_interleaved"])
def test_pieces_engine_sized_runs(backend: CopyBackend, kind: str) -> None:
    """Runs of an engine's size (16 tokens x 8 heads x 128 fp16 = 32 KiB a (block, plane), 64 KiB with 32 tokens),
    and 600-byte rows whose runs start unaligned and end off a cache line: every byte like the reference's (the
    other cases here are a few hundred bytes a run)."""
    if type(backend).__name__ == "TritonBackend":
        pytest.skip("engine-sized shapes are too slow for the Triton interpreter (the host copy is what this checks)")
    gen = torch.Generator().manual_seed(23)
    # (block size, heads, head size): whole 32 / 64 KiB runs; then 600-byte rows, whose runs start unaligned in the
    # cache and end off a 64-byte line
    for bs, heads, head_size in ((16, 8, 128), (32, 8, 128), (32, 3, 100)):
        bases, planes = make_layout(kind, 2, 5, bs, heads, head_size, torch.float16, gen)
        order = torch.randperm(5, generator=gen).tolist()
        whole = [b * bs + j for b in order[:4] for j in range(bs)]
        _check(backend, bases, planes, whole, [bs] * 4, gen, align=1)  # values at odd offsets: unaligned runs
        _check(backend, bases, planes, whole[: 3 * bs + 5], [bs, bs, bs + 5], gen)  # a partial last block
        _check(backend, bases, planes, whole, [bs - 1, bs + 1, bs - 3, bs + 3], gen)  # values cutting blocks


def test_pieces_odd_value_offsets(backend: CopyBackend) -> None:
    """Values at odd byte offsets: every backend must fall back to narrower moves, never misalign."""
    gen = torch.Generator().manual_seed(5)
    bases, planes = make_layout("plain", 2, 6, 4, 2, 8, torch.float16, gen)
    for slots, counts in _slot_cases(6, 4, gen):
        _check(backend, bases, planes, slots, counts, gen, align=1)
    pieces, _, _, total = pieces_case(planes, list(range(8)), [3, 5], align=1)
    out = torch.zeros(total + 3, dtype=torch.uint8)[3:]  # an odd staging address too
    backend.gather_pieces(planes, pieces, out)


@pytest.mark.parametrize("split", SPLITS[:2])
@pytest.mark.parametrize("kind", ["plain", "block_packed"])
def test_pieces_split_planes(backend: CopyBackend, kind: str, split) -> None:
    gen = torch.Generator().manual_seed(11)
    bs = 4
    bases, planes = split_layout(kind, 2, 6, bs, split, gen)
    for slots, counts in _slot_cases(6, bs, gen):
        _check(backend, bases, planes, slots, counts, gen)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pieces_dtypes_layouts(backend: CopyBackend, dtype: torch.dtype, layout: str) -> None:
    """Every dtype (fp8 included) on every strided view, bit for bit: whole blocks, a partial block, gaps and
    unordered slots; repeats and any order in a gather (a value may name one slot twice)."""
    gen = torch.Generator().manual_seed(hash((str(dtype), layout)) % 2**31)
    bases, planes = make_layout(layout, layers=2, blocks=6, block_size=8, heads=3, head_size=5, dtype=dtype, gen=gen)
    _check(backend, bases, planes, list(range(8, 24)) + [40, 41, 42], [8, 8, 3], gen)
    _check(backend, bases, planes, [47, 0, 5, 5, 33, 12, 12, 12, 7, 8], [4, 6], gen, scatter=False)
    perm = torch.randperm(planes.num_slots, generator=gen)[:13].tolist()
    _check(backend, bases, planes, perm, [5, 8], gen)


@pytest.mark.parametrize(
    "heads,head_size,dtype",
    [
        (1, 7, torch.int8),  # 7-byte rows: moved as int8
        (3, 5, torch.float16),  # 30-byte rows: int16
        (2, 3, torch.float16),  # 12-byte rows: int32 although a head is 6 bytes
        (1, 576, torch.bfloat16),  # MLA latent
    ],
)
def test_pieces_odd_rows(backend: CopyBackend, heads: int, head_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(heads * 1000 + head_size)
    bases, planes = make_layout(
        "kv_interleaved", layers=1, blocks=4, block_size=4, heads=heads, head_size=head_size, dtype=dtype, gen=gen
    )
    _check(backend, bases, planes, [3, 4, 5, 6, 7, 8, 15, 2, 2], [9], gen, scatter=False)
    _check(backend, bases, planes, [9, 10, 11, 0, 14], [3, 2], gen)


def test_pieces_tile_edges(backend: CopyBackend) -> None:
    """Pieces longer than one tile: several span tiles per piece (contiguous rows), several row and column tiles
    per piece (strided rows), masks at every edge."""
    gen = torch.Generator().manual_seed(7)
    if hasattr(backend, "tile_override"):
        backend.tile_override = 64  # tiny tiles, so small data crosses many tile edges
    # row = 3 * 33 = 99 fp32 units -> 2 column tiles of 64; a 16-slot piece = 1584 units -> 25 span tiles
    bases, planes = make_layout("plain", layers=1, blocks=3, block_size=16, heads=3, head_size=33, dtype=torch.float32, gen=gen)
    _check(backend, bases, planes, list(range(0, 48)), [16, 20, 12], gen)
    # strided rows (padded slots): 2-D tiles, ROWS x COLS, a 16-slot block needs several row tiles
    bases, planes = make_layout(
        "padded_slot", layers=1, blocks=4, block_size=16, heads=1, head_size=5, dtype=torch.float32, gen=gen
    )
    _check(backend, bases, planes, list(range(3, 64)), [13, 16, 32], gen)


def test_pieces_default_tiles_cross_column_edge(backend: CopyBackend) -> None:
    """A row wider than the default interpreter tile (16384 units), strided and contiguous."""
    gen = torch.Generator().manual_seed(11)
    for layout in ("plain", "padded_slot"):
        bases, planes = make_layout(
            layout, layers=1, blocks=2, block_size=2, heads=1, head_size=16389, dtype=torch.float32, gen=gen
        )
        _check(backend, bases, planes, [3, 0, 1], [1, 2], gen)


def test_pieces_many_blocks_one_launch(backend: CopyBackend) -> None:
    """Device ops per call do not grow with blocks on the kernel path; they do on the memcpy path."""
    gen = torch.Generator().manual_seed(9)
    _bases, planes = make_layout("plain", layers=2, blocks=40, block_size=4, heads=1, head_size=8, dtype=torch.float16, gen=gen)
    counts = []
    for n_blocks in (2, 20, 40):
        pieces, _, _, total = pieces_case(planes, list(range(4 * n_blocks)), [4] * n_blocks)
        before = backend.ops_issued
        backend.gather_pieces(planes, pieces, torch.zeros(total, dtype=torch.uint8))
        counts.append(backend.ops_issued - before)
    if backend.name == "triton":
        assert counts == [1, 1, 1]  # CPU: no table upload, one launch
    if backend.name == "memcpy":
        assert counts == [2 * 4, 20 * 4, 40 * 4]  # one copy per (block, plane)
    if backend.name == "torch":
        # one span table for every plane; headers between values break the constant step, so one op per value
        # or per plane, whichever is fewer: never more than the planes (4), however many blocks
        assert counts == [2, 4, 4]


def test_pieces_split_planes_one_launch(backend: CopyBackend) -> None:
    """Split K/V (planes of different row sizes and dtypes) keeps the kernel path at one launch per call."""
    gen = torch.Generator().manual_seed(29)
    _, planes = split_layout("plain", layers=3, blocks=12, block_size=2, split=SPLITS[1], gen=gen)
    counts = []
    for n_blocks in (1, 10):
        pieces, _, _, total = pieces_case(planes, list(range(2 * n_blocks)), [2] * n_blocks)
        before = backend.ops_issued
        backend.gather_pieces(planes, pieces, torch.zeros(total, dtype=torch.uint8))
        counts.append(backend.ops_issued - before)
    if backend.name == "triton":
        assert counts == [1, 1]
    if backend.name == "torch":
        assert counts == [6, 6]  # planes of different row sizes: one op per plane
    if backend.name == "memcpy":
        assert counts == [1 * 6, 10 * 6]  # one copy per (block, plane)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_per_plane_path(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch backend's per-plane path (used off CPU, or when planes are too far apart for one span view)."""
    import ems.kernels.torch_backend as tbk
    import ems.kernels.torch_layout as tlayout

    monkeypatch.setattr(tlayout, "_MAX_SPAN", 0)
    gen = torch.Generator().manual_seed(17)
    bases, planes = make_layout(layout, layers=2, blocks=4, block_size=4, heads=3, head_size=5, dtype=torch.bfloat16, gen=gen)
    backend = tbk.TorchBackend()
    _check(backend, bases, planes, [3, 4, 5, 15, 0, 0, 9], [3, 4], gen, scatter=False)
    _check(backend, bases, planes, [1, 2, 14, 7, 8, 9, 10, 11], [4, 4], gen)


@settings(max_examples=12, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 3, 4, 16]), head_size=st.integers(1, 9), layout=st.sampled_from(LAYOUTS))
def test_property_pieces_every_backend(data: st.DataObject, block_size: int, head_size: int, layout: str) -> None:
    """Any slot list (repeats, any order) cut into any values gathers like the reference on every backend; any
    distinct slots scatter exactly."""
    from ems.kernels.memcpy_backend import MemcpyBackend
    from ems.kernels.select import triton_importable
    from ems.kernels.torch_backend import TorchBackend

    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    bases, planes = make_layout(
        layout, layers=1, blocks=5, block_size=block_size, heads=2, head_size=head_size, dtype=torch.float16, gen=gen
    )
    n = planes.num_slots
    slots = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=12))
    distinct = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=12, unique=True))
    cut = data.draw(st.integers(0, len(distinct)))
    backends: list[CopyBackend] = [TorchBackend(), MemcpyBackend()]
    if triton_importable():
        from ems.kernels.triton_backend import TritonBackend

        backends.append(TritonBackend(torch.device("cpu")))
    for backend in backends:
        _check(backend, bases, planes, slots, [len(slots)], gen, scatter=False)
        _check(backend, bases, planes, distinct, [c for c in (cut, len(distinct) - cut) if c], gen)


def test_pieces_rejects_out_of_range(backend: CopyBackend) -> None:
    gen = torch.Generator().manual_seed(3)
    _, planes = make_layout("plain", 1, 2, 4, 1, 8, torch.float16, gen)
    good = torch.tensor([[0], [4], [0], [4], [0]], dtype=torch.int64)
    out = torch.zeros(4 * planes.token_bytes, dtype=torch.uint8)
    backend.gather_pieces(planes, good, out)
    for bad in ([[6], [4], [0], [4], [0]], [[0], [4], [8], [4], [0]], [[8], [1], [0], [1], [0]], [[0], [4], [0], [2], [0]]):
        with pytest.raises(ValueError):
            backend.gather_pieces(planes, torch.tensor(bad, dtype=torch.int64), out)


def test_pieces_numpy_staging_refused_where_it_cannot_serve(backend: CopyBackend) -> None:
    """numpy staging must be contiguous (and is for CPU planes only): refused by name, nothing written."""
    gen = torch.Generator().manual_seed(3)
    bases, planes = make_layout("plain", 1, 2, 4, 1, 8, torch.float16, gen)
    good = torch.tensor([[0], [4], [0], [4], [0]], dtype=torch.int64)
    strided = np.zeros(8 * planes.token_bytes, dtype=np.uint8)[::2]
    before = [as_bytes(b).clone() for b in bases]
    with pytest.raises(ValueError, match="contiguous"):
        backend.gather_pieces(planes, good, strided)
    with pytest.raises(ValueError, match="contiguous"):
        backend.scatter_pieces(planes, good, strided)
    assert all(torch.equal(as_bytes(b), a) for b, a in zip(bases, before))
    assert not strided.any()


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


@pytest.mark.parametrize("split", [None, SPLITS[1]])
def test_cross_layer_blocks_move_one_run_per_block(backend: CopyBackend, split) -> None:
    """Cross-layer blocks (each block's planes one run of the cache): whole-block values move as ONE piece per block
    of `PlaneSet.block_runs` (one span in the kernel, one copy on the memcpy path), byte for byte what the planes'
    pieces move; both directions, blocks in any order, values with gaps between them."""
    gen = torch.Generator().manual_seed(31)
    bs, blocks, layers = 4, 8, 3
    if split is None:
        bases, planes = make_layout("block_major", layers, blocks, bs, 2, 8, torch.bfloat16, gen)
    else:  # MLA split K/V of different row sizes and dtypes, packed per block across layers
        (kh, kd), kdt, (vh, vd), vdt = split
        kbytes, vbytes = bs * kh * kd * kdt.itemsize, bs * vh * vd * vdt.itemsize
        raw = torch.randint(1, 256, (blocks, layers, kbytes + vbytes), dtype=torch.int32, generator=gen).to(torch.uint8)
        bases = [raw]
        planes = PlaneSet(
            tuple(
                p
                for layer in range(layers)
                for p in (
                    raw[:, layer, :kbytes].view(kdt).view(blocks, bs, kh, kd),
                    raw[:, layer, kbytes:].view(vdt).view(blocks, bs, vh, vd),
                )
            )
        )
    runs = planes.block_runs
    assert runs is not None and runs.num_planes == 1 and runs.block_size == 1
    assert runs.plane_row_bytes == (bs * planes.token_bytes,) == (planes.block_run_bytes,)
    order = torch.randperm(blocks, generator=gen).tolist()[:5]
    slots = [b * bs + j for b in order for j in range(bs)]
    pieces, _tok, _base, total = pieces_case(planes, slots, [bs] * len(order))
    table = block_run_pieces(pieces.numpy(), bs)
    assert table is not None and table.shape == (5, len(order))
    assert table[0].tolist() == order
    want = torch.full((total,), 0xA5, dtype=torch.uint8)
    backend.gather_pieces(planes, pieces, want)
    got = torch.full((total,), 0xA5, dtype=torch.uint8)
    before = backend.ops_issued
    backend.gather_pieces(runs, torch.from_numpy(table), got)
    if backend.name == "memcpy":
        assert backend.ops_issued - before == len(order)  # one copy per block (the planes' pieces: one per plane)
    if backend.name == "triton":
        assert backend.ops_issued - before == 1
    assert torch.equal(got, want)
    # scatter the block runs from fresh bytes: exactly the planes' scatter of the same bytes
    src = torch.randint(0, 256, (total,), dtype=torch.int32, generator=gen).to(torch.uint8)
    twin = bases[0].clone()
    backend.scatter_pieces(runs, torch.from_numpy(table), src)
    after_runs = bases[0].clone()
    bases[0].copy_(twin)
    backend.scatter_pieces(planes, pieces, src)
    assert torch.equal(as_bytes(after_runs), as_bytes(bases[0]))
    assert not torch.equal(as_bytes(after_runs), as_bytes(twin))
    # a partial value, or a value through two blocks, is no whole block: no block-run table
    partial, *_ = pieces_case(planes, slots[: 2 * bs - 1], [bs, bs - 1])
    assert block_run_pieces(partial.numpy(), bs) is None
    shifted, *_ = pieces_case(planes, slots[1 : bs + 1], [bs])
    assert block_run_pieces(shifted.numpy(), bs) is None


@pytest.mark.parametrize("kind", ["plain", "kv_interleaved", "padded_block", "padded_slot"])
def test_other_layouts_are_not_cross_layer(kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    _, planes = make_layout(kind, 2, 4, 4, 2, 8, torch.float16, gen)
    assert planes.block_runs is None


def test_block_runs_need_plane_order_and_one_allocation() -> None:
    """K of every layer, then V of every layer, in a block ([blocks, 2, layers, ...]): each block is one run, but
    not in the planes' order (the value's): no block runs. One layer's K/V interleaved per block is one."""
    t = torch.zeros(4, 2, 3, 4, 2, 8, dtype=torch.float16)
    assert PlaneSet(tuple(t[:, kv, layer] for layer in range(3) for kv in range(2))).block_runs is None
    assert PlaneSet(tuple(t[:, kv, layer] for kv in range(2) for layer in range(3))).block_runs is not None
    u = torch.zeros(4, 2, 4, 2, 8, dtype=torch.float16)
    assert PlaneSet((u[:, 0], u[:, 1])).block_runs is not None
    assert PlaneSet((u[:, 0],)).block_runs is None  # one plane: its rows already move as one span

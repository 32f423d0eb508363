"""The alignment the host claims to the kernels (`move_shape`: the move width and `VEC`) is always true and as wide
as the data allows, and each claim's kernel variant moves the right bytes (in the Triton interpreter): a wrong
claim would be a misaligned vector access on a device."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import check_pieces_roundtrip, make_layout

from ems.kernels.select import triton_importable


@settings(max_examples=300, deadline=None)
@given(
    addresses=st.lists(st.integers(1, 2**47), min_size=1, max_size=6),
    quantities=st.lists(st.integers(0, 2**31), max_size=6),
)
def test_move_shape_is_true_and_widest(addresses: list[int], quantities: list[int]) -> None:
    from ems.kernels.triton_backend import MAX_ALIGN, MOVE_SHAPES, move_shape

    move = move_shape(tuple(addresses), tuple(quantities))
    assert move in MOVE_SHAPES
    step = move.width * move.vec
    values = addresses + quantities
    assert all(v % step == 0 for v in values)  # true
    assert step == MAX_ALIGN or any(v % (2 * step) for v in values)  # and the widest (up to 128 bits)
    assert move.width == min(step, 4)


@pytest.mark.skipif(not triton_importable(), reason="triton is not installed")
@pytest.mark.parametrize(
    "head_size,dtype,lead,want",
    [
        (8, torch.float16, 64, (4, 4)),  # 16-byte rows, values on 64-byte boundaries: 128-bit accesses
        (8, torch.float16, 40, (4, 2)),  # values after 40-byte headers: 8-byte aligned, 64-bit
        (2, torch.float16, 64, (4, 1)),  # 4-byte rows
        (3, torch.float16, 64, (2, 1)),  # 6-byte rows
        (3, torch.int8, 64, (1, 1)),  # 3-byte rows
    ],
)
def test_each_alignment_runs_its_variant(
    head_size: int, dtype: torch.dtype, lead: int, want: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ems.kernels.triton_backend as tb

    used: list[tuple[int, int]] = []
    original = tb.pieces_constexprs

    def recording(elems: int, move: Any, row_units: int, block_size: int, gather: bool) -> dict[str, Any]:
        used.append((move.width, move.vec))
        return original(elems, move, row_units, block_size, gather)

    monkeypatch.setattr(tb, "pieces_constexprs", recording)
    gen = torch.Generator().manual_seed(head_size * 100 + lead)
    backend = tb.TritonBackend(torch.device("cpu"))
    for kind in ("plain", "block_major"):
        bases, planes = make_layout(kind, 2, 5, 4, 1, head_size, dtype, gen)
        check_pieces_roundtrip(backend, bases, planes, list(range(4, 16)), [4, 4, 4], gen, align=64, gap=lead % 64)
    assert set(used) == {want}, used

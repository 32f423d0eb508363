"""What triton-ascend makes of the kernels for a 910B, without an NPU: every variant a launch can compile is lowered
TTIR -> linalg by triton-adapter-opt (tests/kernels/aot_compile.py) and the lowered function's structure asserted:

* block copies for the tiles: each tile path is ONE `memref.copy` of a strided subview with unit inner stride into
  a unified-buffer tile and ONE `bufferization.materialize_in_destination` out of it (the mask as a subview: a
  DMA, not a per-element gather);
* no per-element payload accesses: every scalar `memref.load` reads one int64 table entry, no `memref.store`;
* the unified buffer: the tiles are exactly the shapes `triton_backend` derives (`tile_elems("npu", width)`,
  `tile_shape`), the pieces kernel allocates `UB_TILE_BUFFERS` of them, and double-buffered (`UB_STAGES`) they fill
  more than half of `UB_BYTES` (192 KiB on a 910B) and fit within it, for every dtype.

The last stage (linalg -> NPU binary, `bishengir-compile`) needs the CANN toolkit; without it the compile stops
there, which this test accepts; any earlier failure fails. Runs in a subprocess without TRITON_INTERPRET; skipped
unless triton-ascend is the installed `triton`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import re
from typing import Any

import aot_compile
import pytest


def _triton_ascend() -> bool:
    try:
        importlib.metadata.version("triton-ascend")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


pytestmark = pytest.mark.skipif(not _triton_ascend(), reason="triton-ascend is not installed")

TABLE_ENTRY = "memref<1xi64, strided<[1], offset: ?>>"


@functools.cache
def _reports() -> list[dict[str, Any]]:
    try:
        return aot_compile.reports("ascend")
    except RuntimeError as err:
        pytest.fail(str(err))


def _name(r: dict[str, Any]) -> str:
    way = "gather" if r["constexprs"]["GATHER"] else "scatter"
    return f"{r['kernel']} {way} i{8 * r['width']} VEC={r['vec']} {r['constexprs']}"


def _tiles(r: dict[str, Any]) -> list[list[int]]:
    c = r["constexprs"]
    return [[c["SPAN"]], [c["ROWS"], c["COLS"]]] if r["kernel"] == "pieces" else [[c["TILE"]]]


def _unit_inner_stride(memref: str, rank: int) -> bool:
    """A rank-`rank` memref whose innermost stride is 1 (rows of contiguous elements: a DMA's shape)."""
    shape = re.match(r"memref<([?0-9x]*)x[if]\d+", memref)
    strides = re.search(r"strided<\[([^\]]*)\]", memref)
    if shape is None or len(shape.group(1).split("x")) != rank:
        return False
    return strides is None or strides.group(1).split(",")[-1].strip() == "1"


def test_every_variant_lowers() -> None:
    from ems.kernels.triton_backend import MOVE_SHAPES

    seen = {(r["kernel"], r["width"], r["vec"], r["constexprs"]["GATHER"]) for r in _reports()}
    assert {(k, m.width, m.vec, g) for k in ("pieces", "segments") for m in MOVE_SHAPES for g in (True, False)} <= seen


def test_tiles_move_as_block_copies() -> None:
    for r in _reports():
        payload = f"i{8 * r['width']}"
        tiles = _tiles(r)
        copies = [(src, dst) for src, dst in r["copies"] if f"x{payload}" in src]
        outs = [(t, dst) for t, dst in r["materialize"] if f"x{payload}" in t]
        assert len(copies) == len(tiles), f"{_name(r)}: {len(copies)} tile copies in, expected {len(tiles)}: {r['copies']}"
        assert len(outs) == len(tiles), f"{_name(r)}: {len(outs)} tile copies out, expected {len(tiles)}: {r['materialize']}"
        for (src, dst), (_, out), tile in zip(copies, outs, tiles):
            for memref in (src, dst, out):
                assert _unit_inner_stride(memref, len(tile)), f"{_name(r)}: {memref} is not a block of rows"


def test_no_per_element_payload_access() -> None:
    for r in _reports():
        assert r["load_types"] == [TABLE_ENTRY], f"{_name(r)}: scalar loads of {r['load_types']}"
        assert r["store_types"] == [], f"{_name(r)}: scalar stores to {r['store_types']}"


def test_unified_buffer_footprint_per_tile_configuration() -> None:
    from ems.kernels.triton_backend import UB_BYTES, UB_STAGES, UB_TILE_BUFFERS, tile_elems

    for width in (1, 2, 4):  # the budget per dtype: the most the tiles can take, double-buffered, fits and fills it
        bound = UB_STAGES * UB_TILE_BUFFERS * tile_elems("npu", width) * width
        assert UB_BYTES // 2 < bound <= UB_BYTES, f"i{8 * width}: tiles of {bound} bytes for {UB_BYTES}"
    for r in _reports():
        payload = f"i{8 * r['width']}"
        allocs = r["allocs"]
        assert all(a["dtype"] == payload for a in allocs), f"{_name(r)}: {allocs}"
        assert sorted(a["shape"] for a in allocs) == sorted(_tiles(r)), f"{_name(r)}: buffers {allocs}"
        if r["kernel"] == "pieces":
            assert len(allocs) == UB_TILE_BUFFERS, f"{_name(r)}: {len(allocs)} buffers"
        sizes = [math.prod(a["shape"]) for a in allocs]
        assert max(sizes) == tile_elems("npu", r["width"]), f"{_name(r)}: buffers {allocs} are not the budget's tile"
        footprint = UB_STAGES * sum(sizes) * r["width"]
        assert footprint <= UB_BYTES, f"{_name(r)}: {footprint} bytes of unified buffer, more than {UB_BYTES}"

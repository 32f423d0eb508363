"""What upstream Triton makes of the kernels for real GPU targets (sm_90 and sm_80), without a GPU: it ships ptxas
and cuobjdump, so every variant a launch can compile is compiled ahead of time (tests/kernels/aot_compile.py) and
its PTX and cubin are read:

* aligned paths (every address and quantity a multiple of 16 bytes, or 8): every payload load and store is one
  128-bit (64-bit) vector access, `ld/st.global.v4.b32` (`.v2.b32`); scalar 64-bit loads are the int64 tables;
* unaligned paths: accesses of the move width, nothing wider claimed;
* every variant: no stack frame (so no spills) and no local memory in the cubin, and registers within what lets
  `CUDA_PROGRAMS_PER_SM` programs of the compiled warps share one SM's 64 K registers.

Runs in a subprocess without TRITON_INTERPRET (this folder's conftest sets it for the interpreter tests); skipped
where upstream Triton's NVIDIA backend is absent (e.g. under triton-ascend).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import aot_compile
import pytest

SM_REGISTERS = 65536  # 32-bit registers per SM on sm_80 and sm_90
WARP = 32


def _nvidia_backend() -> bool:
    try:
        return importlib.util.find_spec("triton.backends.nvidia") is not None
    except ModuleNotFoundError:
        return False


pytestmark = pytest.mark.skipif(not _nvidia_backend(), reason="upstream Triton's NVIDIA backend is not installed")


@functools.cache
def _reports() -> list[dict[str, Any]]:
    try:
        return aot_compile.reports("cuda")
    except RuntimeError as err:
        pytest.fail(str(err))


def _name(r: dict[str, Any]) -> str:
    c = r["constexprs"]
    tile = f"{c['ROWS']}x{c['COLS']}/{c['SPAN']}" if r["kernel"] == "pieces" else str(c["TILE"])
    way = "gather" if c["GATHER"] else "scatter"
    return f"sm_{r['arch']} {r['kernel']} {way} i{8 * r['width']} VEC={r['vec']} tile {tile}"


def _payload(accesses: dict[str, int]) -> dict[str, int]:
    """The payload accesses: everything but the scalar 64-bit loads of the int64 plan tables (payload moves as
    int8/16/32, singly or in vectors, never as a 64-bit scalar)."""
    return {kind: n for kind, n in accesses.items() if kind != "ld.b64"}


def test_every_variant_compiles_for_both_targets() -> None:
    from ems.kernels.triton_backend import MOVE_SHAPES

    reports = _reports()
    seen = {(r["arch"], r["kernel"], r["width"], r["vec"], r["constexprs"]["GATHER"]) for r in reports}
    want = {
        (a, k, m.width, m.vec, g) for a in (90, 80) for k in ("pieces", "segments") for m in MOVE_SHAPES for g in (True, False)
    }
    assert want <= seen


def test_aligned_paths_move_payload_in_vectors() -> None:
    """16-byte aligned: 128-bit accesses only; 8-byte aligned: 64-bit; else the move width (fails on a kernel
    without the alignment hints: every access there is a 32-bit scalar)."""
    checked = 0
    for r in _reports():
        payload = _payload(r["accesses"])
        if r["vec"] > 1:
            vector = f"v{r['vec']}.b{8 * r['width']}"
            want = {f"ld.{vector}", f"st.{vector}"}
        else:
            want = {f"ld.b{8 * r['width']}", f"st.b{8 * r['width']}"}
        assert set(payload) == want, f"{_name(r)}: payload accesses {payload}, expected only {sorted(want)}"
        if r["vec"] * r["width"] == 16:
            checked += 1
    assert checked >= 8  # the 128-bit paths: two targets, two kernels, gather and scatter


def test_no_spills_no_local_memory_registers_for_the_grid() -> None:
    from ems.kernels.triton_backend import CUDA_PROGRAMS_PER_SM

    for r in _reports():
        res = r["resources"]
        assert res["STACK"] == 0, f"{_name(r)}: {res['STACK']} bytes of stack frame (spills)"
        assert res["LOCAL"] == 0, f"{_name(r)}: {res['LOCAL']} bytes of local memory"
        most = SM_REGISTERS // (CUDA_PROGRAMS_PER_SM * WARP * r["num_warps"])
        assert res["REG"] <= most, f"{_name(r)}: {res['REG']} registers per thread, at most {most} fit the grid"

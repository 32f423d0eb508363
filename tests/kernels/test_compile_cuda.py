"""The kernels compile for a real GPU target (sm_90) without a GPU: upstream Triton ships ptxas.

Runs in a subprocess without TRITON_INTERPRET (this folder's conftest sets it for the interpreter tests), and is
skipped where upstream Triton's NVIDIA backend is absent (e.g. under triton-ascend).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

CODE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ems.kernels.triton_backend import _build

k = _build()
assert not k["interpreted"]
for gather in (True, False):
    for width in ("i8", "i16", "i32"):
        sig = {"cache_ptr": "*" + width, "stage_ptr": "*" + width, "plane_table_ptr": "*i64", "pieces_ptr": "*i64",
               "n_pieces": "i32", "n_planes": "i32", "block_size": "i32", "GATHER": "constexpr", "ROWS": "constexpr",
               "COLS": "constexpr", "SPAN": "constexpr"}
        triton.compile(ASTSource(fn=k["pieces"], signature=sig,
                                 constexprs={"GATHER": gather, "ROWS": 16, "COLS": 256, "SPAN": 4096}),
                       target=GPUTarget("cuda", 90, 32))
    sig = {"stage_ptr": "*i32", "chunks_ptr": "*i64", "n_chunks": "i32", "GATHER": "constexpr", "TILE": "constexpr"}
    triton.compile(ASTSource(fn=k["segments"], signature=sig, constexprs={"GATHER": gather, "TILE": 4096}),
                   target=GPUTarget("cuda", 90, 32))
print("COMPILED")
"""


def _nvidia_backend() -> bool:
    try:
        return importlib.util.find_spec("triton.backends.nvidia") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _nvidia_backend(), reason="upstream Triton's NVIDIA backend is not installed")
def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300)
    assert "COMPILED" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]

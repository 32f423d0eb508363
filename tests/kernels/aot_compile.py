"""Compile every variant of the Triton kernels ahead of time, without a device, and report what the compilers made
of them (JSON, into OUT): `python tests/kernels/aot_compile.py cuda|ascend OUT`.

The variants are the ones a launch can compile (`triton_backend.MOVE_SHAPES`, `tile_elems`, `pieces_constexprs`,
`segments_constexprs`: the backend's own functions, so a test checks what runs), each gather and scatter, for the
rows in `ROWS` (engine shapes). Pointer arguments are marked 16-byte aligned, as a launch marks the buffers it is
given (Triton specialises every pointer whose address is a multiple of 16).

* cuda (upstream Triton, ships ptxas and cuobjdump): per target (sm_90, sm_80), the global loads and stores of the
  PTX by width, and the cubin's registers, stack and local memory (`cuobjdump --dump-resource-usage`).
* ascend (triton-ascend, TTIR -> linalg through triton-adapter-opt; the CANN-only last stage fails here, and is
  accepted): the lowered function's structure, read from the `.ttadapter` file the compile leaves in its cache
  directory: `memref.alloc` shapes (unified-buffer tiles), `memref.copy` / `materialize_in_destination` (block
  moves), `memref.load` / `memref.store` element types (scalar accesses).

Run in a process of its own without TRITON_INTERPRET (the kernel tests' conftest sets it for the interpreter).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

# (widest plane's row bytes, block size) per case: GQA 8 x 128 fp16, MLA latent 576 bf16, a row wider than a tile
ROWS = ((2048, 16), (1152, 16), (65536, 16))
CUDA_ARCHS = (90, 80)
POINTERS = {"pieces": ("cache_ptr", "stage_ptr", "plane_table_ptr", "pieces_ptr"), "segments": ("stage_ptr", "chunks_ptr")}


def variants(device_type: str) -> list[dict[str, Any]]:
    """Every (kernel, move shape, direction, tile) a launch on `device_type` can compile, for the rows in ROWS."""
    from ems.kernels.triton_backend import MOVE_SHAPES, pieces_constexprs, segments_constexprs, tile_elems

    out: list[dict[str, Any]] = []
    for move in MOVE_SHAPES:
        elems = tile_elems(device_type, move.width)
        for gather in (True, False):
            seen: set[tuple[Any, ...]] = set()
            for row_bytes, block_size in ROWS:
                constexprs = pieces_constexprs(elems, move, row_bytes // move.width, block_size, gather)
                key = tuple(sorted(constexprs.items()))
                if key not in seen:
                    seen.add(key)
                    out.append({"kernel": "pieces", "width": move.width, "vec": move.vec, "constexprs": constexprs})
            out.append(
                {
                    "kernel": "segments",
                    "width": move.width,
                    "vec": move.vec,
                    "constexprs": segments_constexprs(elems, move, gather),
                }
            )
    return out


def signature(kernel: str, width: int, constexprs: dict[str, Any]) -> dict[str, str]:
    elem = f"*i{8 * width}"
    if kernel == "pieces":
        sig = {"cache_ptr": elem, "stage_ptr": elem, "plane_table_ptr": "*i64", "pieces_ptr": "*i64"}
        sig.update({"n_pieces": "i32", "n_planes": "i32", "block_size": "i32"})
    else:
        sig = {"stage_ptr": elem, "chunks_ptr": "*i64", "n_chunks": "i32"}
    sig.update({name: "constexpr" for name in constexprs})
    return sig


def _access_widths(ptx: str) -> dict[str, int]:
    """Global loads and stores of a PTX module by kind and width, e.g. {"ld.v4.b32": 16, "ld.b64": 15}."""
    found: collections.Counter[str] = collections.Counter()
    for op, quals in re.findall(r"\b(ld|st)\.global((?:\.[A-Za-z0-9_:]+)*)", ptx):
        kept = [q for q in quals.split(".") if re.fullmatch(r"v\d|[bsuf]\d+", q)]
        found[".".join([op, *kept])] += 1
    return dict(found)


def _cuda_one(job: tuple[int, dict[str, Any]]) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ems.kernels.triton_backend import _build

    arch, v = job
    fn = _build()[v["kernel"]]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in POINTERS[v["kernel"]]}
    src = ASTSource(fn=fn, signature=signature(v["kernel"], v["width"], v["constexprs"]), constexprs=v["constexprs"], attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin.name], capture_output=True, text=True, check=True
        ).stdout
    return {
        **v,
        "arch": arch,
        "num_warps": compiled.metadata.num_warps,
        "accesses": _access_widths(compiled.asm["ptx"]),
        "resources": {k: int(n) for k, n in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)},
    }


def cuda() -> list[dict[str, Any]]:
    from ems.kernels.triton_backend import _build

    if _build()["interpreted"]:
        raise SystemExit("TRITON_INTERPRET is set: this compiles for devices")
    jobs = [(arch, v) for arch in CUDA_ARCHS for v in variants("cuda")]
    # independent compiles (ptxas is a process of its own): one worker per core
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count() or 1, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_cuda_one, jobs))


_MEMREF = r"memref<(?:[^<>]|<[^<>]*>)*>"  # a memref type, its layout attribute's brackets included


def _linalg_facts(text: str) -> dict[str, Any]:
    """What a test asserts of a lowered (linalg) kernel."""
    body = re.sub(r"\bloc\((?:[^()]|\([^()]*\))*\)", "", text)  # debug locations
    allocs = [
        {"shape": [int(d) for d in shape.split("x")], "dtype": dtype}
        for shape, dtype in re.findall(r"memref\.alloc\(\)[^:\n]*:\s*memref<([0-9x]+)x(i\d+|f\d+)>", body)
    ]
    loads = re.findall(rf"memref\.load [^\n]*?:\s*({_MEMREF})", body)
    stores = re.findall(rf"memref\.store [^\n]*?:\s*({_MEMREF})", body)
    copies = re.findall(rf"memref\.copy [^\n]*?:\s*({_MEMREF})\s*to\s*({_MEMREF})", body)
    stores_out = re.findall(rf"bufferization\.materialize_in_destination [^\n]*?:\s*\((tensor<[^>]*>),\s*({_MEMREF})\)", body)
    return {
        "allocs": allocs,
        "load_types": sorted(set(loads)),
        "store_types": sorted(set(stores)),
        "copies": [list(c) for c in copies],
        "materialize": [list(m) for m in stores_out],
    }


def ascend() -> list[dict[str, Any]]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ems.kernels.triton_backend import _build

    built = _build()
    if built["interpreted"]:
        raise SystemExit("TRITON_INTERPRET is set: this compiles for devices")
    reports = []
    for v in variants("npu"):
        fn = built[v["kernel"]]
        with tempfile.TemporaryDirectory() as cache:
            os.environ["TRITON_CACHE_DIR"] = cache  # a fresh cache: the lowering runs, and its output is found
            src = ASTSource(fn=fn, signature=signature(v["kernel"], v["width"], v["constexprs"]), constants=v["constexprs"])
            try:
                triton.compile(src, target=GPUTarget("npu", "Ascend910B2", 0))
                last_stage = "compiled"
            except Exception as err:  # only the CANN-only last stage may fail here
                text = str(err)
                if "ConvertLinalgRToBinary" not in text and "ASCEND_HOME_PATH" not in text:
                    raise
                last_stage = "linalg (bishengir-compile needs CANN)"
            lowered = [os.path.join(d, f) for d, _, files in os.walk(cache) for f in files if f.endswith(".ttadapter")]
            if len(lowered) != 1:
                raise SystemExit(f"expected one .ttadapter file for {v}, found {lowered}")
            with open(lowered[0]) as f:
                facts = _linalg_facts(f.read())
        reports.append({**v, "last_stage": last_stage, **facts})
    return reports


def reports(kind: str) -> list[dict[str, Any]]:
    """`kind` ("cuda" or "ascend")'s reports, compiled by this script in a process of its own (without
    TRITON_INTERPRET); RuntimeError with its output if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{kind}.json")
        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), kind, out], env=env, capture_output=True, text=True, timeout=900
        )
        if done.returncode != 0:
            raise RuntimeError(f"ahead-of-time compile ({kind}) failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
        with open(out) as f:
            found: list[dict[str, Any]] = json.load(f)
    return found


if __name__ == "__main__":
    # a file, not stdout: triton-ascend prints to stdout while it compiles
    with open(sys.argv[2], "w") as out:
        json.dump({"cuda": cuda, "ascend": ascend}[sys.argv[1]](), out)

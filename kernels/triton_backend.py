"""Triton gather/scatter kernels: one source for triton-ascend (`npu`), upstream Triton (`cuda`) and the Triton
interpreter (`TRITON_INTERPRET=1`, CPU tensors, for tests).

Contract: `TritonBackend(device)` implements `CopyBackend` (see base.py) with one kernel launch per call (plus one
host→device copy of the plan table on a real device), whatever the number of blocks, tokens or planes.

Design (Ascend first):
* **Pieces.** The host (numpy, vectorised: `ems.datapath.planning.value_pieces`) cuts a plan's slots into pieces: runs of
  consecutive slots inside one cache block and one stored value. A piece names its value's part in value-major
  staging (base, the value's token count, its index there); plane p's rows of the piece sit back to back there.
  Where `slot_stride == row_elems` the piece of a plane is ONE span on both sides and the kernel tiles it along
  its length (`SPAN` = ROWS * COLS elements per tile: the same unified-buffer budget, one int64 base plus int32
  offsets); otherwise `count` rows at a constant stride, copied as 2-D tiles `[ROWS, COLS]` from one scalar int64
  base plus small int32 `tl.arange` offsets. Whole-block values cost one tile loop per (block, plane), not one per
  token; scattered slots degrade to one piece per token. One launch per call (one per layer group).
* **All planes in one launch, through a plane table.** Each plane is addressed as `base + plane_off[p]` where `base`
  is the plane with the lowest address and `plane_off` (int64, in moved units, >= 0) comes from a small table next to
  the per-plane block and slot strides, row length and token offset (`plane_offsets`): planes of one group may differ
  in row size and dtype (MLA with split K/V: K = the 512-wide latent, V = the 64-wide rope part, possibly of another
  dtype) and still cost ONE launch; the column loop runs to each plane's own row length and the tile width COLS
  covers the widest row. Measured (on the former token-major kernel, same plane table) against the alternative, one
  launch per plane (same kernel, a one-plane table each), in the 3.7.1 interpreter counting builder ops, 8 layers (P
  = 16), 512 tokens of 4×128 fp16: whole blocks 62 k ops in 1 launch vs 75 k ops in 16 launches; scattered slots 1.00
  M vs 1.19 M ops (per-plane launches reload the piece table P times). On devices the difference is launch overhead:
  per-plane costs P = 2 × layers launches (80 for a 40-layer model: ~80 × 5 µs on a GPU, ~80 × 20-40 µs on an NPU)
  against one; with the table a save costs 2 device ops (table upload + launch) whatever its planes, blocks and
  tokens. Cross-allocation pointer arithmetic is plain 64-bit address arithmetic on GPUs and NPUs (global memory is
  one flat address space); offsets are kept >= 0 by basing on the lowest plane.
* **Grid** = number of vector cores (npu, queried lazily from the triton-ascend driver), 4 programs per SM (cuda:
  a program moves one tile at a time, so one per SM would leave the memory system idle), 4 in the interpreter;
  capped at 65535 and at the number of pieces. Each program loops over pieces `pid, pid + grid, ...`.
* **Bytes move as signed ints** of the widest width in (4, 2, 1) that divides the row bytes, every stride and
  every address involved: int32/int16/int8 (no unsigned types, no fp64: triton-ascend's load/store on A2/A3 lacks
  them, and integer moves are bit-exact for every dtype, fp8 included).
* **Vector accesses where the data allows** (`move_shape`): the host finds the largest power of two up to 16 bytes
  dividing every address, stride, row length, token offset and part base of the call; it moves int32 where that
  is >= 4 and passes `VEC` = alignment / 4 (a `tl.constexpr`: at most three aligned specialisations per kernel and
  width), and the kernel marks its scalar bases `tl.multiple_of(VEC)`. With 16-byte alignment (what engines' caches
  and this package's staging have) sm_90 and sm_80 PTX then moves payload with 128-bit `ld/st.global.v4.b32` and
  nothing else; unaligned rows keep a `VEC = 1` specialisation (no claim). Checked without a GPU:
  tests/kernels/test_compile_cuda.py.
* **Tiles** come from one place, `tile_elems(device, width)`: on an NPU from the unified buffer (`UB_BYTES`, 192
  KiB on a 910B, per vector core): the lowered kernel allocates `UB_TILE_BUFFERS` = 2 tile buffers (the span tile
  and the 2-D tile), double-buffered, so a tile holds `UB_BYTES / 4` rounded down to a power of two = 32 KiB of
  any dtype (8192 int32, 16384 int16, 32768 int8 elements); on a GPU, where a tile lives in registers, 4096
  int32 or int16 and 2048 int8 elements (at most 128 registers per thread, so the 4 programs per SM fit at once;
  no spills); in the interpreter 16384 elements (it pays per op, not per byte).
  `tile_shape` cuts that into `[ROWS, COLS]` for strided rows. Only tile sizes, `VEC` and the gather/scatter
  direction are `tl.constexpr`; lengths, counts, strides are runtime values and no integer argument is
  specialised, so a new request never recompiles.
* **Raw segments** (V0): one launch for all segments; the table holds each segment's offset from the staging
  buffer's address (int64, may be negative), its length and its staging position, segments cut into chunks of
  at most `SEG_CHUNK` units so that programs share the work evenly.
* **Lazy build.** Kernels are defined on first use, never at import: the interpreter is chosen by Triton when a
  kernel is *defined*, so `TRITON_INTERPRET=1` must be set before the first kernel use in the process.
* **Checked without devices** (tests/kernels/test_compile_*.py): upstream Triton compiles every variant to sm_90
  and sm_80 cubins offline (PTX access widths, registers, no spills, no local memory); triton-ascend 3.2 lowers
  every variant through triton-adapter-opt (TTIR -> linalg), where each tile is one structured (strided)
  `memref.copy` into a unified-buffer tile and one `materialize_in_destination` out of it (the mask as a subview:
  a DMA, not a scalar gather), scalar `memref.load`s only of the int64 tables, and the tiles' buffers within the
  unified buffer. Only the CANN-only last stage (bishengir-compile) is unverified here.
* **Fallback.** If a kernel fails to compile or launch on a device, the backend logs ONE warning and serves that
  call and every later one with the torch path; inputs are validated before any launch, so a fallback never
  follows a partial write.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ems.kernels.base import CopyBackend, PieceTable, check_pieces
from ems.kernels.plan import split_segments
from ems.kernels.planes import PlaneSet
from ems.kernels.torch_backend import TorchBackend

log = logging.getLogger("ems.kernels")

UB_BYTES = 192 << 10  # unified buffer per vector core of a 910B
UB_TILE_BUFFERS = 2  # tile buffers the lowered pieces kernel allocates (span tile, 2-D tile): test_compile_ascend
UB_STAGES = 2  # triton-ascend double-buffers by default
# a GPU tile lives in registers, one per element moved singly (an int8 costs one as an int32 does), four per 128-bit
# access. Per move width, the most elements over 4 warps that stay within 128 registers per thread without spills at
# sm_90 and sm_80 (test_compile_cuda): 8192 int32 spill, and so do 4096 int8
CUDA_TILE_ELEMS = {4: 4096, 2: 4096, 1: 2048}
INTERPRETER_TILE_ELEMS = 16384  # the interpreter pays per op, not per byte: bigger tiles, fewer ops
MAX_ALIGN = 16  # bytes: the widest access (128 bits) the kernels ask for
SEG_CHUNK = 1 << 20  # segment chunk, in moved units
MAX_GRID = 65535
CUDA_PROGRAMS_PER_SM = 4  # a program moves one tile at a time: one per SM would leave the memory system idle
_INT32_MAX = 2**31 - 1
_DTYPE_OF_WIDTH = {4: torch.int32, 2: torch.int16, 1: torch.int8}


def interpreter_active() -> bool:
    """True when Triton would build kernels for its interpreter (TRITON_INTERPRET set to a true value)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def _build() -> dict[str, Any]:
    """Define the kernels (first use only). Returns {"pieces": jit fn, "segments": jit fn, "interpreted": bool}."""
    from ems.kernels import _triton_kernels as k

    return {"pieces": k.pieces_kernel, "segments": k.segments_kernel, "interpreted": interpreter_active()}


def kernels_interpreted() -> bool | None:
    """None before the kernels are built, else whether they were built for the interpreter."""
    return _build()["interpreted"] if _build.cache_info().currsize else None


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.cache
def _program_count(device: torch.device) -> int:
    """Programs per launch: vector cores (npu), 4 × SMs (cuda), 4 (interpreter); at most MAX_GRID."""
    if device.type == "npu":
        count = 0
        try:
            import triton

            count = int(triton.runtime.driver.active.utils.get_device_properties(device.index or 0)["num_vectorcore"])
        except Exception:
            try:
                props = torch.npu.get_device_properties(device)  # type: ignore[attr-defined]
                count = int(getattr(props, "vector_core_num", 0) or 2 * getattr(props, "cube_core_num", 0))
            except Exception:
                count = 0
        count = count or 48  # a 910B2 has 48 vector cores
    elif device.type == "cuda":
        count = CUDA_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        count = 4
    return max(1, min(count, MAX_GRID))


def _floor_pow2(n: int) -> int:
    return 1 << (int(n).bit_length() - 1)


def tile_elems(device_type: str, width: int) -> int:
    """Elements of `width` bytes per tile: THE place tile sizes come from (see the module docstring)."""
    if device_type == "npu":
        return _floor_pow2(UB_BYTES // (UB_TILE_BUFFERS * UB_STAGES)) // width
    if device_type == "cpu":
        return INTERPRETER_TILE_ELEMS
    return CUDA_TILE_ELEMS[width]


def tile_shape(elems: int, row_units: int, block_size: int) -> tuple[int, int]:
    """(ROWS, COLS) of a 2-D tile of at most `elems` elements for rows of `row_units` in blocks of `block_size`:
    COLS covers the row (powers of two), ROWS the rest, no more rows than a block has."""
    cols = min(_next_pow2(row_units), elems)
    rows = max(1, min(elems // cols, _next_pow2(block_size)))
    return rows, cols


@dataclass(frozen=True)
class MoveShape:
    """How a launch moves bytes: as signed ints of `width` bytes, `vec` of them per access at most (every address
    and quantity involved is a multiple of `width * vec` bytes)."""

    width: int
    vec: int

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPE_OF_WIDTH[self.width]


# every MoveShape `move_shape` can return: at most five specialisations of each kernel and direction
MOVE_SHAPES = (MoveShape(4, 4), MoveShape(4, 2), MoveShape(4, 1), MoveShape(2, 1), MoveShape(1, 1))


def move_shape(addresses: tuple[int, ...], byte_quantities: tuple[int, ...]) -> MoveShape:
    """The widest signed int (4, 2 or 1 bytes) and vector (up to `MAX_ALIGN` bytes) that every address and byte
    quantity is a multiple of."""
    align = MAX_ALIGN
    for q in addresses + byte_quantities:
        q = int(q)
        if q:
            align = min(align, q & -q)  # the largest power of two dividing q
    width = min(align, 4)
    return MoveShape(width, align // width)


def pieces_constexprs(elems: int, move: MoveShape, row_units: int, block_size: int, gather: bool) -> dict[str, Any]:
    """The `tl.constexpr` arguments of a `pieces_kernel` launch (tiles of `elems` elements; the widest plane's row
    is `row_units` elements of `move.width` bytes): what decides which compiled variant runs."""
    rows, cols = tile_shape(elems, row_units, block_size)
    return {"GATHER": gather, "ROWS": rows, "COLS": cols, "SPAN": elems, "VEC": move.vec}


def segments_constexprs(elems: int, move: MoveShape, gather: bool) -> dict[str, Any]:
    """The `tl.constexpr` arguments of a `segments_kernel` launch."""
    return {"GATHER": gather, "TILE": elems, "VEC": move.vec}


@dataclass(frozen=True)
class _PlaneInfo:
    """What a launch needs about one PlaneSet. Only `table` is cached (per addresses and strides): caching the
    base view would keep a freed KV cache alive."""

    base: torch.Tensor  # intW view of the lowest-addressed plane
    table: torch.Tensor  # int64 [5, P] on the device
    move: MoveShape
    max_row_units: int  # the widest plane's row
    max_slot_stride: int


class TritonBackend(CopyBackend):
    """Triton kernels on one device type (npu, cuda, or cpu through the interpreter)."""

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.ops_issued = 0
        self._fallback: TorchBackend | None = None
        self._table_cache: dict[tuple[Any, ...], torch.Tensor] = {}
        if self.device.type == "cpu":
            built = kernels_interpreted()
            if built is False or (built is None and not interpreter_active()):
                raise RuntimeError(
                    "the Triton backend on CPU tensors runs the Triton interpreter, which needs TRITON_INTERPRET=1 "
                    "in the environment before the first Triton kernel of the process is built "
                    + ("(kernels were already built without it)" if built is False else "(it is not set)")
                    + "; use the torch backend on CPU instead"
                )
        self.interpreted = self.device.type == "cpu"
        #: elements per tile instead of `tile_elems(device, width)` (tests: tiny tiles cross many tile edges)
        self.tile_override: int | None = None

    def describe(self) -> str:
        if self._fallback is not None:
            return "triton (fell back to torch)"
        return "triton-interpreter" if self.interpreted else f"triton ({self.device.type})"

    # ---------------------------------------------------------------- helpers
    def _check_device(self, t: torch.Tensor) -> None:
        if t.device.type != self.device.type:
            raise ValueError(f"tensor on {t.device}, backend serves {self.device.type}")

    def _planes(self, planes: PlaneSet, stage: torch.Tensor, extra: tuple[int, ...] = ()) -> _PlaneInfo:
        """`extra`: further byte quantities the move shape must divide (value-major part bases)."""
        ptrs = tuple(int(p.data_ptr()) for p in planes.planes)
        bstr, sstr = planes.block_stride_bytes, planes.slot_stride_bytes
        rbytes, soffs = planes.plane_row_bytes, planes.plane_offsets
        move = move_shape(ptrs + (int(stage.data_ptr()),), rbytes + soffs + bstr + sstr + extra)
        width = move.width
        for p in planes.planes:
            if (p.shape[3] > 1 and p.stride(3) != 1) or (p.shape[2] > 1 and p.stride(2) != p.shape[3]):
                raise ValueError("each token row (heads * head_size) must be contiguous")
        low = int(np.argmin(ptrs))
        plane = planes.planes[low]
        base = plane.as_strided(
            (planes.num_blocks, planes.block_size, planes.plane_row_elems[low]), (plane.stride(0), plane.stride(1), 1)
        ).view(move.dtype)
        key = (planes.device, ptrs, bstr, sstr, rbytes, width)
        table = self._table_cache.get(key)
        if table is None:
            host = torch.tensor(
                [
                    [(a - ptrs[low]) // width for a in ptrs],
                    [b // width for b in bstr],
                    [s // width for s in sstr],
                    [r // width for r in rbytes],
                    [o // width for o in soffs],
                ],
                dtype=torch.int64,
            )
            table = host.to(self.device)
            if self.device.type != "cpu":
                self.ops_issued += 1
            if len(self._table_cache) > 64:  # registrations are few; never grow without bound
                self._table_cache.clear()
            self._table_cache[key] = table
        return _PlaneInfo(base, table, move, max(rbytes) // width, max(sstr) // width)

    def _tile_elems(self, width: int) -> int:
        return self.tile_override or tile_elems(self.device.type, width)

    def _upload(self, table: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(table, dtype=np.int64))
        if self.device.type != "cpu":
            self.ops_issued += 1
            return t.to(self.device)  # small: a few int64 per piece; pinning per call would cost more
        return t

    def _torch(self) -> TorchBackend:
        if self._fallback is None:
            self._fallback = TorchBackend()
        return self._fallback

    def _fail(self, err: BaseException) -> TorchBackend:
        log.warning(
            "Triton kernels failed to build or launch on %s (%s: %s); using the torch copy path from now on",
            self.device,
            type(err).__name__,
            err,
        )
        return self._torch()

    # ---------------------------------------------------------------- pieces (value-major staging)
    def _pieces(self, planes: PlaneSet, pieces: PieceTable, stage: torch.Tensor, gather: bool) -> None:
        what = "out" if gather else "src"
        self._check_device(stage)
        self._check_device(planes.planes[0])
        table, flat = check_pieces(planes, pieces, stage, what)
        if self._fallback is not None:
            fb = self._fallback
            (fb.gather_pieces if gather else fb.scatter_pieces)(planes, pieces, stage)
            return
        if table.shape[1] == 0:
            return
        info = self._planes(planes, stage, (int(np.gcd.reduce(table[2])),))
        width = info.move.width
        r = info.max_row_units
        elems = self._tile_elems(width)
        constexprs = pieces_constexprs(elems, info.move, r, planes.block_size, gather)
        if planes.block_size * max(r, info.max_slot_stride) + elems > _INT32_MAX:
            raise ValueError("a piece's offsets would overflow int32; rows this large are not supported")
        units = table.copy()
        units[2] //= width
        uploaded = self._upload(units)
        grid = (min(_program_count(self.device), int(units.shape[1])),)
        try:
            _build()["pieces"][grid](
                info.base,
                flat[: flat.numel() // width * width].view(info.move.dtype),
                info.table,
                uploaded,
                int(units.shape[1]),
                planes.num_planes,
                planes.block_size,
                **constexprs,
            )
        except Exception as err:
            fb = self._fail(err)
            (fb.gather_pieces if gather else fb.scatter_pieces)(planes, pieces, stage)
            return
        self.ops_issued += 1

    # ---------------------------------------------------------------- segments
    def gather_segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> None:
        self._segments(ptrs, lengths, out, gather=True)

    def scatter_segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor) -> None:
        self._segments(ptrs, lengths, src, gather=False)

    def _segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, stage: torch.Tensor, gather: bool) -> None:
        self._check_device(stage)
        p = ptrs.detach().to("cpu", torch.int64).numpy().reshape(-1)
        n = lengths.detach().to("cpu", torch.int64).numpy().reshape(-1)
        if p.shape != n.shape:
            raise ValueError(f"ptrs {p.shape} and lengths {n.shape} differ in shape")
        if stage.dtype != torch.uint8 or stage.dim() != 1 or not stage.is_contiguous():
            raise ValueError("the segment staging buffer must be a contiguous 1-D uint8 tensor")
        if p.size and (int(p.min()) <= 0 or int(n.min()) <= 0):
            raise ValueError("every segment needs a positive address and a positive length")
        if int(n.sum()) != stage.numel():
            raise ValueError(f"segments hold {int(n.sum())} bytes, staging buffer {stage.numel()}")
        if self._fallback is not None:
            fb = self._fallback
            (fb.gather_segments if gather else fb.scatter_segments)(ptrs, lengths, stage)
            return
        if p.size == 0:
            return
        stage_addr = int(stage.data_ptr())
        move = move_shape(tuple(int(a) for a in p) + (stage_addr,), tuple(int(x) for x in n))
        width = move.width
        src, length, dst = split_segments((p - stage_addr) // width, n // width, SEG_CHUNK)
        chunks = self._upload(np.stack([src, length, dst]))
        grid = (min(_program_count(self.device), int(src.size)),)
        try:
            _build()["segments"][grid](
                stage.view(move.dtype),
                chunks,
                int(src.size),
                **segments_constexprs(self._tile_elems(width), move, gather),
            )
        except Exception as err:
            fb = self._fail(err)
            (fb.gather_segments if gather else fb.scatter_segments)(ptrs, lengths, stage)
            return
        self.ops_issued += 1

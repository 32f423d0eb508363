"""The Triton kernel source (see triton_backend.py for the design and the launch contract).

Imported only on first use, by `triton_backend._build()`: Triton decides at definition time whether a kernel runs
in its interpreter (`TRITON_INTERPRET=1`), and importing triton at `import ems` would cost every user. Kept a
module of its own (not a closure) because Triton's compiler resolves `tl` and the annotations from the kernel's
module globals (triton-ascend 3.2 fails with "NameError: tl is not defined" otherwise).

Kernels (all offsets in moved units: elements of the signed int type the launch views the buffers as):
* `pieces_kernel` copies pieces (consecutive slots inside one block and one value) of every plane between the paged
  cache and value-major staging (plane-major inside a value; planes may differ in row size and dtype: MLA split
  K/V): one span per (piece, plane) where the plane's rows are contiguous in a block, else 2-D tiles; one scalar
  int64 base per (piece, plane, tile), int32 tile offsets.
* `segments_kernel` copies raw address ranges, addressed relative to the staging buffer, into/out of it.

`VEC` (a power of two) is what the host proved about alignment: every base, stride, row length and offset the
kernel computes is a multiple of `VEC` units and both buffers start 16-byte aligned (a launch passes them so), so
the compiler may move `VEC` units per access (128 bits on the aligned paths). `VEC = 1` claims nothing. The hints
are `tl.multiple_of` on the scalars everything else is derived from; they are facts the host checked
(`triton_backend.move_shape`), never guesses: a wrong one is a misaligned access on a device.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_chunks"])
def segments_kernel(
    stage_ptr,  # intW [total]: staging; segment sources are addressed relative to it
    chunks_ptr,  # int64 [3, C]: source offset from stage_ptr (units, may be negative), length, staging offset
    n_chunks,
    GATHER: tl.constexpr,
    TILE: tl.constexpr,
    VEC: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cc = tl.arange(0, TILE)
    for i in range(pid, n_chunks, nprog):
        raw = tl.load(chunks_ptr + i)
        length = tl.load(chunks_ptr + n_chunks + i).to(tl.int32)
        staged = tl.load(chunks_ptr + 2 * n_chunks + i)
        if VEC > 1:
            raw = tl.multiple_of(raw, VEC)
            length = tl.multiple_of(length, VEC)
            staged = tl.multiple_of(staged, VEC)
        for c0 in range(0, length, TILE):
            cols = c0 + cc
            mask = cols < length
            if GATHER:
                x = tl.load(stage_ptr + raw + cols, mask=mask)
                tl.store(stage_ptr + staged + cols, x, mask=mask)
            else:
                x = tl.load(stage_ptr + staged + cols, mask=mask)
                tl.store(stage_ptr + raw + cols, x, mask=mask)


# no integer argument is specialised: a value of 1 would become a constexpr (and break `.to`), and every new
# value class would be a new compile (seconds per save on Ascend)
@triton.jit(do_not_specialize=["n_pieces", "n_planes", "block_size"])
def pieces_kernel(
    cache_ptr,  # intW: the lowest-addressed plane; plane p starts plane_table[0, p] units after it
    stage_ptr,  # intW: value-major staging (plane-major inside a value's part)
    plane_table_ptr,  # int64 [5, P]: offset from cache_ptr, block stride, slot stride, row units, token offset
    pieces_ptr,  # int64 [5, N]: start slot, row count, part base (units), value tokens, index in value
    n_pieces,
    n_planes,
    block_size,
    GATHER: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    SPAN: tl.constexpr,  # a contiguous run's tile, in elements
    VEC: tl.constexpr,  # every offset below is a multiple of VEC units (1: no claim)
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rr = tl.arange(0, ROWS)
    cc = tl.arange(0, COLS)
    ss = tl.arange(0, SPAN)
    for i in range(pid, n_pieces, nprog):
        start = tl.load(pieces_ptr + i)
        count = tl.load(pieces_ptr + n_pieces + i).to(tl.int32)
        base = tl.load(pieces_ptr + 2 * n_pieces + i)
        tokens = tl.load(pieces_ptr + 3 * n_pieces + i)
        index = tl.load(pieces_ptr + 4 * n_pieces + i)
        blk = start // block_size
        off = start - blk * block_size
        for p in range(0, n_planes):
            plane_off = tl.load(plane_table_ptr + p)
            block_stride = tl.load(plane_table_ptr + n_planes + p)
            slot_stride = tl.load(plane_table_ptr + 2 * n_planes + p)
            row_units64 = tl.load(plane_table_ptr + 3 * n_planes + p)
            token_off = tl.load(plane_table_ptr + 4 * n_planes + p)
            row_units = row_units64.to(tl.int32)  # per plane: MLA split K/V
            if VEC > 1:
                base = tl.multiple_of(base, VEC)
                plane_off = tl.multiple_of(plane_off, VEC)
                block_stride = tl.multiple_of(block_stride, VEC)
                slot_stride = tl.multiple_of(slot_stride, VEC)
                row_units64 = tl.multiple_of(row_units64, VEC)
                row_units = tl.multiple_of(row_units, VEC)
                token_off = tl.multiple_of(token_off, VEC)
            cache_row = plane_off + blk * block_stride + off * slot_stride
            # plane-major inside the value: this plane's rows of the value are one run, this piece a slice of it
            stage_row = base + tokens * token_off + index * row_units64
            if slot_stride == row_units64:
                # rows contiguous in the cache too: the piece is ONE span on both sides, tiled along its length
                span = count * row_units  # host checked block_size * row units < 2**31
                for c0 in range(0, span, SPAN):
                    at = c0 + ss
                    mask = at < span
                    if GATHER:
                        x = tl.load(cache_ptr + cache_row + at, mask=mask)
                        tl.store(stage_ptr + stage_row + at, x, mask=mask)
                    else:
                        x = tl.load(stage_ptr + stage_row + at, mask=mask)
                        tl.store(cache_ptr + cache_row + at, x, mask=mask)
            else:
                slot_stride32 = slot_stride.to(tl.int32)  # host checked ROWS * slot_stride < 2**31
                if VEC > 1:
                    slot_stride32 = tl.multiple_of(slot_stride32, VEC)
                for r0 in range(0, count, ROWS):
                    row_ok = (r0 + rr) < count
                    for c0 in range(0, row_units, COLS):
                        cols = c0 + cc
                        mask = row_ok[:, None] & (cols < row_units)[None, :]
                        cache_off = rr[:, None] * slot_stride32 + cols[None, :]
                        stage_off = rr[:, None] * row_units + cols[None, :]
                        if GATHER:
                            x = tl.load(cache_ptr + cache_row + cache_off, mask=mask)
                            tl.store(stage_ptr + stage_row + stage_off, x, mask=mask)
                        else:
                            x = tl.load(stage_ptr + stage_row + stage_off, mask=mask)
                            tl.store(cache_ptr + cache_row + cache_off, x, mask=mask)
                    cache_row += ROWS * slot_stride
                    stage_row += ROWS * row_units64

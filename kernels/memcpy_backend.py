"""The memcpy path: what an engine without gather kernels does — one copy per (block-or-run piece, plane).

Contract: `MemcpyBackend` implements `CopyBackend` (base.py) on any device torch can copy on. Each (piece, plane)
is ONE copy (counted as one when the plane's rows are contiguous inside a block, `slot_stride == row_elems`, else
as one per token). Raw segments cost one copy each.
`ops_issued` counts the copies, so a save's device operations grow with blocks × planes: the cost the kernels
remove. Bytes move as uint8 views, so planes of different row sizes and dtypes (MLA split K/V) need nothing else.
It is a comparison baseline and a last-resort fallback, not a fast path.
"""

from __future__ import annotations

import torch

from ems.kernels.base import CopyBackend, PieceTable, check_pieces
from ems.kernels.host_copy import raw_tensor
from ems.kernels.planes import PlaneSet
from ems.kernels.torch_backend import plane_rows


class MemcpyBackend(CopyBackend):
    name = "memcpy"

    def __init__(self) -> None:
        self.ops_issued = 0

    def _pieces(self, planes: PlaneSet, pieces: PieceTable, stage: torch.Tensor, gather: bool) -> None:
        table, flat = check_pieces(planes, pieces, stage, "out" if gather else "src")
        views = [plane_rows(planes, p).view(torch.uint8) for p in range(planes.num_planes)]  # [blocks, bs, row_bytes]
        contiguous = [s == r for s, r in zip(planes.slot_strides, planes.plane_row_elems)]
        bs = planes.block_size
        # one Python iteration per (piece, plane) — deliberately: this path models per-block copies
        for start, count, base, tokens, index in table.T.tolist():
            blk, off = divmod(start, bs)
            for p, rows in enumerate(views):
                row = planes.plane_row_bytes[p]
                at = base + tokens * planes.plane_offsets[p] + index * row
                staged = flat[at : at + count * row].view(count, row)
                cache = rows[blk, off : off + count]
                if gather:
                    staged.copy_(cache)
                else:
                    cache.copy_(staged)
                self.ops_issued += 1 if contiguous[p] else count

    def gather_segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> None:
        self._segments(ptrs, lengths, out, gather=True)

    def scatter_segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor) -> None:
        self._segments(ptrs, lengths, src, gather=False)

    def _segments(self, ptrs: torch.Tensor, lengths: torch.Tensor, stage: torch.Tensor, gather: bool) -> None:
        if int(lengths.sum()) != stage.numel() or stage.dtype != torch.uint8:
            raise ValueError("the staging buffer must be uint8 with exactly sum(lengths) bytes")
        position = 0
        for ptr, length in zip(ptrs.tolist(), lengths.tolist()):
            if ptr <= 0 or length <= 0:
                raise ValueError(f"bad segment (ptr={ptr}, length={length})")
            raw = raw_tensor(ptr, length, stage.device)
            if gather:
                stage[position : position + length].copy_(raw)
            else:
                raw.copy_(stage[position : position + length])
            position += length
            self.ops_issued += 1

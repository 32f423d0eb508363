"""Gather/scatter of raw address ranges (V0 KvBufferWrapper) on every backend."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import POISON

from ems.kernels.base import CopyBackend


def _buffers(gen: torch.Generator, sizes: list[int]) -> list[torch.Tensor]:
    return [torch.randint(1, 256, (n,), dtype=torch.int32, generator=gen).to(torch.uint8) for n in sizes]


@pytest.mark.parametrize("aligned", [True, False])
def test_segments_roundtrip(backend: CopyBackend, aligned: bool) -> None:
    gen = torch.Generator().manual_seed(21 + aligned)
    bufs = _buffers(gen, [4096, 300, 1000])
    # (buffer, offset, length): aligned -> everything divisible by 4 (moved as int32); else odd bytes
    picks = (
        [(0, 64, 1024), (1, 0, 300), (2, 100, 800), (0, 2048, 4)]
        if aligned
        else [(0, 3, 1001), (1, 7, 5), (2, 1, 999), (0, 2000, 1)]
    )
    ptrs = torch.tensor([bufs[b].data_ptr() + o for b, o, _ in picks], dtype=torch.int64)
    lengths = torch.tensor([n for _, _, n in picks], dtype=torch.int64)
    expected = torch.cat([bufs[b][o : o + n] for b, o, n in picks])
    out = torch.full((int(lengths.sum()),), POISON, dtype=torch.uint8)
    backend.gather_segments(ptrs, lengths, out)
    assert torch.equal(out, expected)

    # scatter new bytes to the same ranges; nothing outside them changes
    src = torch.randint(1, 256, (int(lengths.sum()),), dtype=torch.int32, generator=gen).to(torch.uint8)
    want = [b.clone() for b in bufs]
    position = 0
    for b, o, n in picks:
        want[b][o : o + n] = src[position : position + n]
        position += n
    backend.scatter_segments(ptrs, lengths, src)
    for got, w in zip(bufs, want):
        assert torch.equal(got, w)


def test_long_segment_is_chunked(backend: CopyBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A segment longer than one chunk is split across programs without losing or repeating bytes."""
    import ems.kernels.triton_backend as tb

    monkeypatch.setattr(tb, "SEG_CHUNK", 1000)
    gen = torch.Generator().manual_seed(4)
    (buf,) = _buffers(gen, [40000])
    ptrs = torch.tensor([buf.data_ptr() + 2, buf.data_ptr() + 30000], dtype=torch.int64)
    lengths = torch.tensor([25002, 9998], dtype=torch.int64)
    out = torch.full((35000,), POISON, dtype=torch.uint8)
    backend.gather_segments(ptrs, lengths, out)
    assert torch.equal(out, torch.cat([buf[2:25004], buf[30000:39998]]))

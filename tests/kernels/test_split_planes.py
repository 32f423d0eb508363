"""Planes of one layer group with different row sizes and dtypes (MLA with split K/V: K = the latent, V = the rope
part), on every backend (Triton interpreter, torch, memcpy), value-major pieces against an independent per-token
reference (kernel_cases.py).

Interpreter cases are small (the interpreter is ~1000x slower than torch); the Triton path must stay ONE launch per
call (checked by `check_pieces_roundtrip`).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import SPLITS, check_pieces_roundtrip, split_layout

from ems.kernels.base import CopyBackend
from ems.kernels.planes import PlaneSet


def test_planes_report_their_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    _, planes = split_layout("plain", 2, 3, 4, SPLITS[1], gen)
    assert not planes.uniform
    assert planes.plane_row_bytes == (48, 16, 48, 16)
    assert planes.plane_offsets == (0, 48, 64, 112) and planes.token_bytes == 128
    with pytest.raises(ValueError, match="per plane"):
        _ = planes.row_elems
    with pytest.raises(ValueError, match="block_size"):
        PlaneSet((torch.zeros(3, 4, 1, 8), torch.zeros(3, 2, 1, 8)))


@pytest.mark.parametrize("split", SPLITS, ids=["bf16", "fp16-fp32", "int8-fp16", "fp8-bf16"])
@pytest.mark.parametrize("kind", ["plain", "block_packed"])
def test_split_kv_pieces(backend: CopyBackend, kind: str, split) -> None:
    gen = torch.Generator().manual_seed(len(kind) * 31 + SPLITS.index(split))
    bases, planes = split_layout(kind, layers=2, blocks=5, block_size=4, split=split, gen=gen)
    # whole blocks, a partial block, repeats and gaps (gather only); distinct slots, values cutting blocks (scatter)
    check_pieces_roundtrip(backend, bases, planes, [4, 5, 6, 7, 12, 13, 19, 0, 0, 9], [6, 4], gen, scatter=False)
    check_pieces_roundtrip(backend, bases, planes, [8, 9, 10, 11, 3, 17, 18], [3, 4], gen)


def test_split_kv_torch_per_plane_path() -> None:
    """Planes of different row sizes take the torch backend's per-plane path: one op per plane."""
    import ems.kernels.torch_backend as tbk

    gen = torch.Generator().manual_seed(31)
    for split in SPLITS:
        bases, planes = split_layout("block_packed", layers=2, blocks=4, block_size=4, split=split, gen=gen)
        backend = tbk.TorchBackend()
        pieces_before = backend.ops_issued
        check_pieces_roundtrip(backend, bases, planes, [4, 5, 6, 7, 8, 9, 10, 11], [8], gen, scatter=False)
        # one gather of 2 whole-block pieces (one length): one op per plane; then one per piece, one per plane;
        # the same again into numpy staging
        assert backend.ops_issued - pieces_before == 2 * planes.num_planes * (1 + 2)


def test_deepseek_sizes(backend: CopyBackend) -> None:
    """The real shapes once: K = [blocks, bs, 1, 512] bf16 latent, V = [blocks, bs, 1, 64] bf16 rope."""
    gen = torch.Generator().manual_seed(37)
    split = ((1, 512), torch.bfloat16, (1, 64), torch.bfloat16)
    bases, planes = split_layout("plain", layers=1, blocks=3, block_size=2, split=split, gen=gen)
    assert planes.plane_row_bytes == (1024, 128)
    check_pieces_roundtrip(backend, bases, planes, [2, 3, 5, 0], [2, 2], gen)

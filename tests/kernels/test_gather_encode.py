"""`gather_pieces_encoded` (the host backend's save gather and encode in one pass): its refusals, which come before
anything is written; what it writes is checked against the torch path's gather plus `encode_in_place` through a
request's plan (tests/datapath/test_jobs.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_cases import make_layout, pieces_case

from ems.kernels.base import Fusion
from ems.kernels.host_backend import HostBackend
from ems.kernels.host_copy import host_copy
from ems.kernels.memcpy_backend import MemcpyBackend
from ems.kernels.torch_backend import TorchBackend
from ems.store.value_format import PAYLOAD_HASH_ADDRESS

HEADER = 40


def test_refuses_ranges_outside_the_staging_and_writes_nothing() -> None:
    library = host_copy()
    if library is None or PAYLOAD_HASH_ADDRESS is None:
        pytest.fail("the compiled host copy or xxhash's exported XXH3 is missing (both are on every CI machine)")
    backend = HostBackend(library)
    gen = torch.Generator().manual_seed(3)
    _bases, planes = make_layout("plain", 2, 6, 16, 2, 32, torch.float16, gen)
    counts = [4, 8, 16]
    slots = [b * 16 + k for b, n in zip((5, 0, 3), counts) for k in range(n)]
    pieces, _tok_start, part_base, total = pieces_case(planes, slots, counts)
    shift = 64  # room for the first value's header before its payload
    out = torch.full((total + shift,), 0xA5, dtype=torch.uint8)
    values = np.stack([part_base.astype(np.int64) + shift - HEADER, np.asarray(counts, np.int64) * planes.token_bytes])
    pieces = pieces.clone()
    pieces[2] += shift
    heads = np.zeros((3, 32), dtype=np.uint8)
    piece_end = np.full(3, pieces.shape[1], dtype=np.int64)
    bad_values = values.copy()
    bad_values[1, 2] = total  # the last value runs past the end
    bad_heads = np.zeros((2, 32), dtype=np.uint8)
    for args, match in (
        ((bad_values, heads, piece_end), "value ranges"),
        ((values, heads, piece_end - 1), "piece_end"),
        ((values, heads, np.array([2, 1, pieces.shape[1]], dtype=np.int64)), "piece_end"),
        ((values, bad_heads, piece_end), "heads"),
    ):
        with pytest.raises(ValueError, match=match):
            backend.gather_pieces_encoded(planes, pieces, out, *args, PAYLOAD_HASH_ADDRESS)
        assert bool((out == 0xA5).all())
    backend.gather_pieces_encoded(planes, pieces, out, values, heads, piece_end, PAYLOAD_HASH_ADDRESS)
    assert not bool((out == 0xA5).all())  # the same call, well formed, writes


def test_other_backends_do_not_claim_it() -> None:
    for backend in (TorchBackend(), MemcpyBackend()):
        assert backend.fusion is Fusion.SEPARATE
        with pytest.raises(NotImplementedError):
            backend.gather_pieces_encoded(None, None, None, None, None, None, 0)  # type: ignore[arg-type]

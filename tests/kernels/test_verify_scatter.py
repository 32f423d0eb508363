"""`scatter_pieces_verified` (the host backend's load verify and scatter in one pass): the count of values that
match, from the first, and the rows of exactly those values written; nothing of the first mismatch or after it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import as_bytes, make_layout, pieces_case, random_tensor, reference_pieces

from ems.datapath.planning import value_pieces
from ems.kernels.base import CopyBackend, Fusion
from ems.kernels.host_backend import HostBackend
from ems.kernels.host_copy import host_copy
from ems.kernels.torch_backend import TorchBackend
from ems.store.value_format import PAYLOAD_HASH_ADDRESS


def _host() -> HostBackend:
    library = host_copy()
    if library is None or PAYLOAD_HASH_ADDRESS is None:
        pytest.fail("the compiled host copy or xxhash's exported XXH3 is missing (both are on every CI machine)")
    return HostBackend(library)


def _case(kind: str, blocks: int, counts: list[int], seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    bs = 16
    _bases, planes = make_layout(kind, 2, blocks, bs, 2, 32, torch.float16, gen)
    order = torch.randperm(blocks, generator=gen).tolist()
    slots: list[int] = []
    for i, n in enumerate(counts):
        first = np.random.default_rng(seed + i).integers(0, bs - n + 1)
        slots += [order[i] * bs + int(first) + k for k in range(n)]
    pieces, tok_start, part_base, total = pieces_case(planes, slots, counts)
    src = random_tensor([total], torch.uint8, gen)
    lengths = np.asarray(counts, dtype=np.int64) * planes.token_bytes
    payloads = np.stack([part_base.astype(np.int64), lengths])
    digests = np.array(
        [xxhash.xxh3_64_intdigest(src[int(b) : int(b) + int(n)].numpy().tobytes()) for b, n in zip(part_base, lengths)],
        dtype=np.uint64,
    )
    return planes, slots, pieces, tok_start, part_base, total, src, payloads, digests


def _written_rows(planes, slots, tok_start, part_base, total, values: int) -> tuple[list[int], torch.Tensor]:  # type: ignore[no-untyped-def]
    """The slots of the first `values` values and the staging mask of their rows."""
    _, mask = reference_pieces(planes, slots[: int(tok_start[values])], tok_start[: values + 1], part_base[:values], total)
    return slots[: int(tok_start[values])], mask


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["plain", "kv_interleaved", "padded_block", "padded_slot"]),
    counts=st.lists(st.integers(1, 16), min_size=1, max_size=12),
    damage=st.integers(-1, 11),
    seed=st.integers(0, 2**16),
)
def test_writes_exactly_the_matching_prefix(kind: str, counts: list[int], damage: int, seed: int) -> None:
    blocks = len(counts) + 3
    planes, slots, pieces, tok_start, part_base, total, src, payloads, digests = _case(kind, blocks, counts, seed)
    bad = damage if 0 <= damage < len(counts) else len(counts)  # the first value whose digest is wrong
    if bad < len(counts):
        digests[bad] ^= np.uint64(1 << (seed % 64))
    before = [p.clone() for p in planes.planes]
    _, value_of_piece = value_pieces(np.asarray(slots, np.int64), planes.block_size, tok_start, part_base)
    piece_end = np.searchsorted(value_of_piece, np.arange(len(counts)), side="right").astype(np.int64)
    backend = _host()
    assert backend.scatter_pieces_verified(planes, pieces, src, payloads, digests, piece_end, PAYLOAD_HASH_ADDRESS) == bad
    # the reference: the first `bad` values scattered by the torch path into a copy of the cache as it was
    reference = [p.clone() for p in before]
    written_slots, _ = _written_rows(planes, slots, tok_start, part_base, total, bad)
    for plane, ref in zip(planes.planes, reference):
        bs = planes.block_size
        for s in written_slots:
            ref[s // bs, s % bs] = plane[s // bs, s % bs]
    for plane, ref in zip(planes.planes, reference):
        assert torch.equal(as_bytes(plane), as_bytes(ref)), "a row outside the verified prefix was written"
    if bad:  # and the verified prefix holds the staging's bytes
        torch_backend: CopyBackend = TorchBackend()
        again = torch.zeros(total, dtype=torch.uint8)
        torch_backend.gather_pieces(planes, pieces[:, : int(piece_end[bad - 1])], again)
        _, mask = _written_rows(planes, slots, tok_start, part_base, total, bad)
        assert torch.equal(again[mask], src[mask])


def test_refuses_ranges_outside_the_staging() -> None:
    planes, _slots, pieces, _t, _p, total, src, payloads, digests = _case("plain", 6, [4, 8, 16], 1)
    piece_end = np.full(3, pieces.shape[1], dtype=np.int64)
    backend = _host()
    bad = payloads.copy()
    bad[1, 2] = total  # the last payload runs past the end
    with pytest.raises(ValueError, match="payload ranges"):
        backend.scatter_pieces_verified(planes, pieces, src, bad, digests, piece_end, PAYLOAD_HASH_ADDRESS)
    with pytest.raises(ValueError, match="piece_end"):
        backend.scatter_pieces_verified(planes, pieces, src, payloads, digests, piece_end - 1, PAYLOAD_HASH_ADDRESS)
    with pytest.raises(ValueError, match="piece_end"):
        backend.scatter_pieces_verified(
            planes, pieces, src, payloads, digests, np.array([2, 1, pieces.shape[1]], dtype=np.int64), PAYLOAD_HASH_ADDRESS
        )


def test_other_backends_do_not_claim_it() -> None:
    assert TorchBackend().fusion is Fusion.SEPARATE
    with pytest.raises(NotImplementedError):
        TorchBackend().scatter_pieces_verified(None, None, None, None, None, None, 0)  # type: ignore[arg-type]

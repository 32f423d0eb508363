"""`scatter_pieces_as_placed` (a same-host load verifying and scattering each value as its node places it): values
are taken only once the progress word counts them, each checked (header and checksum) before any of its rows is
written; it stops at the first value that fails (nothing of it or after it written), and returns, interrupted,
when the channel's descriptor becomes readable or the deadline passes before the next value arrives."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import as_bytes, make_layout, random_tensor

from ems.datapath.planning import value_pieces
from ems.kernels.base import PlacedStop, Placement
from ems.kernels.host_backend import HostBackend
from ems.kernels.host_copy import host_copy
from ems.store.value_format import HEADER_SIZE, PAYLOAD_HASH_ADDRESS, ExpectedValues, ValueKind, build_headers, checksum

BS = 16


def _host() -> HostBackend:
    library = host_copy()
    if library is None or PAYLOAD_HASH_ADDRESS is None:
        pytest.fail("the compiled host copy or xxhash's exported XXH3 is missing (both are on every CI machine)")
    return HostBackend(library)


def _case(counts: list[int], seed: int):  # type: ignore[no-untyped-def]
    """A cache, and a staging of values (40-byte header, then the value's rows) for `counts` tokens each."""
    gen = torch.Generator().manual_seed(seed)
    _bases, planes = make_layout("plain", 2, len(counts) + 2, BS, 2, 32, torch.float16, gen)
    order = torch.randperm(len(counts) + 2, generator=gen).tolist()
    slots = [order[i] * BS + k for i, n in enumerate(counts) for k in range(n)]
    lengths = np.asarray(counts, dtype=np.int64) * planes.token_bytes
    value_start = np.concatenate([[0], np.cumsum(lengths + HEADER_SIZE)[:-1]]).astype(np.int64)
    tok_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    pieces_np, value_of_piece = value_pieces(np.asarray(slots, np.int64), BS, tok_start, value_start + HEADER_SIZE)
    staging = random_tensor([int(value_start[-1] + HEADER_SIZE + lengths[-1])], torch.uint8, gen)
    raw = staging.numpy()
    expected = ExpectedValues(ValueKind.BLOCKS_V1, 77, np.arange(len(counts), dtype=np.uint64) + 5, lengths)
    sums = [checksum([raw[s + HEADER_SIZE : s + HEADER_SIZE + n]]) for s, n in zip(value_start.tolist(), lengths.tolist())]
    for start, header in zip(value_start.tolist(), build_headers(expected, sums)):
        raw[start : start + HEADER_SIZE] = np.frombuffer(header, dtype=np.uint8)
    heads = np.stack([np.frombuffer(h[:32], dtype=np.uint8) for h in build_headers(expected, [0] * len(counts))])
    piece_end = np.searchsorted(value_of_piece, np.arange(len(counts)), side="right").astype(np.int64)
    return planes, slots, torch.from_numpy(pieces_np), staging, np.stack([value_start, lengths]), heads, piece_end


def _rows_written(planes, before, slots) -> set[int]:  # type: ignore[no-untyped-def]
    """The slots whose rows differ from `before` in any plane."""
    changed = set()
    for plane, old in zip(planes.planes, before):
        for s in range(plane.shape[0] * BS):
            if not torch.equal(as_bytes(plane[s // BS, s % BS]), as_bytes(old[s // BS, s % BS])):
                changed.add(s)
    return changed


def _advance(word: np.ndarray, upto: int, step_s: float) -> threading.Thread:
    def run() -> None:
        for i in range(1, upto + 1):
            time.sleep(step_s)
            word[0] = i

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _run(case, word: np.ndarray, fd: int, deadline_s: float):  # type: ignore[no-untyped-def]
    planes, _slots, pieces, staging, values, heads, piece_end = case
    placement = Placement(word.ctypes.data, fd, time.monotonic_ns() + int(deadline_s * 1e9))
    return _host().scatter_pieces_as_placed(planes, pieces, staging, values, heads, piece_end, PAYLOAD_HASH_ADDRESS, placement)


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(1, BS), min_size=1, max_size=6),
    damage=st.sampled_from(["none", "payload", "header"]),
    at=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_takes_values_as_they_are_counted_and_stops_at_the_first_bad_one(counts, damage, at, seed):
    case = _case(counts, seed)
    planes, slots, _pieces, staging, values, _heads, _piece_end = case
    bad = min(at, len(counts) - 1) if damage != "none" else len(counts)
    if damage == "payload":
        staging[int(values[0, bad]) + HEADER_SIZE + seed % int(values[1, bad])] ^= 1
    elif damage == "header":
        staging[int(values[0, bad]) + 16] ^= 1  # its tokens digest
    before = [p.clone() for p in planes.planes]
    word = np.zeros(1, dtype=np.uint32)
    left, right = socket.socketpair()
    try:
        feeder = _advance(word, len(counts), 0.002)
        done, why = _run(case, word, left.fileno(), 10.0)
        feeder.join()
    finally:
        left.close(), right.close()
    assert (done, why) == (bad, PlacedStop.ALL if damage == "none" else PlacedStop.DAMAGED)
    first_rows = slots[: sum(counts[:bad])]
    assert _rows_written(planes, before, slots) == set(first_rows)
    raw = staging.numpy()
    for i, n in enumerate(counts[:bad]):  # the written rows are the value's own (plane by plane, token by token)
        start = int(values[0, i]) + HEADER_SIZE
        row = planes.token_bytes // len(planes.planes)
        for p, plane in enumerate(planes.planes):
            for k, s in enumerate(slots[sum(counts[:i]) : sum(counts[: i + 1])]):
                got = as_bytes(plane[s // BS, s % BS]).numpy()
                assert np.array_equal(got, raw[start + p * n * row + k * row : start + p * n * row + (k + 1) * row])


def test_a_readable_channel_or_the_deadline_interrupts_the_wait():
    case = _case([4, 8, 16], 3)
    planes = case[0]
    before = [p.clone() for p in planes.planes]
    left, right = socket.socketpair()
    try:
        word = np.zeros(1, dtype=np.uint32)
        word[0] = 1  # the first value is placed, the others never
        start = time.monotonic()
        assert _run(case, word, left.fileno(), 0.2) == (1, PlacedStop.INTERRUPTED)
        assert 0.15 < time.monotonic() - start < 2.0  # the deadline, not sooner, not much later
        right.send(b"x")  # a reply: the wait for value 1 ends at once
        start = time.monotonic()
        assert _run(case, word, left.fileno(), 30.0) == (1, PlacedStop.INTERRUPTED)
        assert time.monotonic() - start < 1.0
    finally:
        left.close(), right.close()
    assert len(_rows_written(planes, before, case[1])) == 4  # value 0's rows only (written again, the same)


def test_refuses_ranges_outside_the_staging():
    planes, _slots, pieces, staging, values, heads, piece_end = _case([4, 8], 1)
    word = np.zeros(1, dtype=np.uint32)
    placement = Placement(word.ctypes.data, -1, time.monotonic_ns())
    bad = values.copy()
    bad[1, 1] += 1  # the last value runs past the end
    with pytest.raises(ValueError, match="value ranges"):
        _host().scatter_pieces_as_placed(planes, pieces, staging, bad, heads, piece_end, PAYLOAD_HASH_ADDRESS, placement)
    with pytest.raises(ValueError, match="heads"):
        _host().scatter_pieces_as_placed(planes, pieces, staging, values, heads[:1], piece_end, PAYLOAD_HASH_ADDRESS, placement)

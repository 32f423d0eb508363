"""Host-side (numpy, vectorised) planning shared by the Triton and memcpy backends.

A *piece* is a run of consecutive slots that stays inside one block: `(start_slot, count, first_token)`, with
`1 <= count <= block_size`. Rows of one piece of one plane sit at a constant stride (the plane's slot stride), so
a piece is one 2-D tile loop for a kernel and one strided copy for the memcpy path. A slot mapping of whole
blocks becomes one piece per block; scattered slots become one piece per token.

Nothing here loops over tokens in Python: every function is O(tokens) numpy.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch


def slots_to_pieces(slots: torch.Tensor, block_size: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split a slot list into pieces.

    slots: int64 `[T]` (CPU). Returns int64 arrays `starts [N]`, `counts [N]`, `first_tokens [N]` with
    `sum(counts) == T`; piece n covers tokens `first_tokens[n] .. + counts[n] - 1`, which map to slots
    `starts[n] .. + counts[n] - 1`, all inside block `starts[n] // block_size`.
    """
    s = slots.detach().to("cpu", torch.int64).numpy().reshape(-1)
    if s.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    # a piece starts at token 0, where the slot does not follow its predecessor, or at a block's first slot
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = (s[1:] != s[:-1] + 1) | (s[1:] % block_size == 0)
    first = np.flatnonzero(new).astype(np.int64)
    counts = np.diff(np.append(first, s.size)).astype(np.int64)
    return s[first].astype(np.int64), counts, first


def runs_to_slots(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Expand runs into their slots: int64 `[sum(lengths)]` (CPU, vectorised)."""
    st = starts.detach().to("cpu", torch.int64).numpy().reshape(-1)
    ln = lengths.detach().to("cpu", torch.int64).numpy().reshape(-1)
    if st.shape != ln.shape:
        raise ValueError(f"starts {st.shape} and lengths {ln.shape} differ in shape")
    if ln.size and int(ln.min()) < 1:
        raise ValueError("every run length must be >= 1")
    total = int(ln.sum())
    first_token = np.cumsum(ln) - ln
    run_of_token = np.repeat(np.arange(ln.size), ln)
    out = st[run_of_token] + (np.arange(total, dtype=np.int64) - first_token[run_of_token])
    return torch.from_numpy(out.astype(np.int64))


def check_slots(slots: torch.Tensor, num_slots: int) -> None:
    """Raise ValueError unless every slot is inside `[0, num_slots)` (a wrong slot is memory corruption)."""
    if slots.dtype != torch.int64 or slots.dim() != 1:
        raise ValueError(f"slots must be a 1-D int64 tensor, got {slots.dtype} {tuple(slots.shape)}")
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        raise ValueError(f"slot out of range [0, {num_slots}): min {int(slots.min())}, max {int(slots.max())}")


def split_segments(
    offsets: np.ndarray, lengths: np.ndarray, chunk: int
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut segments into chunks of at most `chunk` units, for load balance and int32-safe tile offsets.

    offsets, lengths: int64 `[S]` (source offsets, lengths >= 1). Returns int64 `(src [C], length [C], dst [C])`
    where dst is the chunk's position in the concatenation.
    """
    dst_first = np.cumsum(lengths) - lengths
    n_chunks = (lengths + chunk - 1) // chunk
    seg = np.repeat(np.arange(lengths.size), n_chunks)
    first_chunk = np.cumsum(n_chunks) - n_chunks
    k = np.arange(int(n_chunks.sum()), dtype=np.int64) - first_chunk[seg]
    pos = k * chunk
    length = np.minimum(lengths[seg] - pos, chunk)
    return offsets[seg] + pos, length.astype(np.int64), dst_first[seg] + pos


def value_pieces(slots: np.ndarray, block_size: int, tok_start: np.ndarray, part_base: np.ndarray
                 ) -> Tuple[np.ndarray, np.ndarray]:
    """The pieces of value-major staging (see base.py): runs of consecutive slots inside one cache block AND one value.

    slots: int64 `[T]`, the tokens of every value in order; tok_start: int64 `[n + 1]`, value i's tokens are
    `tok_start[i] .. tok_start[i + 1] - 1`; part_base: int64 `[n]`, where value i's part starts in staging (bytes).
    Returns (table int64 `[5, N]`: start slot, count, base, value tokens, index in value; value of each piece `[N]`).
    Whole-block values give one piece per (value, block); vectorised, no per-token Python.
    """
    s = np.asarray(slots, dtype=np.int64).reshape(-1)
    bounds = np.asarray(tok_start, dtype=np.int64)
    if s.size == 0:
        return np.zeros((5, 0), dtype=np.int64), np.zeros(0, dtype=np.int64)
    if bounds.size == 2:  # one value (a one-block call): one piece when its slots are one run inside a block
        first_slot, last_slot = int(s[0]), int(s[-1])
        if (last_slot - first_slot == s.size - 1 and first_slot // block_size == last_slot // block_size
                and (s.size < 3 or bool(np.all(np.diff(s) == 1)))):
            table = np.array([[first_slot], [s.size], [int(part_base[0])], [s.size], [0]], dtype=np.int64)
            return table, np.zeros(1, dtype=np.int64)
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = (s[1:] != s[:-1] + 1) | (s[1:] % block_size == 0)
    new[bounds[1:-1][bounds[1:-1] < s.size]] = True  # a value starts a piece (empty values start none)
    first = np.flatnonzero(new).astype(np.int64)
    counts = np.diff(np.append(first, s.size)).astype(np.int64)
    value = np.searchsorted(bounds, first, side="right").astype(np.int64) - 1
    value_tokens = np.diff(bounds)[value]
    table = np.stack([s[first], counts, np.asarray(part_base, dtype=np.int64)[value], value_tokens,
                      first - bounds[value]])
    return table, value

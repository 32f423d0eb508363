"""Host-side (numpy, vectorised) planning for the copy backends and the request planner.

* `value_pieces` cuts the tokens of a V1 plan into *pieces* (see base.py): runs of consecutive slots inside one
  cache block and one stored value, so that a piece of one plane is one span (rows contiguous in a block) or one
  strided tile loop; whole-block values give one piece per (value, block), scattered slots one piece per token.
* `block_run_pieces` rewrites a table of whole-block values for a PlaneSet's `block_runs` (cross-layer blocks: one
  run per block, one piece per value).
* `runs_to_slots` expands chunk_descs runs into slots (request parsing); `split_segments` cuts raw V0 segments
  into chunks for the segment kernel.

Nothing here loops over tokens in Python: every function is O(tokens) numpy.
"""

from __future__ import annotations

import numpy as np
import torch


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


def split_segments(offsets: np.ndarray, lengths: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


_VALUE_ZERO = np.zeros(1, dtype=np.int64)  # the one piece of a one-value request belongs to value 0 (read-only)
_VALUE_ZERO.flags.writeable = False


def value_pieces(
    slots: np.ndarray, block_size: int, tok_start: np.ndarray, part_base: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
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
        first_slot = int(s[0])
        last_slot = first_slot + s.size - 1
        # a value holds at most a store block of tokens: comparing Python lists beats numpy's per-call overhead
        if first_slot // block_size == last_slot // block_size and s.tolist() == list(range(first_slot, last_slot + 1)):
            table = np.array((first_slot, s.size, int(part_base[0]), s.size, 0), dtype=np.int64).reshape(5, 1)
            return table, _VALUE_ZERO
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = (s[1:] != s[:-1] + 1) | (s[1:] % block_size == 0)
    new[bounds[1:-1][bounds[1:-1] < s.size]] = True  # a value starts a piece (empty values start none)
    first = np.flatnonzero(new).astype(np.int64)
    counts = np.diff(np.append(first, s.size)).astype(np.int64)
    value = np.searchsorted(bounds, first, side="right").astype(np.int64) - 1
    value_tokens = np.diff(bounds)[value]
    table = np.stack([s[first], counts, np.asarray(part_base, dtype=np.int64)[value], value_tokens, first - bounds[value]])
    return table, value


def block_run_pieces(table: np.ndarray, block_size: int) -> np.ndarray | None:
    """Pieces of `PlaneSet.block_runs` moving the same bytes as `table` (pieces of the planes), when every piece is
    one whole block that is a whole value (`count == value tokens == block_size`): block b's run, one token of
    `block_run_bytes`, at the same part base; else None (then the planes' pieces move the values)."""
    start, count, base, tokens, index = table
    whole = (count == block_size) & (tokens == block_size) & (index == 0) & (start % block_size == 0)
    if count.size == 0 or not bool(whole.all()):
        return None
    ones = np.ones(count.size, dtype=np.int64)
    return np.stack([start // block_size, ones, base, ones, np.zeros(count.size, dtype=np.int64)])


def plane_pieces_of_runs(table: np.ndarray, block_size: int) -> np.ndarray:
    """The inverse of `block_run_pieces`: pieces of the planes moving the same bytes as `table` (pieces of
    `block_runs`, block b at part base p) -- each run one whole block of `block_size` tokens."""
    block, _, base, _, _ = table
    full = np.full(block.size, block_size, dtype=np.int64)
    return np.stack([block * block_size, full, base, full, np.zeros(block.size, dtype=np.int64)])

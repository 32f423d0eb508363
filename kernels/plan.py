"""Host-side (numpy, vectorised) helpers of the copy backends and the call's checks (a call's piece tables are
planned in `ems.datapath.planning`: `value_pieces`, `block_run_pieces`).

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

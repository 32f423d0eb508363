"""Reusable buffers for packed segments: the transport's own, bounded, process-wide.

A GET packs values smaller than `protocol.SEGMENT_BYTES` several to a message: the node copies them into one send
buffer, and a client whose buffers are separate receives the message into one and copies them out. A fresh buffer's
pages fault in one by one as they are first written (about 2 ms per MiB on a VM: a 62 MiB load of 512 KiB values
ran at 0.66 GB/s, against 3.5-4 GB/s with 1 MiB values, which travel alone, from and into their own buffers), so
both sides keep such buffers for reuse.

Contract: `ScratchBuffers(limit).take(size)` returns a writable uint8 array of exactly `size` bytes (a view of a kept
buffer when one of that rounded size is free, else a new one); `give(arrays)` keeps the arrays `take` returned, up
to `limit` bytes in all (the rest are dropped). Give an array back only once nothing can still write into it or read
from it: not after a call that failed or timed out (UCX may still complete into it). Thread-safe. Not
`ems.staging.StagingPool`: the transport imports nothing of the client's modules (tests/transport/test_layering.py),
and these buffers have no device twin, no lease and no back-pressure.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np

GRANULE = 64 << 10  # sizes rounded up to this, so that segments of one value size share buffers


class ScratchBuffers:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: dict[int, list[np.ndarray]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        rounded = max(GRANULE, -(-size // GRANULE) * GRANULE)
        with self._lock:
            kept = self._free.get(rounded)
            if kept:
                self._bytes -= rounded
                return kept.pop()[:size]
        return np.empty(rounded, dtype=np.uint8)[:size]

    def give(self, arrays: Iterable[np.ndarray]) -> None:
        with self._lock:
            for array in arrays:
                whole = array.base if isinstance(array.base, np.ndarray) else array
                if whole.nbytes % GRANULE or self._bytes + whole.nbytes > self.limit:
                    continue  # not one of ours, or the cache is full
                self._free.setdefault(whole.nbytes, []).append(whole)
                self._bytes += whole.nbytes

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return self._bytes


RECEIVE_SCRATCH = ScratchBuffers(64 << 20)  # a client's receive buffers (all of this process's connections)

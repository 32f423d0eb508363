"""A same-host client's region as its calls use it (`transport.shm.wire` has the protocol): the mapping, the
connection it belongs to and its request channel (`ClientRegion`; the channel's client end is
`transport.stream.ClientChannel`), its ranges (`RangeAllocator`) and the buffers it lends (`ShmBuffer`).

Contract:
* `RangeAllocator` hands out disjoint page-aligned ranges of the region, first fit (so a region's first calls use the
  start that both sides populated), thread-safe; `poison()` stops it for good (nothing of the region is handed out
  again: a range a failed request held may still be written by the node). `ShmBuffer` is a range lent to a caller:
  `release()` gives it back, `retire()` poisons the region (a failed call may still touch it).
* A region's channel (the hand-over socket, kept open: its protocol in `shm.wire`) carries up to CHANNEL_IN_FLIGHT
  requests at once; a call that finds every slot taken goes over its node client's connection.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ems.transport.shm.wire import PAGE
from ems.transport.stream import ClientChannel


@dataclass(frozen=True)
class ShmRange:
    offset: int
    nbytes: int


class RangeAllocator:
    """Disjoint page-aligned ranges of a region of `size` bytes (first fit; thread-safe). `poison()` stops it for
    good: a range a failed request held may still be written by the node, so nothing of the region is reused."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # sorted, disjoint (start, end)
        self._lock = threading.Lock()
        self.poisoned = False
        self.used = 0
        self.high_water = 0  # the end of the highest range ever handed out

    def alloc(self, nbytes: int) -> ShmRange | None:
        need = max(PAGE, (nbytes + PAGE - 1) // PAGE * PAGE)
        with self._lock:
            if self.poisoned:
                return None
            for i, (start, end) in enumerate(self._free):
                if end - start >= need:
                    if end - start == need:
                        del self._free[i]
                    else:
                        self._free[i] = (start + need, end)
                    self.used += need
                    self.high_water = max(self.high_water, start + need)
                    return ShmRange(start, need)
        return None

    def free(self, taken: ShmRange) -> None:
        with self._lock:
            if self.poisoned:
                return
            start, end = taken.offset, taken.offset + taken.nbytes
            self.used -= taken.nbytes
            ranges = self._free
            at = 0
            while at < len(ranges) and ranges[at][0] < start:
                at += 1
            if at > 0 and ranges[at - 1][1] == start:
                at -= 1
                start = ranges[at][0]
                del ranges[at]
            if at < len(ranges) and ranges[at][0] == end:
                end = ranges[at][1]
                del ranges[at]
            ranges.insert(at, (start, end))

    def poison(self) -> None:
        with self._lock:
            self.poisoned = True
            self._free = []


@dataclass(eq=False)
class ClientRegion:
    """A mapped region and the connection (endpoint) it belongs to."""

    ep: Any
    array: np.ndarray
    allocator: RangeAllocator
    channel: ClientChannel | None = None  # the hand-over socket, kept for this region's requests

    def __post_init__(self) -> None:
        self.base = int(self.array.ctypes.data)

    def offset_of(self, address: int, nbytes: int) -> int:
        """The region offset of `nbytes` at `address`, or -1 when they are not inside the region."""
        offset = address - self.base
        return offset if offset >= 0 and offset + nbytes <= self.array.nbytes else -1


class ShmBuffer:
    """A range of a region lent to a caller (`ShmClient.buffer`): `array` is writable uint8 memory that calls of this
    client move without a copy. `release()` returns it; `retire()` when a failed call may still touch it."""

    def __init__(self, region: ClientRegion, taken: ShmRange, nbytes: int) -> None:
        self.region = region
        self.taken = taken
        self.array = region.array[taken.offset : taken.offset + nbytes]

    def release(self) -> None:
        self.region.allocator.free(self.taken)

    def retire(self) -> None:
        self.region.allocator.poison()


def retire_region(region: ClientRegion) -> None:
    """Nothing of `region` is handed out or asked over its channel again (leases still held keep its mapping)."""
    region.allocator.poison()
    if region.channel is not None:
        region.channel.close()

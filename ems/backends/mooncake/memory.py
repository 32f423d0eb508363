"""Host memory registered with the Mooncake client, and where a call's bytes go in it.

Contract (`RegisteredMemory`):
* Each staging buffer is registered once (`prepare`, which the staging pool calls for a new buffer: while the store
  is not set up, nothing is registered and that buffer's values bounce) and unregistered when the staging pool lets
  go of it (`release`) once no Mooncake call is in flight (`Workers.when_idle`: a call that hangs may still touch
  it). A registered buffer is kept alive (referenced) while registered.
* `sources(values, sizes)` / `targets(outs)`: the address each value of a put is read from, each value of a receive
  is placed at: the value's own bytes where they lie inside one registered region (zero copy), else a slice of a
  registered bounce buffer (`bounce`, a `StagingPool` of `BOUNCE_CAPACITY` whose buffers are registered the same
  way): a put's values are copied into it first; a receive's placed values are copied out by `copy_back`. One
  copy, correct on every Mooncake transport. The caller hands the lease back (`give_back`): released when the call
  returned, retired when it did not (it may still be touched).
* `drain()` (the backend closes) takes every registration to be undone with the store's close.
* Thread-safe: `Registry` has its own lock over the regions; `_lock` guards `_registered`.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ems.backends.mooncake.workers import Workers
from ems.buffers import Buffer
from ems.kernels.host_copy import buffer_addresses
from ems.staging import StagingLease, StagingPool

log = logging.getLogger("ems")

BOUNCE_CAPACITY = 256 << 20  # registered bounce buffers in use at once


class Registry:
    """The store's registered memory regions, by address (few: one per staging or bounce buffer)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._lock = threading.Lock()

    def add(self, start: int, size: int) -> None:
        with self._lock:
            i = bisect.bisect(self._starts, start)
            self._starts.insert(i, start)
            self._ends.insert(i, start + size)

    def remove(self, start: int) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, start)
            if i < len(self._starts) and self._starts[i] == start:
                del self._starts[i], self._ends[i]

    def covers(self, addresses: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Per range: whether it lies inside one registered region."""
        with self._lock:
            starts, ends = np.asarray(self._starts, dtype=np.int64), np.asarray(self._ends, dtype=np.int64)
        if starts.size == 0:
            return np.zeros(addresses.size, dtype=bool)
        i = np.searchsorted(starts, addresses, side="right") - 1
        ok = i >= 0
        j = np.maximum(i, 0)
        covered: np.ndarray = ok & (addresses >= starts[j]) & (addresses + sizes <= ends[j])
        return covered


@dataclass
class Placement:
    """Where a call's values lie: `addresses[i]` for value i; those at `bounced` in `bounce` (None: none bounced)."""

    addresses: np.ndarray  # int64 [n]
    bounce: StagingLease | None = None
    bounced: np.ndarray | None = None  # indices of the values in the bounce buffer, in its order
    offsets: np.ndarray | None = None  # their offsets in it


class RegisteredMemory:
    """Registered staging and bounce buffers; see the module docstring."""

    def __init__(self, store: Callable[[], Any], workers: Workers) -> None:
        self._store = store  # the set-up store now, or None
        self._workers = workers
        self.registry = Registry()
        self._registered: dict[int, torch.Tensor] = {}  # address -> buffer (kept alive while registered)
        self._lock = threading.Lock()
        self.bounce = StagingPool(BOUNCE_CAPACITY, self.prepare, self.release)

    @property
    def registered(self) -> list[int]:
        """The addresses registered now."""
        with self._lock:
            return list(self._registered)

    def prepare(self, buffer: torch.Tensor) -> None:
        """Register a new staging (or bounce) buffer with the store; kept alive while registered."""
        store = self._store()
        if store is None:
            return  # not set up: unregistered bytes go through the bounce buffer (registered once set up)
        address, size = int(buffer.data_ptr()), int(buffer.numel() * buffer.element_size())
        rc = store.register_buffer(address, size)
        if rc != 0:
            log.warning("mooncake: register_buffer of %d bytes answered %s (that buffer's values bounce)", size, rc)
            return
        with self._lock:
            self._registered[address] = buffer
        self.registry.add(address, size)

    def release(self, buffer: torch.Tensor) -> None:
        """Unregister `buffer` once no Mooncake call is in flight (one that hangs may still touch it)."""
        address = int(buffer.data_ptr())
        with self._lock:
            if address not in self._registered:
                return
        self._workers.when_idle(lambda: self._unregister(address))

    def _unregister(self, address: int) -> None:
        self.registry.remove(address)
        with self._lock:
            buffer = self._registered.pop(address, None)
        store = self._store()
        if buffer is not None and store is not None:  # (after close, the store's close unregisters what is left)
            store.unregister_buffer(address)

    def drain(self) -> list[int]:
        """Every address registered now, forgotten here (the backend closes: its store unregisters them)."""
        with self._lock:
            registered, self._registered = list(self._registered), {}
        return registered

    def _bounce_lease(self, nbytes: int) -> StagingLease:
        return self.bounce.acquire(nbytes, torch.device("cpu"))

    def sources(self, values: Sequence[Sequence[Buffer]], sizes: np.ndarray) -> Placement:
        """Where each value of a put is read from (a value of several parts, or outside registered memory, is copied
        whole into the bounce buffer)."""
        n = len(values)
        single = np.fromiter((len(v) == 1 for v in values), dtype=bool, count=n)
        addresses = np.zeros(n, dtype=np.int64)
        where = np.nonzero(single)[0]
        addresses[where] = buffer_addresses([values[i][0] for i in where.tolist()]) if where.size else 0
        direct = single & self.registry.covers(addresses, sizes)
        if direct.all():
            return Placement(addresses)
        idx = np.nonzero(~direct)[0]
        offsets = np.concatenate(([0], np.cumsum(sizes[idx])))
        bounce = self._bounce_lease(int(offsets[-1]))
        target = bounce.host_array()
        for i, at in zip(idx.tolist(), offsets[:-1].tolist()):
            for part in values[i]:
                raw = np.frombuffer(part, dtype=np.uint8)
                target[at : at + raw.size] = raw
                at += raw.size
        addresses[idx] = int(bounce.host.data_ptr()) + offsets[:-1]
        return Placement(addresses, bounce, idx, offsets[:-1])

    def targets(self, outs: Sequence[Buffer], sizes: np.ndarray) -> Placement:
        """Where each value of a receive is placed (an out outside registered memory: a slice of the bounce buffer,
        copied out by `copy_back`)."""
        addresses = buffer_addresses(outs) if len(outs) else np.zeros(0, dtype=np.int64)
        idx = np.nonzero(~self.registry.covers(addresses, sizes))[0]
        if not idx.size:
            return Placement(addresses)
        offsets = np.concatenate(([0], np.cumsum(sizes[idx])))
        bounce = self._bounce_lease(int(offsets[-1]))
        addresses[idx] = int(bounce.host.data_ptr()) + offsets[:-1]
        return Placement(addresses, bounce, idx, offsets[:-1])

    @staticmethod
    def copy_back(placement: Placement, outs: Sequence[Buffer], sizes: np.ndarray, placed: np.ndarray) -> None:
        """Copy the values a receive placed in the bounce buffer out into their `outs`."""
        if placement.bounce is None or placement.bounced is None or placement.offsets is None:
            return
        source = placement.bounce.host_array()
        for i, at in zip(placement.bounced.tolist(), placement.offsets.tolist()):
            if placed[i]:
                memoryview(outs[i]).cast("B")[:] = source[at : at + int(sizes[i])].data

    def give_back(self, placement: Placement, returned: bool) -> None:
        """The call is over: its bounce lease is released when the call returned, else retired (it may still be
        touched)."""
        if placement.bounce is not None:
            (self.bounce.release if returned else self.bounce.retire)(placement.bounce)

    def clear(self) -> None:
        """Let go of the bounce buffers kept for reuse (the backend closes)."""
        self.bounce.clear()

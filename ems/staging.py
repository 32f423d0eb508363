"""Reusable staging buffers, bounded in bytes: below both the data path (`ems.datapath`: the jobs stage through it)
and the pool backends (`ems.backends.mooncake.memory`: its bounce buffers), so it imports nothing of either.

A request leases one staging buffer (on the device, plus its host twin when the device is not the CPU), fills
it, and releases it on every path, error paths included. Buffers are kept for reuse, rounded up to powers of two.
The bytes leased and kept never exceed the capacity: a request that would exceed it waits until others release
theirs (back-pressure, never unbounded memory). A request larger than the whole capacity runs alone, with a
buffer that is freed afterwards. A buffer a transfer may still touch after its request gave up (a timed-out
receive) is retired instead of released: its bytes are given back, the buffer is never reused.

Kinds (`StagingKind`, fixed when the lease is made; a job asks the lease, never compares its buffers): `HOST`, one
host buffer (a CPU cache's own memory: nothing to copy between device and host); `TWIN`, a device buffer and its
host twin (accelerators: `copy_to_host` / `copy_to_device` move a range between them); `SHARED`, a buffer in a
same-host pool node's shared-memory region (below).

Shared staging: on the CPU, `acquire(..., shared=...)` first asks `shared(nbytes)` for a buffer in a pool node's
shared-memory region (`PoolClient.shm_staging`), which the node's calls then move without a copy. Such a lease
holds no bytes of this pool's capacity (its region bounds it); release and retire hand it back to its region.

`on_new_buffer` (the pool backend's `prepare_staging`: e.g. register the memory with the pool's transfer engine)
sees each new host buffer of this pool once, before it is leased, and `on_drop_buffer` (`release_staging`) once
when the pool lets go of it (dropped from the free list, released without being kept, retired, cleared).

A lease's copies between device and host are recorded where the caller says (`CopyRecord`: a job's
`ems.records.JobRecord`, as its `Stage.COPY`).
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

MIN_BUFFER = 1 << 16


class CopyRecord(Protocol):
    """Where a lease's copies between device and host are timed (`ems.records.JobRecord` is one)."""

    def copying(self, nbytes: int) -> AbstractContextManager[object]:
        """Time the body of a `with` as one copy of `nbytes` between a device buffer and its host twin."""
        ...


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 host buffer for staging to/from `device`: page-locked when the device can use that."""
    if device.type != "cpu":
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:
            pass  # no pinning available: plain memory still works, only slower
    return torch.empty(nbytes, dtype=torch.uint8)


class StagingKind(enum.Enum):
    """Where a lease's bytes live (see the module docstring)."""

    HOST = "host"  # one host buffer: the cache's own memory (CPU)
    TWIN = "twin"  # a device buffer and its host twin (accelerators)
    SHARED = "shared"  # a buffer in a same-host pool node's shared-memory region (CPU)


@dataclass(eq=False)
class StagingLease:
    """A leased staging buffer: `device` and `host` are uint8 `[capacity]` (the same tensor unless `kind` is
    `TWIN`).

    Leases compare by identity (`eq=False`): a field-wise `==` would compare tensors, which raises for tensors of
    different sizes and is ambiguous for equal ones."""

    device: torch.Tensor
    host: torch.Tensor
    capacity: int
    kind: StagingKind
    shared: Any = None  # SHARED: the region buffer behind `host` (release() / retire()); else None

    def copy_to_host(self, lo: int, hi: int, record: CopyRecord | None = None) -> None:
        """Bytes lo..hi-1 from the device buffer to its host twin (queued on the current stream; timed by `record`:
        a job's `Stage.COPY`); nothing where they are one buffer."""
        if self.kind is StagingKind.TWIN:
            with record.copying(hi - lo) if record is not None else contextlib.nullcontext():
                self.host[lo:hi].copy_(self.device[lo:hi], non_blocking=True)

    def copy_to_device(self, lo: int, hi: int, record: CopyRecord | None = None) -> None:
        """Bytes lo..hi-1 from the host twin to the device buffer (as `copy_to_host`, the other way)."""
        if self.kind is StagingKind.TWIN:
            with record.copying(hi - lo) if record is not None else contextlib.nullcontext():
                self.device[lo:hi].copy_(self.host[lo:hi], non_blocking=True)

    def host_array(self) -> np.ndarray:
        return self.host.numpy()

    def host_view(self) -> memoryview:
        return memoryview(self.host.numpy()).cast("B")


def _round_up(nbytes: int) -> int:
    return max(MIN_BUFFER, 1 << (max(nbytes, 1) - 1).bit_length())


class StagingPool:
    def __init__(
        self,
        capacity_bytes: int,
        on_new_buffer: Callable[[torch.Tensor], None] | None = None,
        on_drop_buffer: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.capacity = capacity_bytes
        self._on_new_buffer = on_new_buffer
        self._on_drop_buffer = on_drop_buffer
        self._free: list[StagingLease] = []
        self._free_bytes = 0
        self._leased_bytes = 0
        self._cond = threading.Condition()

    @staticmethod
    def _cost(lease: StagingLease) -> int:
        return lease.capacity * (2 if lease.kind is StagingKind.TWIN else 1)

    def _take_free(self, nbytes: int, device: torch.device) -> StagingLease | None:
        fits = [f for f in self._free if f.capacity >= nbytes and f.device.device == device]
        if not fits:
            return None
        best = min(fits, key=lambda f: f.capacity)
        self._drop_free(best)
        return best

    def _drop_free(self, lease: StagingLease) -> None:
        """Take `lease` (by identity) out of the free list."""
        index = next(i for i, f in enumerate(self._free) if f is lease)
        del self._free[index]
        self._free_bytes -= self._cost(lease)

    def _let_go(self, lease: StagingLease) -> None:
        """The pool keeps `lease`'s buffer no longer: tell `on_drop_buffer`."""
        if self._on_drop_buffer is not None:
            self._on_drop_buffer(lease.host)

    def acquire(self, nbytes: int, device: torch.device, shared: Callable[[int], Any] | None = None) -> StagingLease:
        """A buffer of at least `nbytes` on `device`; waits while the pool is at capacity. On the CPU, `shared`
        (see the module docstring) is asked first."""
        if shared is not None and device.type == "cpu":
            region_buffer = shared(nbytes)
            if region_buffer is not None:
                tensor = torch.from_numpy(region_buffer.array)
                return StagingLease(tensor, tensor, nbytes, StagingKind.SHARED, shared=region_buffer)
        size = _round_up(nbytes)
        cost = size * (1 if device.type == "cpu" else 2)
        with self._cond:
            while True:
                lease = self._take_free(nbytes, device)
                if lease is not None:
                    self._leased_bytes += self._cost(lease)
                    return lease
                while self._free and self._leased_bytes + self._free_bytes + cost > self.capacity:
                    dropped = max(self._free, key=lambda f: f.capacity)
                    self._drop_free(dropped)
                    self._let_go(dropped)
                if self._leased_bytes + cost <= self.capacity or self._leased_bytes == 0:
                    self._leased_bytes += cost
                    break
                self._cond.wait()
        host: torch.Tensor | None = None
        try:
            device_buffer = torch.empty(size, dtype=torch.uint8, device=device)
            host = device_buffer if device.type == "cpu" else host_buffer(size, device)
            if self._on_new_buffer is not None:
                self._on_new_buffer(host)
        except BaseException:  # any failure (even an interrupt) must return the reserved bytes, then propagate
            if host is not None and self._on_drop_buffer is not None:  # prepared, perhaps: undo it
                self._on_drop_buffer(host)
            with self._cond:
                self._leased_bytes -= cost
                self._cond.notify_all()
            raise
        return StagingLease(device_buffer, host, size, StagingKind.HOST if device.type == "cpu" else StagingKind.TWIN)

    def release(self, lease: StagingLease) -> None:
        if lease.kind is StagingKind.SHARED:
            lease.shared.release()
            return
        cost = self._cost(lease)
        with self._cond:
            self._leased_bytes -= cost
            if self._leased_bytes + self._free_bytes + cost <= self.capacity:
                self._free.append(lease)
                self._free_bytes += cost
            else:
                self._let_go(lease)
            self._cond.notify_all()

    def retire(self, lease: StagingLease) -> None:
        """Give back `lease`'s bytes without keeping its buffer for reuse: for a buffer a transfer may still touch
        (a request that timed out is aborted on its endpoint, not awaited). Its memory goes when the last holder
        (the transfer's own reference) lets go, so nothing else is ever placed in it meanwhile."""
        if lease.kind is StagingKind.SHARED:
            lease.shared.retire()
            return
        with self._cond:
            self._leased_bytes -= self._cost(lease)
            self._let_go(lease)
            self._cond.notify_all()

    @property
    def leased_bytes(self) -> int:
        """Bytes leased now (0 when every request has given its buffers back)."""
        with self._cond:
            return self._leased_bytes

    def clear(self) -> None:
        with self._cond:
            for lease in self._free:
                self._let_go(lease)
            self._free.clear()
            self._free_bytes = 0

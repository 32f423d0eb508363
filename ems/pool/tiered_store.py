"""A pool node's store with two tiers: an `ems.store.kv_store.KvStore` in DRAM in front of a `DiskTier` on a local disk,
served by the node's server through the same `NodeStore` protocol as a plain `KvStore`.

Contract:
* Puts go to DRAM (the value verified first, as `KvStore` does: a damaged value is refused). A put of a key first
  drops what the disk tier holds of it (queued or written), so no older value of a key can come back later.
* DRAM evicts least recently used values as before; each evicted value is handed to the disk tier's queue
  (`DiskTier.submit`: no I/O on the caller's path). A value that is both in DRAM and on disk (it was promoted and not
  written since) is not written again.
* `get_many`: DRAM first; a DRAM miss is looked up on disk: a queued value or a record read and verified there
  (`DiskTier.lookup`; a damaged record is a miss). A disk hit is promoted: copied into a DRAM buffer and stored in
  DRAM (while no put of the key came in meanwhile), and that buffer is served. One call reads at most about DRAM's
  capacity (at least `MIN_READ_BYTES`, a node's smallest in-flight budget) from the disk, the keys after that are
  misses: the values it returns are held until they are sent, so a GET naming more than DRAM holds cannot make the
  node hold more than about that again. Lookups that reach the disk block
  on I/O: `may_block` tells the server which ones to run off its event loop.
* `contains_many` (EXISTS) answers for both tiers. `hold_many` (an EXISTS with a lease or pin) holds what DRAM has
  (`KvStore.hold_many`); a key only on disk counts as kept as it is (DRAM's pressure does not reach the disk, and a
  read promotes it). `keys()` and `peek_many` (a node's repair) see DRAM only: the disk's index knows its records
  by key hash.
* `stats()` is DRAM's (`StoreStats`: the memory figures the server logs) with hits and misses counted over both
  tiers; `tier_stats()` gives each tier's own figures (metrics, `ems-pool status`).
* A disk that fails turns the node into a DRAM-only node (`DiskTier`'s contract): lookups then miss on disk.
* Thread-safe. Lock order: `_put_lock` → the DRAM store's lock → the disk tier's lock (the DRAM store's eviction
  call-back takes the disk tier's lock); the disk tier never calls back.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from ems.buffers import Buffer
from ems.pool.disk import DiskTier, DiskTierStats
from ems.store.kv_store import KvStore, StoreStats
from ems.store.value_format import copy_well_formed_many, is_well_formed, well_formed_many
from ems.transport.exists_holds import Hold

MIN_READ_BYTES = 64 << 20


@dataclass
class TierStats:
    """Both tiers' figures at one moment."""

    dram: StoreStats
    disk: DiskTierStats


class TieredStore:
    """DRAM in front of a local disk; see the module docstring."""

    def __init__(
        self, capacity_bytes: int, disk: DiskTier, min_read_bytes: int = MIN_READ_BYTES, prefault_ahead: int = 0
    ) -> None:
        self.disk = disk
        self._read_limit = max(capacity_bytes, min_read_bytes)
        self.dram = KvStore(capacity_bytes, on_evict=disk.submit, prefault_ahead=prefault_ahead)
        self._put_lock = threading.Lock()
        self._disk_hits = 0

    @property
    def capacity_bytes(self) -> int:
        return self.dram.capacity_bytes

    @staticmethod
    def charge_of(key_len: int, nbytes: int) -> int:
        return KvStore.charge_of(key_len, nbytes)

    def allocate(self, nbytes: int, reserve: int = 0) -> np.ndarray:
        return self.dram.allocate(nbytes, reserve)

    def recycle(self, buffer: np.ndarray, reserved: int = 0) -> None:
        self.dram.recycle(buffer, reserved)

    def put_owned(self, key: bytes, value: Buffer, reserved: int = 0, verified: bool = False) -> bool:
        # checksummed before the lock (DRAM then need not do it again under it), unless the caller did; a damaged
        # value goes to DRAM's own refusal, which counts it and releases its reservation
        if not verified and not is_well_formed(value):
            return self.dram.put_owned(key, value, reserved)
        with self._put_lock:
            self.disk.invalidate(key)
            return self.dram.put_owned(key, value, reserved, verified=True)

    def put_owned_each(self, keys: Sequence[bytes], values: Sequence[Buffer], reserved: Sequence[int]) -> list[bool]:
        """`put_owned` of each value, checked in one batch first (`well_formed_many`, see `KvStore.put_owned_each`)."""
        good = well_formed_many(values)
        return [self.put_owned(k, v, reserved=r, verified=ok) for k, v, r, ok in zip(keys, values, reserved, good)]

    def put_copied_each(
        self, keys: Sequence[bytes], buffers: Sequence[np.ndarray], sources: Sequence[Buffer], reserved: Sequence[int]
    ) -> list[bool]:
        """`put_owned_each` of `buffers`, each first filled from its source and checked in one pass (see
        `KvStore.put_copied_each`)."""
        good = copy_well_formed_many(buffers, sources)
        return [self.put_owned(k, v, reserved=r, verified=ok) for k, v, r, ok in zip(keys, buffers, reserved, good)]

    read_into = staticmethod(KvStore.read_into)

    def may_block(self, keys: Sequence[bytes]) -> bool:
        """Whether `get_many(keys)` may read the disk (some key is not in DRAM)."""
        return self.disk.up and not all(self.dram.contains_many(keys))

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        values = self.dram.get_many(keys)
        if not self.disk.up:
            return values
        read = 0
        for i, value in enumerate(values):
            if value is None:
                if read >= self._read_limit:  # see the module docstring
                    break
                found = values[i] = self._from_disk(keys[i])
                read += 0 if found is None else memoryview(found).nbytes
        return values

    def _from_disk(self, key: bytes) -> Buffer | None:
        found, token = self.disk.lookup(key)
        if found is None:
            return None
        nbytes = memoryview(found).nbytes
        charge = self.charge_of(len(key), nbytes)
        with self._put_lock:
            self._disk_hits += 1
            if charge > self.dram.capacity_bytes or not self.disk.still_current(key, token):
                return bytes(found)  # served, not promoted (a put of the key came in, or DRAM is too small)
            buffer = self.dram.allocate(nbytes, reserve=charge)
            buffer[:] = np.frombuffer(found, dtype=np.uint8)
            served = buffer.data.toreadonly()  # holds the buffer: never recycled under the reader
            self.dram.put_owned(key, cast(Buffer, buffer), reserved=charge, verified=True)  # verified on the disk
        return served

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        in_dram = self.dram.contains_many(keys)
        if all(in_dram) or not self.disk.up:
            return in_dram
        on_disk = self.disk.contains_many(keys)
        return [a or b for a, b in zip(in_dram, on_disk)]

    def hold_many(self, keys: Sequence[bytes], hold: Hold) -> list[bool]:
        held = self.dram.hold_many(keys, hold)
        if all(held) or not self.disk.up:
            return held
        on_disk = self.disk.contains_many(keys)
        return [a or b for a, b in zip(held, on_disk)]

    def keys(self) -> list[bytes]:
        """DRAM's keys (`KvStore.keys`): the disk's index knows its records by key hash only."""
        return self.dram.keys()

    def peek_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """DRAM's values (`KvStore.peek_many`), no disk read, no promotion."""
        return self.dram.peek_many(keys)

    def stats(self) -> StoreStats:
        stats = self.dram.stats()
        with self._put_lock:
            stats.hits += self._disk_hits
            stats.misses -= self._disk_hits
        return stats

    def tier_stats(self) -> TierStats:
        return TierStats(self.dram.stats(), self.disk.stats())

    def close(self) -> None:
        self.disk.close()
        self.dram.close()

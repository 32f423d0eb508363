"""What the disk tier's callers' side (`ems.pool.disk.tier.DiskTier`) and its writer thread
(`ems.pool.disk.writer.DiskWriter`) share, and the one lock that guards it.

Contract:
* `DiskState.lock` guards `queue` (`ring.WriteQueue`), `index` (`index.DiskIndex`), `stats` and `closing`; `wake`
  (a condition on that lock) wakes the writer when a value is queued, the tier fails or closes. The lock is never
  held while record bytes are read or written; it is held across the rename that names a record (the writer's
  `finish`), so a put's `invalidate` is ordered with it (`ems.pool.disk.tier`'s contract, Crash safety).
* `fail(error)`: any disk error but a full filesystem turns the tier off, once: one warning is logged, the index
  and the queue are emptied, `stats.state` becomes FAILED and the writer is woken to stop. From then on the tier
  drops what is submitted and misses every lookup.
* `keep_spare(path, nbytes)`: a dropped record's file renamed to its temporary name (without the lock) and kept
  as a spare (`DiskIndex`'s contract, Spares).
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from dataclasses import dataclass

from ems.pool.disk.files import unlink_all
from ems.pool.disk.index import DiskIndex
from ems.pool.disk.records import temporary_path
from ems.pool.disk.ring import WriteQueue

log = logging.getLogger("ems.pool")


class TierState(enum.Enum):
    UP = "up"
    FAILED = "failed"


@dataclass
class DiskTierStats:
    state: TierState = TierState.UP
    capacity_bytes: int = 0
    used_bytes: int = 0  # file bytes of the records indexed, plus those being written
    spare_bytes: int = 0  # file bytes kept to be overwritten by new records (within the capacity with used_bytes)
    values: int = 0
    queued_values: int = 0
    queued_bytes: int = 0  # record bytes waiting in the write ring
    hits: int = 0  # lookups answered from a record or from the queue
    reads: int = 0  # record files read
    read_bytes: int = 0
    read_seconds: float = 0.0
    writes: int = 0  # record files written
    write_bytes: int = 0
    write_seconds: float = 0.0
    evictions: int = 0
    dropped_writes: int = 0  # evictions not written: queue full, no room on the filesystem, value too large
    integrity_errors: int = 0  # records found damaged (and dropped)
    io_errors: int = 0  # read or write errors (a failed tier counts the one that failed it)
    direct_io: bool = False
    restored_values: int = 0
    restored_bytes: int = 0
    restore_seconds: float = 0.0


class DiskState:
    """The disk tier's shared state; see the module docstring."""

    def __init__(self, root: str, capacity_bytes: int, queue_bytes: int) -> None:
        self.root = root
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.queue = WriteQueue(queue_bytes)
        self.index = DiskIndex(root, capacity_bytes)
        self.stats = DiskTierStats(capacity_bytes=capacity_bytes)
        self.closing = False

    @property
    def up(self) -> bool:
        return self.stats.state is TierState.UP

    def fail(self, error: OSError) -> None:
        """Turn the tier off (see the module docstring); takes the lock."""
        with self.lock:
            if self.stats.state is not TierState.UP:
                return
            self.stats.state = TierState.FAILED
            self.stats.io_errors += 1
            self.index.clear()
            self.queue.clear()
            self.wake.notify_all()
        log.warning("disk tier at %s failed (%s): this node now serves from DRAM only", self.root, error)

    def keep_spare(self, path: str, nbytes: int) -> None:
        """Rename a dropped record's file to its temporary name (the lock not held) and keep it as a spare (its bytes
        moved from used to spare already, by `DiskIndex.retire` or `insert`); takes the lock after the rename."""
        spare = temporary_path(path)
        try:
            os.rename(path, spare)
        except OSError:
            with self.lock:
                self.index.spare_lost(nbytes)
            unlink_all([path])
            return
        with self.lock:
            self.index.spare_kept(spare, nbytes)

    def snapshot(self) -> DiskTierStats:
        """The figures now (a copy); takes the lock."""
        with self.lock:
            stats = self.stats
            stats.used_bytes = self.index.used
            stats.spare_bytes = self.index.spare_bytes
            stats.values = len(self.index)
            stats.evictions = self.index.evictions
            stats.queued_values = len(self.queue)
            stats.queued_bytes = self.queue.live_bytes
            return DiskTierStats(**vars(stats))

"""The disk tier's index: which records are on the disk, in LRU order, and the bytes their files take.

Contract:
* Keyed by the key's 128-bit hash (`records.key_hash`); each entry is the record's sequence number and file bytes,
  from which its path follows (`path`). Every read checks the full key, so a hash collision is a miss.
* Capacity: the bytes of indexed records (`used`, which also counts records being written: `reserve`) and of spare
  files (`spare_bytes`) stay within `limit` (`capacity_bytes`, lowered by `found_full` to what the filesystem held
  when it was full) — except that one record may overshoot while nothing is left to drop (`reserve`). Room is made
  by dropping spares of other sizes, then the least recently used records (counted in `evictions`).
* Spares: the file of a dropped record is kept under a temporary name and overwritten by a later record of its size
  (cheaper than creating a file; docs/guides/disk-tier.md). Its bytes move from `used` to `spare_bytes` when the record
  is dropped (`retire`, `insert`); the file joins the spares once renamed (`spare_kept`), or its bytes leave the
  count when the rename failed (`spare_lost`).
* No I/O: a method that drops records or spares returns the paths for the caller to unlink (or rename) once the
  tier's lock is released. Not thread-safe: the tier's lock (`ems.pool.disk.state.DiskState.lock`) guards it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from ems.pool.disk.records import ALIGN, record_path


class IndexedRecord(NamedTuple):
    """One indexed record file (its path: `DiskIndex.path`)."""

    nbytes: int  # file bytes (padded)
    seq: int


class DiskIndex:
    """The records on the disk and their bytes; see the module docstring."""

    def __init__(self, root: str, capacity_bytes: int) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.limit = capacity_bytes  # lowered to what the filesystem held when it was found full
        self._records: OrderedDict[bytes, IndexedRecord] = OrderedDict()  # key hash -> record, LRU first
        self.used = 0  # file bytes of the records indexed, plus those reserved for records being written
        # files of dropped records kept (under temporary names) to be overwritten by later records of their size:
        # overwriting an allocated file costs a third of creating one (measured: docs/guides/disk-tier.md)
        self._spares: dict[int, list[str]] = {}
        self.spare_bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._records

    def get(self, digest: bytes) -> IndexedRecord | None:
        return self._records.get(digest)

    def path(self, digest: bytes, record: IndexedRecord) -> str:
        return record_path(self.root, digest, record.seq, record.nbytes)

    def touch(self, digest: bytes) -> bool:
        """Make the record of `digest` the most recently used; False when there is none."""
        if digest not in self._records:
            return False
        self._records.move_to_end(digest)
        return True

    def restore(self, records: dict[bytes, IndexedRecord]) -> list[str]:
        """Index what a restart found (oldest first), then evict down to the capacity; the paths to unlink."""
        self._records.update(records)
        self.used += sum(record.nbytes for record in records.values())
        return self.evict_to(self.capacity_bytes)

    def insert(self, digest: bytes, record: IndexedRecord) -> tuple[str, int] | None:
        """Index a record just named, as the most recently used; the key's older record, if any, is dropped and its
        (path, file bytes) returned, to be kept as a spare (its bytes moved to `spare_bytes`)."""
        old = self._records.pop(digest, None)
        if old is not None:
            self.used -= old.nbytes
            self.spare_bytes += old.nbytes
        self._records[digest] = record
        self.used += record.nbytes
        return (self.path(digest, old), old.nbytes) if old is not None else None

    def retire(self, digest: bytes) -> tuple[str, int] | None:
        """Drop the record of `digest` (stale) to be kept as a spare: its (path, file bytes), or None."""
        record = self._records.pop(digest, None)
        if record is None:
            return None
        self.used -= record.nbytes
        self.spare_bytes += record.nbytes
        return self.path(digest, record), record.nbytes

    def discard(self, digest: bytes, record: IndexedRecord) -> str | None:
        """Drop `record` (found damaged or unreadable) if it is still the one indexed for `digest`: its path, to
        unlink; None when it was dropped (and its file maybe reused) meanwhile."""
        if self._records.get(digest) is not record:
            return None
        del self._records[digest]
        self.used -= record.nbytes
        return self.path(digest, record)

    def spare_kept(self, path: str, nbytes: int) -> None:
        """A dropped record's file now under its temporary name `path`: a spare (its bytes counted already)."""
        self._spares.setdefault(nbytes, []).append(path)

    def spare_lost(self, nbytes: int) -> None:
        """A dropped record's file could not be kept as a spare: its bytes leave the count."""
        self.spare_bytes -= nbytes

    def add_spare(self, path: str, nbytes: int) -> None:
        """A written file that is not named (its value was superseded while written): a spare as it is."""
        self._spares.setdefault(nbytes, []).append(path)
        self.spare_bytes += nbytes

    def reserve(self, nbytes: int, overshoot: bool) -> tuple[bool, str | None, list[str]]:
        """Room for a record of `nbytes`: (whether it was reserved; a file of that size to overwrite, or None to
        create one; the paths to unlink once the lock is released, in every case). Spares of the size first, then
        free room, then spares of other sizes are dropped and least recently used records evicted (one of the size is
        overwritten). When nothing is left to drop (the rest is being written) it is not reserved, unless
        `overshoot`."""
        doomed: list[str] = []
        while True:
            spares = self._spares.get(nbytes)
            if spares:
                self.spare_bytes -= nbytes
                self.used += nbytes
                return True, spares.pop(), doomed
            if self.used + self.spare_bytes + nbytes <= self.limit:
                self.used += nbytes
                return True, None, doomed
            dropped = self.drop_spares(1, keep=nbytes)
            if dropped:
                doomed += dropped
                continue
            if not self._records:  # nothing left to drop: the rest is being written (or a spare being renamed)
                if overshoot:
                    self.used += nbytes
                return overshoot, None, doomed
            digest, record = self._records.popitem(last=False)
            self.used -= record.nbytes
            self.evictions += 1
            if record.nbytes == nbytes:
                self.used += nbytes
                return True, self.path(digest, record), doomed
            doomed.append(self.path(digest, record))

    def release(self, nbytes: int) -> None:
        """A reservation ends (its record is indexed by `insert`, kept by `add_spare`, or was not written)."""
        self.used -= nbytes

    def drop_spares(self, count: int, keep: int = -1) -> list[str]:
        """Forget up to `count` spares (0: all) of sizes other than `keep`; their paths to unlink."""
        dropped: list[str] = []
        for size, paths in self._spares.items():
            while paths and size != keep and (count == 0 or len(dropped) < count):
                dropped.append(paths.pop())
                self.spare_bytes -= size
        return dropped

    def evict_to(self, limit: int, count: int = -1) -> list[str]:
        """Drop least recently used records (at most `count` of them, -1: no limit) until the bytes used are at most
        `limit`; returns the paths to unlink."""
        doomed: list[str] = []
        while self.used > limit and self._records and len(doomed) != count:
            digest, record = self._records.popitem(last=False)
            self.used -= record.nbytes
            self.evictions += 1
            doomed.append(self.path(digest, record))
        return doomed

    def make_room(self) -> list[str]:
        """Drop one spare, else the least recently used record (the filesystem is full); the path to unlink, or []
        when nothing is left to drop."""
        return self.drop_spares(1) or self.evict_to(self.used - 1, count=1)

    def found_full(self, unwritten_bytes: int) -> None:
        """The filesystem was found full with `unwritten_bytes` of this tier's reservations not written: from now on
        keep within what it held."""
        on_disk = self.used + self.spare_bytes - unwritten_bytes
        self.limit = max(ALIGN, min(self.limit, on_disk))

    def clear(self) -> None:
        """Forget every record and spare (the tier failed); `evictions` keeps counting."""
        self._records.clear()
        self.used = 0
        self._spares.clear()
        self.spare_bytes = 0

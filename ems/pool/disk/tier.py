"""A pool node's second tier: values evicted from DRAM kept on a local disk, one file per value.

Contract (`DiskTier`; the node's `TieredStore` is its only user):
* `submit(key, value)` queues a value evicted from DRAM for writing and returns at once (never any I/O on the
  caller's path): its record is encoded into the write ring, `queue_bytes` of aligned memory (`ring.WriteQueue`).
  That one copy lets DRAM reuse the evicted buffer at once, as it does without a disk (a buffer held until written
  would make every later receive fault in fresh pages). The writer thread (`writer.DiskWriter`) takes the queue in
  batches and has the write helper process (`helper`) write them, one record file each, a batch per round trip, and
  names them. An eviction that does not fit in the ring is dropped (counted), never waited for. A queued value is
  found by `lookup` (a copy) until its file is written, so a read never sees an older file than the newest value.
* Record file and names: `records` (header, key, value, checksums; `XX/<xxh3-128 of the key>-<seq>-<bytes>.rec`).
* Crash safety: a record is written to a temporary name and renamed into place only once fully written (and only
  while it is still the key's newest value: the rename and a put's `invalidate` are ordered by the lock), so a file
  under a record name was complete when it was named; a node killed mid-write leaves only temporary files, which
  the next start removes. Nothing is trusted on read: a record whose header, key, lengths or checksum do not match
  (a flipped byte, a truncated file) is a miss, and is dropped with its file.
* `open()` rebuilds the index from the names alone (`files.scan`: no file opened), oldest sequence first as the LRU
  order. The index is keyed by the key's 128-bit hash and every read checks the full key, so a hash collision is a
  miss, and one tenant's record is never served under another tenant's key.
* Capacity: file bytes (padded) stay within `capacity_bytes`; writing evicts least recently used records first,
  and dropped records' files are kept as spares to be overwritten (`index.DiskIndex`). A full filesystem (ENOSPC,
  EDQUOT) is handled as eviction (`writer`), never an error to a client.
* Failure: any other error of the disk (read-only filesystem, the directory removed, EIO on write) turns the tier
  off (`state.DiskState.fail`): one warning is logged, the index and the queue are emptied, and from then on
  `submit` drops and `lookup` misses (the node serves from DRAM only). A read error of one record while the
  directory is still there is that record's miss (dropped), not a failure of the tier.
* I/O: O_DIRECT with buffers aligned to `ALIGN` where the filesystem takes it (docs/guides/disk-tier.md says why), else
  buffered I/O. Reads land in a per-thread aligned bounce buffer (`files.RecordReader`); the caller copies the
  verified value out.
* Thread-safe: one lock (`state.DiskState.lock`) guards the index, the queue, the spares and the counters; it is
  never held while record bytes are read or written (only across the rename that names a record, see Crash safety).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

from ems.buffers import Buffer
from ems.pool.disk import files
from ems.pool.disk.records import decode_record, key_hash, record_bytes
from ems.pool.disk.state import DiskState, DiskTierStats
from ems.pool.disk.writer import DiskWriter

log = logging.getLogger("ems.pool")


class DiskTier:
    """Values on a local disk behind a node's DRAM; see the module docstring."""

    def __init__(self, root: str, capacity_bytes: int, queue_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the disk capacity must be > 0, got {capacity_bytes}")
        self.root = os.path.abspath(root)
        self.capacity_bytes = capacity_bytes
        self.queue_bytes = queue_bytes
        self._state = DiskState(self.root, capacity_bytes, queue_bytes)
        self._reader = files.RecordReader()
        self._writer: DiskWriter | None = None

    # ---- life cycle ----

    def open(self) -> None:
        """Create the directories, choose the I/O mode, rebuild the index from the record names, start the writer.
        OSError when the directory cannot be used at all (the caller decides: the node refuses to start)."""
        start = time.perf_counter()
        state = self._state
        files.prepare(self.root)
        direct = self._reader.direct = files.probe_direct(self.root)
        found = files.scan(self.root)
        stale = found.stale
        with state.lock:
            stale += state.index.restore(found.records)
            state.queue.restore_seq(found.last_seq)
            state.stats.restored_values = len(state.index)
            state.stats.restored_bytes = state.index.used
            state.stats.direct_io = bool(direct)
        files.unlink_all(stale)
        state.stats.restore_seconds = time.perf_counter() - start
        log.info(
            "disk tier at %s: %d values, %d bytes restored in %.3f s (%s I/O)",
            self.root,
            state.stats.restored_values,
            state.stats.restored_bytes,
            state.stats.restore_seconds,
            "O_DIRECT" if direct else "buffered",
        )
        self._writer = DiskWriter(state, bool(direct))
        self._writer.start()

    def close(self) -> None:
        """Stop the writer (values still queued are not written: a cache) and let go of the files."""
        if self._writer is None:
            with self._state.lock:
                self._state.closing = True
            return
        self._writer.stop()
        self._writer = None

    @property
    def up(self) -> bool:
        return self._state.up

    # ---- the caller's side: never any I/O ----

    def submit(self, key: bytes, value: Buffer) -> None:
        """Queue a value evicted from DRAM for writing (see the module docstring): its record is encoded into the
        write ring at once (a copy, so DRAM reuses the evicted buffer straight away), never any I/O here."""
        size = record_bytes(len(key), memoryview(value).nbytes)
        digest = key_hash(key)
        state = self._state
        with state.lock:
            if not state.up:
                return
            if key not in state.queue and state.index.touch(digest):
                # A value on disk and in DRAM at once is the same value (a put of the key drops the record first,
                # `invalidate`): already written, it only becomes recently used.
                return
            state.queue.drop(key)
            if size > self.capacity_bytes or state.queue.add(key, value, size) is None:
                state.stats.dropped_writes += 1
                return
            state.wake.notify()

    def invalidate(self, key: bytes) -> None:
        """A new value of `key` is being stored in DRAM: what this tier holds of it is stale from now on."""
        digest = key_hash(key)
        state = self._state
        with state.lock:
            state.queue.drop(key)
            retired = state.index.retire(digest)
        if retired is not None:  # renamed away before the put goes on: a restart can never find the old value
            state.keep_spare(*retired)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        state = self._state
        with state.lock:
            return [key in state.queue or key_hash(key) in state.index for key in keys]

    def still_current(self, key: bytes, token: object) -> bool:
        """Whether what `lookup` returned with `token` is still this tier's newest value of `key`."""
        state = self._state
        with state.lock:
            return state.queue.get(key) is token or state.index.get(key_hash(key)) is token

    # ---- reads (the caller's thread: the server runs them off its event loop) ----

    def lookup(self, key: bytes) -> tuple[Buffer | None, object]:
        """(value, token) when this tier holds `key`: a queued value (a copy), or a verified record's value in this
        thread's bounce buffer (valid until this thread's next `lookup`: copy it out); (None, None) on a miss."""
        digest = key_hash(key)
        state = self._state
        with state.lock:
            if not state.up:
                return None, None
            queued = state.queue.get(key)
            if queued is not None:  # copied out under the lock: the writer frees the slot once written
                state.stats.hits += 1
                return state.queue.value(key, queued), queued
            record = state.index.get(digest)
            if record is None:
                return None, None
            state.index.touch(digest)
        path = state.index.path(digest, record)
        started = time.perf_counter()
        try:
            data = self._reader.read(path, record.nbytes)
        except OSError as error:
            if not os.path.isdir(self.root):
                state.fail(error)
                return None, None
            data = None
            with state.lock:
                state.stats.io_errors += 1
            log.warning("disk tier: cannot read %s (%s): dropped", path, error)
        value = decode_record(data, key) if data is not None else None
        with state.lock:
            state.stats.reads += 1
            state.stats.read_seconds += time.perf_counter() - started
            doomed = None
            if value is None:  # (a record dropped, and maybe its file reused, while this read ran: a plain miss)
                doomed = state.index.discard(digest, record)
                state.stats.integrity_errors += doomed is not None and data is not None
            else:
                state.stats.hits += 1
                state.stats.read_bytes += record.nbytes
        if value is None:
            if doomed is not None:
                if data is not None:
                    log.warning("disk tier: record %s is damaged or not the key's: dropped", path)
                files.unlink_all([doomed])
            return None, None
        return value.data, record

    def stats(self) -> DiskTierStats:
        return self._state.snapshot()

"""A pool node's second tier: values evicted from DRAM kept on a local disk, one file per value.

Contract (`DiskTier`; the node's `TieredStore` is its only user):
* `submit(key, value)` queues a value evicted from DRAM for writing and returns at once (never any I/O on the
  caller's path): its record is encoded into the write ring, `queue_bytes` of aligned memory. That one copy lets
  DRAM reuse the evicted buffer at once, as it does without a disk (a buffer held until written would make every
  later receive fault in fresh pages). A writer thread takes the queue in batches (`BATCH_RECORDS`,
  `BATCH_BYTES`), has the write helper process (`ems.pool.disk_io`) write them straight from the ring, one record
  file each, a batch per round trip, and names them. An eviction that does not fit in the ring is dropped
  (counted), never waited for. A queued value is found by `lookup` (a copy) until its file is written, so a read
  never sees an older file than the newest value.
* Record file: `HEADER_BYTES` header (magic 'EMSD', version, key length, value length, sequence number, and an
  XXH3 over those fields, the key and the value's own 40-byte header), the full key (tenant prefix included), the
  EMS value; padded to `ALIGN` (O_DIRECT). The value's header carries the payload's checksum (`ems.store.value_format`),
  so the record's check and the value's check together cover every byte.
* Crash safety: a record is written to a temporary name and renamed into place only once fully written (and only
  while it is still the key's newest value: the rename and a put's `invalidate` are ordered by the lock), so a file
  under a record name was complete when it was named; a node killed mid-write leaves only temporary files, which
  the next start removes. Nothing is trusted on read: a record whose header, key, lengths or checksum do not match
  (a flipped byte, a truncated file) is a miss, and is dropped with its file.
* Names: `root/XX/<xxh3-128 of the key>-<sequence>-<file bytes>.rec` (XX: the hash's first byte; the numbers as 16
  hex digits, so every name has one length). `open()` rebuilds the index from the names alone (a listing of each
  folder, its names parsed in one vectorised pass, no file opened), oldest sequence first as the LRU order; where
  a key has two records (killed between naming the new one and dropping the old one) the newer wins. The index
  is keyed by the key's 128-bit hash and every read checks the full key, so a hash collision is a miss, and one
  tenant's record is never served under another tenant's key.
* Capacity: file bytes (padded) stay within `capacity_bytes`; writing evicts least recently used records first.
  The file of a dropped record is kept under a temporary name as a spare and overwritten by a later record of its
  size (cheaper than creating a file; spares count against the capacity and are dropped first when room is short).
  A full filesystem (ENOSPC, EDQUOT) is handled the same way: records are evicted one by one and the write tried
  again until it fits (else that value is dropped), and from then on the tier keeps within the bytes the
  filesystem held when it was full (until the node restarts). Never an error to a client.
* Failure: any other error of the disk (read-only filesystem, the directory removed, EIO on write) turns the tier
  off: one warning is logged, the index and the queue are emptied, and from then on `submit` drops and `lookup`
  misses (the node serves from DRAM only). A read error of one record while the directory is still there is that
  record's miss (dropped), not a failure of the tier.
* I/O: O_DIRECT with buffers aligned to `ALIGN` where the filesystem takes it (docs/pool-nodes.md says why), else
  buffered I/O. Reads land in a per-thread aligned bounce buffer; the caller copies the verified value out.
* Thread-safe: one lock guards the index, the queue, the spares and the counters; it is never held while record
  bytes are read or written (only across the rename that names a record, see Crash safety).
"""

from __future__ import annotations

import enum
import errno
import logging
import mmap
import os
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import xxhash

from ems.buffers import Buffer
from ems.pool.disk_io import WriteHelper
from ems.store.value_format import HEADER_SIZE, is_well_formed

log = logging.getLogger("ems.pool")

ALIGN = 4096
MAGIC = 0x44534D45  # b"EMSD" read as little-endian u32
RECORD_VERSION = 1
_HEADER = struct.Struct("<IHHQQQ")  # magic, version, key_len, value_len, seq, check
HEADER_BYTES = _HEADER.size  # 32
_CHECKED = struct.Struct("<IHHQQ")  # the fields the check covers (all but the check itself)
SUFFIX = ".rec"
TMP_SUFFIX = ".tmp"
BATCH_BYTES = 64 << 20  # a writer batch: at most this many queued bytes taken at once
BATCH_RECORDS = 64  # and at most this many records (one pipe message to the write helper)
# errors that mean "no room": handled as eviction, never as a failed disk
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


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


class _Record(NamedTuple):
    """One indexed record file (its path follows from its key hash and these: `DiskTier._path`)."""

    nbytes: int  # file bytes (padded)
    seq: int


def record_name(digest: bytes, seq: int, nbytes: int) -> str:
    """A record file's name: fixed width (`NAME_LENGTH`), so a folder's names are parsed in one vectorised pass."""
    return f"{digest.hex()}-{seq:016x}-{nbytes:016x}{SUFFIX}"


NAME_LENGTH = 32 + 1 + 16 + 1 + 16 + len(SUFFIX)
_HEX = np.full(256, 255, dtype=np.uint8)
_HEX[np.frombuffer(b"0123456789abcdef", dtype=np.uint8)] = np.arange(16, dtype=np.uint8)
_SHIFTS = np.arange(60, -4, -4, dtype=np.uint64)


def key_hash(key: bytes) -> bytes:
    return xxhash.xxh3_128_digest(key)


def record_bytes(key_len: int, value_len: int) -> int:
    """File bytes of a record: header, key and value, padded to ALIGN."""
    return -(-(HEADER_BYTES + key_len + value_len) // ALIGN) * ALIGN


def _record_check(fields: bytes, key: Buffer, value_header: Buffer) -> int:
    hasher = xxhash.xxh3_64()
    hasher.update(fields)
    hasher.update(key)
    hasher.update(value_header)
    return hasher.intdigest()


def aligned_buffer(nbytes: int) -> np.ndarray:
    """`nbytes` (a multiple of ALIGN) of page-aligned anonymous memory (O_DIRECT needs aligned buffers)."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, ALIGN)), dtype=np.uint8)[:nbytes]


def encode_record(target: np.ndarray, key: bytes, value: Buffer, seq: int) -> int:
    """Write the record of (key, value) into `target` (at least `record_bytes` long); returns its file bytes."""
    view = np.frombuffer(value, dtype=np.uint8)
    fields = _CHECKED.pack(MAGIC, RECORD_VERSION, len(key), view.size, seq)
    check = _record_check(fields, key, view[:HEADER_SIZE].data)
    nbytes = record_bytes(len(key), view.size)
    target[:HEADER_BYTES] = np.frombuffer(fields + struct.pack("<Q", check), dtype=np.uint8)
    target[HEADER_BYTES : HEADER_BYTES + len(key)] = np.frombuffer(key, dtype=np.uint8)
    start = HEADER_BYTES + len(key)
    target[start : start + view.size] = view
    target[start + view.size : nbytes] = 0  # padding: no stale bytes of an earlier record on disk
    return nbytes


def decode_record(data: np.ndarray, key: bytes) -> np.ndarray | None:
    """The value in record bytes `data` when it is a whole, undamaged record of `key`, else None."""
    if data.size < HEADER_BYTES:
        return None
    magic, version, key_len, value_len, seq, check = _HEADER.unpack(data[:HEADER_BYTES].tobytes())
    start = HEADER_BYTES + key_len
    if magic != MAGIC or version != RECORD_VERSION or key_len != len(key) or start + value_len > data.size:
        return None
    if value_len < HEADER_SIZE or data[HEADER_BYTES:start].tobytes() != key:
        return None
    value = data[start : start + value_len]
    fields = _CHECKED.pack(magic, version, key_len, value_len, seq)
    if _record_check(fields, key, value[:HEADER_SIZE].data) != check or not is_well_formed(value.data):
        return None
    return value


def parse_names(names: Sequence[str]) -> tuple[list[bytes], np.ndarray, np.ndarray, np.ndarray]:
    """The record names among `names`: (key hashes, sequences u64, file bytes u64, their positions in `names`),
    parsed in one vectorised pass (a restart parses every record's name). Any other name is left out."""
    positions = np.flatnonzero(np.fromiter(map(len, names), dtype=np.int64, count=len(names)) == NAME_LENGTH)
    joined = "".join([names[i] for i in positions.tolist()])
    if not joined.isascii():  # not ours (our names are hex): parse the ASCII ones only
        ascii_positions = [i for i in positions.tolist() if names[i].isascii()]
        positions = np.asarray(ascii_positions, dtype=np.int64)
        joined = "".join([names[i] for i in ascii_positions])
    chars = np.frombuffer(joined.encode("ascii"), dtype=np.uint8).reshape(-1, NAME_LENGTH)
    digits = _HEX[chars]
    hex_columns = np.r_[0:32, 33:49, 50:66]
    ok = (
        (digits[:, hex_columns] != 255).all(axis=1)
        & (chars[:, 32] == ord("-"))
        & (chars[:, 49] == ord("-"))
        & (chars[:, 66:] == np.frombuffer(SUFFIX.encode(), dtype=np.uint8)).all(axis=1)
    )
    digits, positions = digits[ok], positions[ok]
    raw = (digits[:, 0:32:2] << 4 | digits[:, 1:32:2]).tobytes()
    hashes = [raw[i : i + 16] for i in range(0, len(raw), 16)]
    seqs = (digits[:, 33:49].astype(np.uint64) << _SHIFTS).sum(axis=1, dtype=np.uint64)
    sizes = (digits[:, 50:66].astype(np.uint64) << _SHIFTS).sum(axis=1, dtype=np.uint64)
    return hashes, seqs, sizes, positions


class _Job:
    """One record of a writer batch."""

    __slots__ = ("digest", "error", "key", "path", "reuse", "slot", "tmp")

    def __init__(self, key: bytes, digest: bytes, slot: _Slot, reuse: str | None, path: str) -> None:
        self.key = key
        self.digest = digest
        self.slot = slot
        self.reuse = reuse  # a file of the record's size to overwrite (a spare, or a record just evicted), or None
        self.path = path
        self.tmp = path[: -len(SUFFIX)] + TMP_SUFFIX
        self.error: OSError | None = None


class _DiskFailed(Exception):
    """The disk can no longer be used (the tier turns off)."""


class _Slot:
    """One queued record in the write ring: `nbytes` at `start`, the key's newest value while `live`."""

    __slots__ = ("live", "nbytes", "seq", "start", "value_len")

    def __init__(self, start: int, nbytes: int, value_len: int, seq: int) -> None:
        self.start = start
        self.nbytes = nbytes
        self.value_len = value_len
        self.seq = seq
        self.live = True


class _WriteRing:
    """The write queue's memory: one aligned mapping of records, allocated at the head and freed at the tail in
    the order they were queued (a slot that is no longer live waits until the slots before it are freed)."""

    def __init__(self, nbytes: int) -> None:
        self.size = max(ALIGN, nbytes // ALIGN * ALIGN)
        # a memfd, so the write helper process maps the same pages
        self.fd = os.memfd_create("ems-disk-ring", getattr(os, "MFD_CLOEXEC", 0))
        os.ftruncate(self.fd, self.size)
        self.memory = np.frombuffer(mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED), dtype=np.uint8)
        self.slots: deque[_Slot] = deque()
        self.head = 0
        self.live_bytes = 0

    def take(self, nbytes: int, value_len: int, seq: int) -> _Slot | None:
        """A slot of `nbytes` (a multiple of ALIGN), or None when the ring has no room for it now."""
        while self.slots and not self.slots[0].live:  # slots the writer is done with, or dropped
            self.slots.popleft()
        if not self.slots:
            self.head = 0
        if self.slots:
            tail = self.slots[0].start
            if self.head > tail:  # free: [head, size) then [0, tail)
                start = self.head if self.head + nbytes <= self.size else (0 if nbytes <= tail else -1)
            else:  # wrapped (free: [head, tail)), or full (head == tail)
                start = self.head if self.head + nbytes <= tail else -1
        else:
            start = 0 if nbytes <= self.size else -1
        if start < 0:
            return None
        slot = _Slot(start, nbytes, value_len, seq)
        self.slots.append(slot)
        self.head = (start + nbytes) % self.size
        self.live_bytes += nbytes
        return slot

    def release(self, slot: _Slot) -> None:
        if slot.live:
            slot.live = False
            self.live_bytes -= slot.nbytes

    def view(self, slot: _Slot) -> np.ndarray:
        return self.memory[slot.start : slot.start + slot.nbytes]


class DiskTier:
    """Values on a local disk behind a node's DRAM; see the module docstring."""

    def __init__(self, root: str, capacity_bytes: int, queue_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the disk capacity must be > 0, got {capacity_bytes}")
        self.root = os.path.abspath(root)
        self.capacity_bytes = capacity_bytes
        self._limit = capacity_bytes  # lowered to what the filesystem held when it was found full
        self.queue_bytes = queue_bytes
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._index: OrderedDict[bytes, _Record] = OrderedDict()  # key hash -> record, LRU first
        # key -> its newest record waiting to be written (in the ring), oldest first
        self._queue: OrderedDict[bytes, _Slot] = OrderedDict()
        self._ring = _WriteRing(queue_bytes)
        self._used = 0
        # files of dropped records kept (under temporary names) to be overwritten by later records of their size:
        # overwriting an allocated file costs a third of creating one (measured: docs/pool-nodes.md)
        self._spare: dict[int, list[str]] = {}
        self._spare_bytes = 0
        self._seq = 0
        self._stats = DiskTierStats(capacity_bytes=capacity_bytes)
        self._direct = 0
        self._local = threading.local()
        self._writer: threading.Thread | None = None
        self._helper: WriteHelper | None = None
        self._closing = False

    # ---- life cycle ----

    def open(self) -> None:
        """Create the directories, choose the I/O mode, rebuild the index from the record names, start the writer.
        OSError when the directory cannot be used at all (the caller decides: the node refuses to start)."""
        start = time.perf_counter()
        os.makedirs(self.root, exist_ok=True)
        for i in range(256):
            os.makedirs(os.path.join(self.root, f"{i:02x}"), exist_ok=True)
        self._direct = self._probe_direct()
        stale: list[str] = []
        hashes: list[bytes] = []
        seq_parts, size_parts = [], []
        for i in range(256):
            folder = os.path.join(self.root, f"{i:02x}")
            names = os.listdir(folder)
            # a write cut short: never named, never served
            stale += [os.path.join(folder, n) for n in names if n.endswith(TMP_SUFFIX)]
            found, seqs, sizes, _ = parse_names(names)
            hashes += found
            seq_parts.append(seqs)
            size_parts.append(sizes)
        seqs = np.concatenate(seq_parts)
        order = np.argsort(seqs, kind="stable")  # oldest first: the LRU order
        ordered_hashes = [hashes[j] for j in order.tolist()]
        records = list(map(_Record._make, zip(np.concatenate(size_parts)[order].tolist(), seqs[order].tolist())))
        ordered = dict(zip(ordered_hashes, records))  # a key written twice: the newer wins
        if len(ordered) < len(records):  # killed between naming a new record and dropping the old one
            kept = {id(r) for r in ordered.values()}
            stale += [self._path(h, r) for h, r in zip(ordered_hashes, records) if id(r) not in kept]
        with self._lock:
            self._index.update(ordered)
            self._used += sum(record.nbytes for record in ordered.values())
            self._seq = max(self._seq, int(seqs.max()) if seqs.size else 0)
            stale += self._evict_to(self.capacity_bytes)
            self._stats.restored_values = len(self._index)
            self._stats.restored_bytes = self._used
            self._stats.direct_io = bool(self._direct)
        _unlink_all(stale)
        self._stats.restore_seconds = time.perf_counter() - start
        log.info(
            "disk tier at %s: %d values, %d bytes restored in %.3f s (%s I/O)",
            self.root,
            self._stats.restored_values,
            self._stats.restored_bytes,
            self._stats.restore_seconds,
            "O_DIRECT" if self._direct else "buffered",
        )
        self._helper = WriteHelper(self._ring.fd, self._ring.size, bool(self._direct))
        self._writer = threading.Thread(target=self._write_loop, name="ems-pool-disk-writer", daemon=True)
        self._writer.start()

    def _probe_direct(self) -> int:
        """os.O_DIRECT when the filesystem takes it (tmpfs before Linux 6.6 and some others refuse it), else 0."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return 0
        path = os.path.join(self.root, f"probe{TMP_SUFFIX}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o600)
            try:
                os.pwrite(fd, aligned_buffer(ALIGN).data, 0)
            finally:
                os.close(fd)
            return flag
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            return 0
        finally:
            _unlink_all([path])

    def close(self) -> None:
        """Stop the writer (values still queued are not written: a cache) and let go of the files."""
        with self._lock:
            self._closing = True
            self._wake.notify_all()
        if self._writer is not None:
            self._writer.join(timeout=10)
            self._writer = None
        if self._helper is not None:
            self._helper.close()
            self._helper = None

    @property
    def up(self) -> bool:
        return self._stats.state is TierState.UP

    # ---- the caller's side: never any I/O ----

    def submit(self, key: bytes, value: Buffer) -> None:
        """Queue a value evicted from DRAM for writing (see the module docstring): its record is encoded into the
        write ring at once (a copy, so DRAM reuses the evicted buffer straight away), never any I/O here."""
        nbytes = memoryview(value).nbytes
        digest = key_hash(key)
        size = record_bytes(len(key), nbytes)
        with self._lock:
            if self._stats.state is not TierState.UP:
                return
            if key not in self._queue and digest in self._index:
                # A value on disk and in DRAM at once is the same value (a put of the key drops the record first,
                # `invalidate`): already written, it only becomes recently used.
                self._index.move_to_end(digest)
                return
            old = self._queue.pop(key, None)
            if old is not None:
                self._ring.release(old)
            slot = self._ring.take(size, nbytes, self._seq + 1) if size <= self.capacity_bytes else None
            if slot is None:
                self._stats.dropped_writes += 1
                return
            self._seq += 1
            encode_record(self._ring.view(slot), key, value, slot.seq)
            self._queue[key] = slot
            self._wake.notify()

    def invalidate(self, key: bytes) -> None:
        """A new value of `key` is being stored in DRAM: what this tier holds of it is stale from now on."""
        digest = key_hash(key)
        with self._lock:
            old = self._queue.pop(key, None)
            if old is not None:
                self._ring.release(old)
            record = self._index.pop(digest, None)
            if record is not None:
                self._used -= record.nbytes
                self._spare_bytes += record.nbytes
        if record is not None:  # renamed away before the put goes on: a restart can never find the old value
            self._keep_spare(self._path(digest, record), record.nbytes)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._queue or key_hash(key) in self._index for key in keys]

    def still_current(self, key: bytes, token: object) -> bool:
        """Whether what `lookup` returned with `token` is still this tier's newest value of `key`."""
        with self._lock:
            return self._queue.get(key) is token or self._index.get(key_hash(key)) is token

    # ---- reads (the caller's thread: the server runs them off its event loop) ----

    def lookup(self, key: bytes) -> tuple[Buffer | None, object]:
        """(value, token) when this tier holds `key`: a queued value (a copy), or a verified record's value in this
        thread's bounce buffer (valid until this thread's next `lookup`: copy it out); (None, None) on a miss."""
        digest = key_hash(key)
        with self._lock:
            if self._stats.state is not TierState.UP:
                return None, None
            queued = self._queue.get(key)
            if queued is not None:  # copied out under the lock: the writer frees the slot once written
                self._stats.hits += 1
                start = HEADER_BYTES + len(key)
                return self._ring.view(queued)[start : start + queued.value_len].tobytes(), queued
            record = self._index.get(digest)
            if record is None:
                return None, None
            self._index.move_to_end(digest)
        started = time.perf_counter()
        try:
            data = self._read(self._path(digest, record), record.nbytes)
        except OSError as error:
            if not os.path.isdir(self.root):
                self._fail(error)
                return None, None
            data = None
            with self._lock:
                self._stats.io_errors += 1
            log.warning("disk tier: cannot read %s (%s): dropped", self._path(digest, record), error)
        value = decode_record(data, key) if data is not None else None
        with self._lock:
            self._stats.reads += 1
            self._stats.read_seconds += time.perf_counter() - started
            doomed = []
            if value is None and self._index.get(digest) is record:  # (else it was dropped, and maybe its file
                self._stats.integrity_errors += data is not None  # reused, while this read ran: a plain miss)
                del self._index[digest]
                self._used -= record.nbytes
                doomed = [self._path(digest, record)]
            if value is not None:
                self._stats.hits += 1
                self._stats.read_bytes += record.nbytes
        if value is None:
            if doomed and data is not None:
                log.warning("disk tier: record %s is damaged or not the key's: dropped", self._path(digest, record))
            _unlink_all(doomed)
            return None, None
        return value.data, record

    def _path(self, digest: bytes, record: _Record) -> str:
        return os.path.join(self.root, f"{digest[0]:02x}", record_name(digest, record.seq, record.nbytes))

    def _read(self, path: str, nbytes: int) -> np.ndarray | None:
        """The record file's bytes (a truncated file: the bytes there are), in this thread's bounce buffer."""
        bounce: np.ndarray | None = getattr(self._local, "bounce", None)
        if bounce is None or bounce.size < nbytes:
            bounce = aligned_buffer(max(nbytes, 1 << 20))
            self._local.bounce = bounce
        fd = os.open(path, os.O_RDONLY | self._direct)
        try:
            got = os.preadv(fd, [bounce.data[:nbytes]], 0)
        finally:
            os.close(fd)
        return bounce[:got]

    # ---- the writer thread ----

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._wake.wait()
                if self._closing or self._stats.state is not TierState.UP:
                    return
                jobs: list[_Job] = []
                doomed: list[str] = []
                taken = 0
                for key, slot in self._queue.items():
                    digest = key_hash(key)
                    # a record that does not fit beside the batch's others waits for the next batch
                    fits, reuse, dropped = self._reserve(slot.nbytes, overshoot=not jobs)
                    doomed += dropped
                    if not fits:
                        break
                    path = os.path.join(self.root, f"{digest[0]:02x}", record_name(digest, slot.seq, slot.nbytes))
                    jobs.append(_Job(key, digest, slot, reuse, path))
                    taken += slot.nbytes
                    if taken >= BATCH_BYTES or len(jobs) >= BATCH_RECORDS:
                        break
            _unlink_all(doomed)
            try:
                self._write_jobs(jobs)
            except _DiskFailed:
                return

    def _write_jobs(self, jobs: list[_Job]) -> None:
        """Write a batch through the helper (one round trip) and name what was written. What found the filesystem
        full is then retried one record at a time, dropping least recently used records until it fits (else it is
        dropped), and from then on the tier keeps within what the filesystem held (`_limit`)."""
        started = time.perf_counter()
        codes = self._helper_write(jobs)
        full = [job for job, code in zip(jobs, codes) if code in _FULL_ERRNOS]
        with self._lock:  # what is on the disk now: the reservations of the jobs that failed are not
            on_disk = self._used + self._spare_bytes - sum(job.slot.nbytes for job in full)
            if full:
                self._limit = max(ALIGN, min(self._limit, on_disk))
        seconds = (time.perf_counter() - started) / len(jobs)
        self._finish_all([(job, code) for job, code in zip(jobs, codes) if code not in _FULL_ERRNOS], seconds)
        for job in full:  # the batch's other records are indexed by now: they can make room too (LRU first)
            job.reuse = None
            code = errno.ENOSPC
            while code in _FULL_ERRNOS:
                with self._lock:
                    doomed = self._drop_spares(1) or self._evict_to(self._used - 1, count=1)
                if not doomed:  # nothing left to make room with: this value is dropped
                    break
                _unlink_all(doomed)
                started = time.perf_counter()
                code = self._helper_write([job])[0]
            self._finish_all([(job, code)], time.perf_counter() - started)

    def _finish_all(self, done: list[tuple[_Job, int]], seconds: float) -> None:
        """`_finish` each written job; a disk error turns the tier off (`_DiskFailed`)."""
        failure = next((code for _, code in done if code and code not in _FULL_ERRNOS), 0)
        spares: list[tuple[str, int]] = []
        renamed_error: OSError | None = None
        with self._lock:
            for job, code in done:
                spares += self._finish(job, code, seconds)
                if job.error is not None:
                    renamed_error = job.error
        for path, nbytes in spares:
            self._keep_spare(path, nbytes)
        if failure or renamed_error is not None:
            self._fail(renamed_error or OSError(failure, os.strerror(failure)))
            raise _DiskFailed()

    def _helper_write(self, jobs: list[_Job]) -> list[int]:
        if self._helper is None:
            raise _DiskFailed()
        try:
            return self._helper.write_batch([(job.slot.start, job.slot.nbytes, job.reuse or "", job.tmp) for job in jobs])
        except OSError as error:
            with self._lock:
                for job in jobs:
                    self._used -= job.slot.nbytes
            self._fail(error)
            raise _DiskFailed() from error

    def _finish(self, job: _Job, code: int, seconds: float) -> list[tuple[str, int]]:
        """After the helper wrote `job` (errno `code`), with the lock held: name the record when it is still the
        key's newest value, else keep its file as a spare. Returns records whose files become spares."""
        nbytes = job.slot.nbytes
        self._used -= nbytes
        current = self._queue.get(job.key) is job.slot and self._stats.state is TierState.UP
        if current:
            del self._queue[job.key]
            self._ring.release(job.slot)
        if code:
            self._stats.dropped_writes += 1
            self._stats.io_errors += 1
            return []
        self._stats.writes += 1
        self._stats.write_bytes += nbytes
        self._stats.write_seconds += seconds
        if not current:  # superseded while written: the file is a spare as it is
            self._spare.setdefault(nbytes, []).append(job.tmp)
            self._spare_bytes += nbytes
            return []
        # Named under the lock: a put of the key (`invalidate`) comes either before (then this record is never
        # named) or after (then it finds the record and removes it), never in between.
        try:
            os.rename(job.tmp, job.path)
        except OSError as error:
            job.error = error
            _unlink_all([job.tmp])
            return []
        old = self._index.pop(job.digest, None)
        if old is not None:
            self._used -= old.nbytes
            self._spare_bytes += old.nbytes
        self._index[job.digest] = _Record(nbytes, job.slot.seq)
        self._used += nbytes
        return [(self._path(job.digest, old), old.nbytes)] if old is not None else []

    def _keep_spare(self, path: str, nbytes: int) -> None:
        """Rename a dropped record's file to a temporary name and keep it as a spare (its bytes already moved from
        used to spare under the lock)."""
        spare = path[: -len(SUFFIX)] + TMP_SUFFIX
        try:
            os.rename(path, spare)
        except OSError:
            with self._lock:
                self._spare_bytes -= nbytes
            _unlink_all([path])
            return
        with self._lock:
            self._spare.setdefault(nbytes, []).append(spare)

    # ---- capacity and failure (lock held where said) ----

    def _reserve(self, nbytes: int, overshoot: bool) -> tuple[bool, str | None, list[str]]:
        """Room for a record of `nbytes` (lock held): (whether it was reserved; a file of that size to overwrite,
        or None to create one; the paths to unlink once the lock is released, in every case). Spares of the size
        first, then free room, then spares of other sizes are dropped and least recently used records evicted (one
        of the size is overwritten). When nothing is left to drop (the rest is being written) it is not reserved,
        unless `overshoot`."""
        doomed: list[str] = []
        while True:
            spares = self._spare.get(nbytes)
            if spares:
                self._spare_bytes -= nbytes
                self._used += nbytes
                return True, spares.pop(), doomed
            if self._used + self._spare_bytes + nbytes <= self._limit:
                self._used += nbytes
                return True, None, doomed
            dropped = self._drop_spares(1, keep=nbytes)
            if dropped:
                doomed += dropped
                continue
            if not self._index:  # nothing left to drop: the rest is being written (or a spare being renamed)
                if overshoot:
                    self._used += nbytes
                return overshoot, None, doomed
            digest, record = self._index.popitem(last=False)
            self._used -= record.nbytes
            self._stats.evictions += 1
            if record.nbytes == nbytes:
                self._used += nbytes
                return True, self._path(digest, record), doomed
            doomed.append(self._path(digest, record))

    def _drop_spares(self, count: int, keep: int = -1) -> list[str]:
        """Forget up to `count` spares (0: all) of sizes other than `keep` (lock held); their paths to unlink."""
        dropped: list[str] = []
        for size, paths in self._spare.items():
            while paths and size != keep and (count == 0 or len(dropped) < count):
                dropped.append(paths.pop())
                self._spare_bytes -= size
        return dropped

    def _evict_to(self, limit: int, count: int = -1) -> list[str]:
        """Drop least recently used records (at most `count` of them, -1: no limit) until the bytes used are at most
        `limit` (lock held); returns the paths to unlink once the lock is released."""
        doomed: list[str] = []
        while self._used > limit and self._index and len(doomed) != count:
            digest, record = self._index.popitem(last=False)
            self._used -= record.nbytes
            self._stats.evictions += 1
            doomed.append(self._path(digest, record))
        return doomed

    def _fail(self, error: OSError) -> None:
        with self._lock:
            if self._stats.state is not TierState.UP:
                return
            self._stats.state = TierState.FAILED
            self._stats.io_errors += 1
            self._index.clear()
            for slot in self._queue.values():
                self._ring.release(slot)
            self._queue.clear()
            self._used = 0
            self._spare.clear()
            self._spare_bytes = 0
            self._wake.notify_all()
        log.warning("disk tier at %s failed (%s): this node now serves from DRAM only", self.root, error)

    def stats(self) -> DiskTierStats:
        with self._lock:
            self._stats.used_bytes = self._used
            self._stats.spare_bytes = self._spare_bytes
            self._stats.values = len(self._index)
            self._stats.queued_values = len(self._queue)
            self._stats.queued_bytes = self._ring.live_bytes
            return DiskTierStats(**vars(self._stats))


def _unlink_all(paths: Sequence[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError:  # already gone, or the disk failed: nothing to do either way
            pass

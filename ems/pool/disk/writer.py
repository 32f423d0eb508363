"""The disk tier's writer thread: takes the write queue in batches, has the write helper process write them, and
names what was written.

Contract:
* One thread (`start`, `stop`). It takes queued records oldest first in batches (`BATCH_RECORDS`, `BATCH_BYTES`),
  reserving room for each in the index (`DiskIndex.reserve`: a spare file of its size, free room, or least recently
  used records evicted; a record that does not fit beside the batch's others waits for the next batch), and hands
  the batch to the write helper (`ems.pool.disk.helper`) in one round trip, each record to a temporary name.
* Naming (`finish`, with the tier's lock held across the rename): a written record is renamed into place only while
  it is still its key's newest value; a put's `invalidate` then comes either before (the record is never named:
  its file becomes a spare) or after (it finds the record and removes it), never in between. The key's older
  record becomes a spare.
* A full filesystem (ENOSPC, EDQUOT) is eviction: the records that found it full are retried one at a time, a spare
  or the least recently used record dropped before each try, until it fits (else that value is dropped), and from
  then on the index keeps within what the filesystem held (`DiskIndex.found_full`). Any other error of a write, of
  a rename, or the helper gone turns the tier off (`DiskState.fail`) and ends the thread.
* Locks: the tier's lock (`DiskState.lock`) is taken to pick a batch, to account for what was written and to name
  it; never while the helper writes. Files to unlink or to keep as spares are handled after it is released.
"""

from __future__ import annotations

import errno
import os
import threading
import time

from ems.pool.disk.files import unlink_all
from ems.pool.disk.helper import WriteHelper
from ems.pool.disk.index import IndexedRecord
from ems.pool.disk.records import key_hash, record_path, temporary_path
from ems.pool.disk.ring import RingSlot
from ems.pool.disk.state import DiskState

BATCH_BYTES = 64 << 20  # a writer batch: at most this many queued bytes taken at once
BATCH_RECORDS = 64  # and at most this many records (one pipe message to the write helper)
# errors that mean "no room": handled as eviction, never as a failed disk
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class _DiskWrite:
    """One record of a writer batch."""

    __slots__ = ("digest", "error", "key", "path", "reuse", "slot", "tmp")

    def __init__(self, key: bytes, digest: bytes, slot: RingSlot, reuse: str | None, path: str) -> None:
        self.key = key
        self.digest = digest
        self.slot = slot
        self.reuse = reuse  # a file of the record's size to overwrite (a spare, or a record just evicted), or None
        self.path = path
        self.tmp = temporary_path(path)
        self.error: OSError | None = None


class _DiskFailed(Exception):
    """The disk can no longer be used (the tier turns off)."""


class DiskWriter:
    """The writer thread of a `DiskTier`; see the module docstring."""

    def __init__(self, state: DiskState, direct: bool) -> None:
        self._state = state
        self._helper: WriteHelper | None = WriteHelper(state.queue.ring.fd, state.queue.ring.size, direct)
        self._thread = threading.Thread(target=self._loop, name="ems-pool-disk-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (what is still queued is not written: a cache) and the helper."""
        state = self._state
        with state.lock:
            state.closing = True
            state.wake.notify_all()
        self._thread.join(timeout=10)
        if self._helper is not None:
            self._helper.close()
            self._helper = None

    def _loop(self) -> None:
        state = self._state
        while True:
            with state.lock:
                while not len(state.queue) and not state.closing:
                    state.wake.wait()
                if state.closing or not state.up:
                    return
                jobs, doomed = self._take_batch()
            unlink_all(doomed)
            try:
                self._write(jobs)
            except _DiskFailed:
                return

    def _take_batch(self) -> tuple[list[_DiskWrite], list[str]]:
        """The next batch, room reserved for each (lock held); and the paths to unlink once it is released."""
        state = self._state
        jobs: list[_DiskWrite] = []
        doomed: list[str] = []
        taken = 0
        for key, slot in state.queue.items():
            digest = key_hash(key)
            # a record that does not fit beside the batch's others waits for the next batch
            fits, reuse, dropped = state.index.reserve(slot.nbytes, overshoot=not jobs)
            doomed += dropped
            if not fits:
                break
            jobs.append(_DiskWrite(key, digest, slot, reuse, record_path(state.root, digest, slot.seq, slot.nbytes)))
            taken += slot.nbytes
            if taken >= BATCH_BYTES or len(jobs) >= BATCH_RECORDS:
                break
        return jobs, doomed

    def _write(self, jobs: list[_DiskWrite]) -> None:
        """Write a batch through the helper (one round trip) and name what was written; what found the filesystem
        full is then retried one record at a time (see the module docstring)."""
        state = self._state
        started = time.perf_counter()
        codes = self._helper_write(jobs)
        full = [job for job, code in zip(jobs, codes) if code in FULL_ERRNOS]
        if full:
            with state.lock:  # what is on the disk now: the reservations of the jobs that failed are not
                state.index.found_full(sum(job.slot.nbytes for job in full))
        seconds = (time.perf_counter() - started) / len(jobs)
        self._finish_all([(job, code) for job, code in zip(jobs, codes) if code not in FULL_ERRNOS], seconds)
        for job in full:  # the batch's other records are indexed by now: they can make room too (LRU first)
            job.reuse = None
            code = errno.ENOSPC
            while code in FULL_ERRNOS:
                with state.lock:
                    doomed = state.index.make_room()
                if not doomed:  # nothing left to make room with: this value is dropped
                    break
                unlink_all(doomed)
                started = time.perf_counter()
                code = self._helper_write([job])[0]
            self._finish_all([(job, code)], time.perf_counter() - started)

    def _helper_write(self, jobs: list[_DiskWrite]) -> list[int]:
        if self._helper is None:
            raise _DiskFailed()
        try:
            return self._helper.write_batch([(job.slot.start, job.slot.nbytes, job.reuse or "", job.tmp) for job in jobs])
        except OSError as error:
            with self._state.lock:
                for job in jobs:
                    self._state.index.release(job.slot.nbytes)
            self._state.fail(error)
            raise _DiskFailed() from error

    def _finish_all(self, done: list[tuple[_DiskWrite, int]], seconds: float) -> None:
        """`_finish` each written job; a disk error turns the tier off (`_DiskFailed`)."""
        state = self._state
        failure = next((code for _, code in done if code and code not in FULL_ERRNOS), 0)
        spares: list[tuple[str, int]] = []
        renamed_error: OSError | None = None
        with state.lock:
            for job, code in done:
                old = self._finish(job, code, seconds)
                if old is not None:
                    spares.append(old)
                if job.error is not None:
                    renamed_error = job.error
        for path, nbytes in spares:
            state.keep_spare(path, nbytes)
        if failure or renamed_error is not None:
            state.fail(renamed_error or OSError(failure, os.strerror(failure)))
            raise _DiskFailed()

    def _finish(self, job: _DiskWrite, code: int, seconds: float) -> tuple[str, int] | None:
        """After the helper wrote `job` (errno `code`), with the lock held: name the record when it is still the
        key's newest value, else keep its file as a spare. Returns the record whose file becomes a spare, if any."""
        state = self._state
        nbytes = job.slot.nbytes
        state.index.release(nbytes)
        current = state.up and state.queue.done(job.key, job.slot)
        if code:
            state.stats.dropped_writes += 1
            state.stats.io_errors += 1
            return None
        state.stats.writes += 1
        state.stats.write_bytes += nbytes
        state.stats.write_seconds += seconds
        if not current:  # superseded while written: the file is a spare as it is
            state.index.add_spare(job.tmp, nbytes)
            return None
        # Named under the lock: a put of the key (`invalidate`) comes either before (then this record is never
        # named) or after (then it finds the record and removes it), never in between.
        try:
            os.rename(job.tmp, job.path)
        except OSError as error:
            job.error = error
            unlink_all([job.tmp])
            return None
        return state.index.insert(job.digest, IndexedRecord(nbytes, job.slot.seq))

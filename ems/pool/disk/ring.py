"""The disk tier's write queue: records waiting to be written, encoded into one ring of shared memory.

Contract:
* `WriteRing`: `size` bytes of aligned memory (a memfd, so the write helper process maps the same pages), handed out
  as slots at the head and freed at the tail in the order they were taken (a slot released early waits until the
  slots before it are freed). `take` refuses (None) when no free run of the length exists now; it never waits. Live
  slots never overlap.
* `WriteQueue`: per key its newest value waiting to be written, oldest first, each a record encoded into a slot at
  once (`add`: one copy, so DRAM reuses the evicted buffer straight away). A key queued again releases its older
  slot. The queue numbers the records it takes (`last_seq`, raised past what a restart found by `restore_seq`).
  A slot stays live (its bytes untouched) until `done` or `drop` releases it, so the helper reads whole records.
* Not thread-safe: the tier's lock (`ems.pool.disk.state.DiskState.lock`) guards both, on the callers' side and on
  the writer thread's. The helper reads a slot's bytes without the lock, while the slot is live.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict, deque
from collections.abc import ItemsView

import numpy as np

from ems.buffers import Buffer
from ems.pool.disk.records import ALIGN, encode_record, value_of


class RingSlot:
    """One queued record in the write ring: `nbytes` at `start`, the key's newest value while `live`."""

    __slots__ = ("live", "nbytes", "seq", "start", "value_len")

    def __init__(self, start: int, nbytes: int, value_len: int, seq: int) -> None:
        self.start = start
        self.nbytes = nbytes
        self.value_len = value_len
        self.seq = seq
        self.live = True


class WriteRing:
    """The write queue's memory; see the module docstring."""

    def __init__(self, nbytes: int) -> None:
        self.size = max(ALIGN, nbytes // ALIGN * ALIGN)
        # a memfd, so the write helper process maps the same pages
        self.fd = os.memfd_create("ems-disk-ring", getattr(os, "MFD_CLOEXEC", 0))
        os.ftruncate(self.fd, self.size)
        self.memory = np.frombuffer(mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED), dtype=np.uint8)
        self.slots: deque[RingSlot] = deque()
        self.head = 0
        self.live_bytes = 0

    def take(self, nbytes: int, value_len: int, seq: int) -> RingSlot | None:
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
        slot = RingSlot(start, nbytes, value_len, seq)
        self.slots.append(slot)
        self.head = (start + nbytes) % self.size
        self.live_bytes += nbytes
        return slot

    def release(self, slot: RingSlot) -> None:
        if slot.live:
            slot.live = False
            self.live_bytes -= slot.nbytes

    def view(self, slot: RingSlot) -> np.ndarray:
        return self.memory[slot.start : slot.start + slot.nbytes]


class WriteQueue:
    """Each key's newest value waiting to be written, in the ring; see the module docstring."""

    def __init__(self, nbytes: int) -> None:
        self.ring = WriteRing(nbytes)
        self._slots: OrderedDict[bytes, RingSlot] = OrderedDict()  # key -> its newest record, oldest first
        self.last_seq = 0  # the newest record's sequence number (names order records: the LRU order of a restart)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def get(self, key: bytes) -> RingSlot | None:
        return self._slots.get(key)

    def items(self) -> ItemsView[bytes, RingSlot]:
        """(key, slot), oldest first."""
        return self._slots.items()

    @property
    def live_bytes(self) -> int:
        return self.ring.live_bytes

    def restore_seq(self, seq: int) -> None:
        """Number the next records after `seq` (the newest a restart found on the disk)."""
        self.last_seq = max(self.last_seq, seq)

    def add(self, key: bytes, value: Buffer, nbytes: int) -> RingSlot | None:
        """Queue `value` as `key`'s newest, its record (`nbytes` of file, `record_bytes`) encoded into the ring; None
        (nothing queued) when the ring has no room for it now."""
        slot = self.ring.take(nbytes, memoryview(value).nbytes, self.last_seq + 1)
        if slot is None:
            return None
        self.last_seq += 1
        encode_record(self.ring.view(slot), key, value, slot.seq)
        self._slots[key] = slot
        return slot

    def drop(self, key: bytes) -> None:
        """Forget `key`'s queued value (stale, or to be replaced), if any; its slot is released."""
        old = self._slots.pop(key, None)
        if old is not None:
            self.ring.release(old)

    def done(self, key: bytes, slot: RingSlot) -> bool:
        """The writer is done with `slot`: it is released if it is still `key`'s newest value (True), else it was
        dropped or replaced already (False)."""
        if self._slots.get(key) is not slot:
            return False
        del self._slots[key]
        self.ring.release(slot)
        return True

    def value(self, key: bytes, slot: RingSlot) -> bytes:
        """A copy of the value queued in `slot` (the slot is freed once written: copy under the lock)."""
        return value_of(self.ring.view(slot), len(key), slot.value_len).tobytes()

    def clear(self) -> None:
        for slot in self._slots.values():
            self.ring.release(slot)
        self._slots.clear()

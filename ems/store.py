"""The key-value store behind every pool: the embedded pool and each pool node use this same code.

Contract:
* Keys are opaque `bytes` (the client has already folded tenant, model, rank and layout into them).
* A value is an EMS value (`value_format`): `put` refuses a malformed or damaged one (bad header, wrong length,
  wrong checksum), so a torn write is never stored.
* Capacity is a hard limit in bytes (keys, values, a fixed per-entry overhead, and spare buffers kept for reuse);
  when full, the least recently used entries are evicted. A value that alone exceeds the capacity is refused.
  Never an out-of-memory.
* `get` returns a read-only buffer that stays valid for as long as the caller holds it, evicted or not.
  `put_owned` stores a buffer the caller hands over without copying it (a pool node's receive buffer); the caller
  promises never to write to it again, and `get` then returns that buffer.
* Buffer reuse: `put` copies into a buffer recycled from an evicted value of the same size when one is free. Fresh
  memory costs page faults on first touch (measured here: a 1 MiB copy into new memory 1.7 GB/s, into reused
  memory 11 GB/s), and a full pool evicts as much as it stores, so reuse keeps the steady state at memcpy speed.
  New buffers are uninitialised numpy arrays: every byte is written before a value is stored, so zero-filling them
  would only add a pass.
  An evicted buffer is reused only when no reader still holds it (its reference count says so), so a reader never
  sees its bytes change. `allocate` hands such a buffer out with the evicted value's bytes (possibly another
  tenant's) still in it: its caller must overwrite every byte before `put_owned`, and a pool node does so only
  through receives whose length is verified (`transport.ucx_frames`), so old bytes are never stored again; the
  embedded pool's one-pass save does so by gathering every payload byte (its pieces cover every row of every plane
  of the value) and writing the header (`ems.jobs.SaveJob`).
* Arena (`prefault_bytes`): fresh buffers come first from one anonymous mapping reserved, advised for transparent
  huge pages (`madvise(MADV_HUGEPAGE)` where the kernel allows) and pre-faulted (every page written once) when the
  store is built, so a growing pool never pays first-touch page faults on the hot path. Its start-up cost is
  measured and reported (`StoreStats.prefault_seconds`; about the time to write those bytes once: ~0.1-0.3 s per
  GiB on a 2-core host). Arena buffers are handed out by bumping a pointer and recycled like any other buffer (by
  size); a spare dropped to make room is lost to the arena (the mapping lives as long as the store), which only
  happens when value sizes change. The arena's bytes are reserved memory, not charged to the capacity until
  values use them. 0 (the default) reserves nothing.
* Thread-safe: one lock, held only for index updates, never while checksumming or copying.
"""

from __future__ import annotations

import mmap
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ems.buffers import Buffer
from ems.value_format import VALUE_LEAD, is_well_formed

ENTRY_OVERHEAD = 96  # bytes charged per entry for the index, so many tiny values cannot exceed the capacity
# References to a retired value inside `_retire`: the caller's local, the parameter, getrefcount's argument.
_UNSHARED_REFCOUNT = 3


ARENA_ALIGN = 64  # cache line


def _new_buffer(nbytes: int) -> np.ndarray:
    """Uninitialised memory (no zero-filling pass: every byte is written before the value is stored), placed at
    `VALUE_LEAD` past a cache line: a view of a slightly larger array that nothing else holds."""
    raw = np.empty(nbytes + ARENA_ALIGN, dtype=np.uint8)
    skip = (VALUE_LEAD - raw.__array_interface__["data"][0]) % ARENA_ALIGN
    return raw[skip : skip + nbytes]


class _Arena:
    """One pre-faulted anonymous mapping, handed out by bumping a pointer (see the module docstring)."""

    def __init__(self, nbytes: int) -> None:
        start = time.perf_counter()
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            try:
                self._map.madvise(advice)
            except OSError:  # a kernel without transparent huge pages: plain pages, still pre-faulted
                pass
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.array[:: mmap.PAGESIZE] = 0  # write every page once: the faults happen here, not on the hot path
        self.size = nbytes
        self.used = 0
        self.prefault_seconds = time.perf_counter() - start

    def take(self, nbytes: int) -> Optional[np.ndarray]:
        """`nbytes` of pre-faulted memory, or None when the arena is used up (caller holds the store's lock)."""
        start = (self.used - VALUE_LEAD + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN + VALUE_LEAD
        if start + nbytes > self.size:
            return None
        self.used = start + nbytes
        return self.array[start : start + nbytes]


def _store_made(value: Buffer, arena: Optional[_Arena] = None) -> bool:
    """Whether `value` is a buffer of the kind this store makes (or a node received into): an array owning its
    memory, carved from the arena, or a `_new_buffer` view (its base owns its memory and is at most a cache line
    larger). Structural only: it says nothing about who else holds it."""
    if type(value) is not np.ndarray:
        return False
    base = value.base
    return (base is None or (arena is not None and base is arena.array)
            or (type(base) is np.ndarray and base.base is None and base.nbytes <= value.nbytes + ARENA_ALIGN))


def _recyclable(value: Buffer, arena: Optional[_Arena] = None) -> bool:
    """A store-made buffer whose memory nobody else can reach through its base: a `_new_buffer` view's base is held
    by the view alone (references: the view's own, getrefcount's argument, and `base` here). The caller checks the
    buffer's own references (`_retire`). Called with the store's lock held, so two checks never race."""
    if not _store_made(value, arena):
        return False
    base = value.base  # type: ignore[union-attr]
    return base is None or base is getattr(arena, "array", None) or sys.getrefcount(base) <= 3


@dataclass
class StoreStats:
    entries: int = 0
    used_bytes: int = 0
    capacity_bytes: int = 0
    puts: int = 0
    rejected_puts: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    spare_bytes: int = 0
    reused_buffers: int = 0
    arena_bytes: int = 0
    arena_used_bytes: int = 0
    prefault_seconds: float = 0.0


class KvStore:
    """A bounded, thread-safe LRU store of EMS values."""

    def __init__(self, capacity_bytes: int, verify_on_put: bool = True, prefault_bytes: int = 0) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if prefault_bytes < 0:
            raise ValueError(f"prefault_bytes must be >= 0, got {prefault_bytes}")
        self._arena = _Arena(min(prefault_bytes, capacity_bytes)) if prefault_bytes > 0 else None
        self._capacity = capacity_bytes
        self._verify_on_put = verify_on_put
        self._entries: "OrderedDict[bytes, Buffer]" = OrderedDict()
        self._used = 0  # charges of stored entries and of reservations being filled
        self._spare: dict[int, list[np.ndarray]] = {}  # evicted buffers free for reuse, by size
        self._spare_bytes = 0
        self._lock = threading.Lock()
        self._stats = StoreStats(capacity_bytes=capacity_bytes)
        if self._arena is not None:
            self._stats.arena_bytes = self._arena.size
            self._stats.prefault_seconds = self._arena.prefault_seconds

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @staticmethod
    def _charge(key: bytes, value: Buffer) -> int:
        return len(key) + memoryview(value).nbytes + ENTRY_OVERHEAD

    # ---- memory accounting (all under the lock) ----

    def _retire(self, value: Buffer) -> None:
        """A value left the index: keep its buffer as a spare when nobody else holds it."""
        if _recyclable(value, self._arena) and sys.getrefcount(value) <= _UNSHARED_REFCOUNT:
            self._spare.setdefault(len(value), []).append(value)
            self._spare_bytes += len(value)

    def _drop_spare(self, keep_size: int) -> bool:
        """Free one spare buffer, preferring sizes other than `keep_size`; False if there is none to drop."""
        for size, buffers in self._spare.items():
            if buffers and (size != keep_size or len(buffers) > 1):
                buffers.pop()
                self._spare_bytes -= size
                return True
        return False

    def _make_room(self, charge: int, nbytes: int) -> None:
        """Evict (LRU first) and free spares until a value of `charge` fits, counting a reusable spare."""
        while True:
            reusable = nbytes if self._spare.get(nbytes) else 0
            if self._used + self._spare_bytes - reusable + charge <= self._capacity:
                return
            if self._drop_spare(nbytes):
                continue
            if not self._entries:  # nothing left to evict: a value up to the capacity fits by now
                return
            evicted_key, evicted = self._entries.popitem(last=False)
            self._used -= self._charge(evicted_key, evicted)
            self._stats.evictions += 1
            self._retire(evicted)

    def _remove(self, key: bytes) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._used -= self._charge(key, old)
            self._retire(old)

    # ---- writes ----

    def allocate(self, nbytes: int, reserve: int = 0) -> np.ndarray:
        """A writable buffer of `nbytes` for `put_owned`: a recycled spare of that size when there is one, else
        pre-faulted arena memory, else fresh memory. Its bytes are stale: the caller overwrites every one of them
        before anyone reads it (or gives it back with `recycle`).

        `reserve` > 0 (the charge the value will have, see `charge_of`): room is made first (evicting LRU entries,
        whose buffers of this size are then reused at once: the steady state of a full pool costs no fresh
        memory), and those bytes count as used until `put_owned(..., reserved=reserve)` or
        `recycle(..., reserved=reserve)` hands them back."""
        with self._lock:
            if reserve > 0:
                if reserve > self._capacity:
                    raise ValueError(f"a value of {reserve} bytes exceeds the store's capacity {self._capacity}")
                self._make_room(reserve, nbytes)
                self._used += reserve
            try:
                return self._take_buffer(nbytes)
            except BaseException:  # e.g. MemoryError: the reservation goes back
                self._used -= reserve
                raise

    @staticmethod
    def charge_of(key_len: int, nbytes: int) -> int:
        """What a value of `nbytes` under a key of `key_len` bytes counts against the capacity."""
        return key_len + nbytes + ENTRY_OVERHEAD

    def _take_buffer(self, nbytes: int) -> np.ndarray:
        """`allocate` with the lock held."""
        spares = self._spare.get(nbytes)
        if spares:
            self._spare_bytes -= nbytes
            self._stats.reused_buffers += 1
            return spares.pop()
        if self._arena is not None:
            buffer = self._arena.take(nbytes)
            if buffer is not None:
                return buffer
        return _new_buffer(nbytes)

    def recycle(self, buffer: np.ndarray, reserved: int = 0) -> None:
        """Give back a buffer from `allocate` that was never stored and that the caller no longer uses (kept as a
        spare when there is room), and the bytes `allocate` reserved for it."""
        with self._lock:
            self._used -= reserved
            if _recyclable(buffer, self._arena) and self._used + self._spare_bytes + len(buffer) <= self._capacity:
                self._spare.setdefault(len(buffer), []).append(buffer)
                self._spare_bytes += len(buffer)

    def put(self, key: bytes, parts: Sequence[Buffer]) -> bool:
        """Store the concatenation of `parts` under `key` (replacing any old value); False if refused."""
        views = [memoryview(p).cast("B") for p in parts]
        nbytes = sum(v.nbytes for v in views)
        charge = len(key) + nbytes + ENTRY_OVERHEAD
        if charge > self._capacity:
            with self._lock:
                self._stats.rejected_puts += 1
            return False
        with self._lock:
            self._remove(key)
            self._make_room(charge, nbytes)
            buffer = self._take_buffer(nbytes)
            self._used += charge  # reserved while the copy runs outside the lock
        try:
            target = memoryview(buffer)
            position = 0
            for view in views:
                target[position : position + view.nbytes] = view
                position += view.nbytes
            del target
            well_formed = not self._verify_on_put or is_well_formed(buffer)
        except BaseException:
            with self._lock:
                self._used -= charge
            raise
        with self._lock:
            self._used -= charge
            if not well_formed:
                self._stats.rejected_puts += 1
                self._retire(buffer)
                return False
            self._insert(key, buffer, charge)
        return True

    def put_owned(self, key: bytes, value: Buffer, reserved: int = 0) -> bool:
        """Store `value` itself (no copy) under `key`; the caller never writes to it again. False if refused.
        `reserved`: the bytes `allocate` reserved for this value (released here, on every path)."""
        charge = self._charge(key, value)
        if charge > self._capacity or (self._verify_on_put and not is_well_formed(value)):
            with self._lock:
                self._used -= reserved
                self._stats.rejected_puts += 1
            return False
        with self._lock:
            self._used -= reserved
            self._insert(key, value, charge)
        return True

    def _insert(self, key: bytes, value: Buffer, charge: int) -> None:
        self._remove(key)
        self._make_room(charge, -1)
        self._entries[key] = value
        self._used += charge
        self._stats.puts += 1

    def put_many(self, keys: Sequence[bytes], values: Sequence[Sequence[Buffer]]) -> list[bool]:
        return [self.put(key, parts) for key, parts in zip(keys, values)]

    # ---- reads ----

    def get(self, key: bytes) -> Optional[Buffer]:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self._stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self._stats.hits += 1
        # a read-only view: holds the buffer (so it is never reused under the reader) and cannot write to it
        return memoryview(value).toreadonly() if _store_made(value, self._arena) else value

    def get_many(self, keys: Sequence[bytes]) -> list[Optional[Buffer]]:
        return [self.get(key) for key in keys]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._entries for key in keys]

    def delete(self, key: bytes) -> bool:
        with self._lock:
            if key not in self._entries:
                return False
            self._remove(key)
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._spare.clear()
            self._used = 0
            self._spare_bytes = 0

    def stats(self) -> StoreStats:
        with self._lock:
            self._stats.entries = len(self._entries)
            self._stats.used_bytes = self._used
            self._stats.spare_bytes = self._spare_bytes
            self._stats.arena_used_bytes = self._arena.used if self._arena is not None else 0
            return StoreStats(**vars(self._stats))

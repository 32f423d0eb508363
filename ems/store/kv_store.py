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
  memory costs page faults on first touch (a copy into new memory is several times slower than into reused
  memory: perf/RESULTS.md, "Figures behind design choices"), and a full pool evicts as much as it stores, so reuse
  keeps the steady state at memcpy speed.
  New buffers are uninitialised numpy arrays: every byte is written before a value is stored, so zero-filling them
  would only add a pass.
  An evicted buffer is reused only when no reader still holds it (its reference count says so), so a reader never
  sees its bytes change. `allocate` hands such a buffer out with the evicted value's bytes (possibly another
  tenant's) still in it: its caller must overwrite every byte before `put_owned`, and a pool node does so only
  through receives whose length is verified (`transport.ucx_frames`), so old bytes are never stored again; the
  embedded pool's one-pass save does so by gathering every payload byte (its pieces cover every row of every plane
  of the value) and writing the header (`ems.datapath.jobs.SaveJob`).
* Arena: fresh buffers come first from one anonymous mapping, advised for transparent huge pages
  (`madvise(MADV_HUGEPAGE)` where the kernel allows) and handed out by bumping a pointer, so the buffers of one
  request lie back to back (`allocate_many`) and the embedded pool's save copies into all of them at once. Its
  pages are faulted in before use, so a growing pool does not pay first-touch page faults on the hot path (measured
  on this project's VMs: 2 ms and more per MiB touched for the first time, against 0.1 ms to write it afterwards):
  `prefault_bytes` when the store is built (its cost is `StoreStats.prefault_seconds`: about the time to touch those
  bytes once), and with `prefault_ahead` > 0 by a background thread that keeps that many bytes faulted in past the
  bump pointer (`MADV_POPULATE_WRITE`, a system call that runs without the GIL; then the mapping spans the whole
  capacity as reserved address space, `MAP_NORESERVE`). Cost: `prefault_ahead` bytes of memory in use beyond what
  the values use, and one core busy for about as long as it takes to touch them, in the background after start-up;
  nothing on the caller's path (it goes in steps of `POPULATE_STEP`: other threads' mmap and munmap, which wait for
  the mmap lock a populate holds, wait at most one small step). Arena buffers are recycled like any other buffer (by
  size); a spare dropped to make room is lost to the arena (its pages go back to the system, `MADV_DONTNEED`), which
  only happens when value sizes change. The arena's bytes are not charged to the capacity until values use them. 0
  and 0 reserve nothing.
* Addresses: the store knows where every buffer it made lies (arena offsets; a spare or an entry keeps its buffer's
  address), so `allocate_many` returns each buffer's address with it and `get_many_with_addresses` each hit's (None
  for a buffer handed in by `put_owned`): the embedded jobs address a request's values together without reading each
  address back (about 0.75 µs a value through ctypes).
* `on_evict(key, value)` (optional): called with each value evicted to make room (not with overwritten or deleted
  ones), with the store's lock held: it must return at once and never call the store (a pool node's disk tier
  queues the value for writing). While it holds the value, its buffer is not reused.
* Holds (`ems.store.holds`): `hold_many(keys, hold)` leases or pins the keys the store has, within its budgets, and
  says which it holds and keeps; eviction passes held keys by while anything else can make room; a read (`get`,
  `get_many`, `get_many_with_addresses`) of a leased key releases one holder of its lease; a value that leaves the
  store takes its holds with it.
* Thread-safe: one lock, held only for index updates, never while checksumming or copying.
"""

from __future__ import annotations

import functools
import mmap
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeGuard

import numpy as np

from ems.buffers import POPULATE_STEP, Buffer, SpareCpuPacer, populate_pages, release_pages
from ems.kernels.host_copy import copy_buffers
from ems.kernels.raw_memory import address_of
from ems.store.holds import Holds
from ems.store.value_format import VALUE_LEAD, copy_well_formed_many, is_well_formed, well_formed_many
from ems.transport.holds import Hold

ENTRY_OVERHEAD = 96  # bytes charged per entry for the index, so many tiny values cannot exceed the capacity
# References to a retired value inside `_retire`: the caller's local, the parameter, getrefcount's argument.
_UNSHARED_REFCOUNT = 3


ARENA_ALIGN = 64  # cache line


def _new_buffer(nbytes: int) -> tuple[np.ndarray, int]:
    """Uninitialised memory (no zero-filling pass: every byte is written before the value is stored), placed at
    `VALUE_LEAD` past a cache line: a view of a slightly larger array that nothing else holds; and its address."""
    raw = np.empty(nbytes + ARENA_ALIGN, dtype=np.uint8)
    address = raw.__array_interface__["data"][0]
    skip = (VALUE_LEAD - address) % ARENA_ALIGN
    return raw[skip : skip + nbytes], address + skip


# A free buffer kept for reuse and its address (None: not known yet, e.g. a pool node's receive buffer).
_Spare = tuple[np.ndarray, "int | None"]


class _Arena:
    """One anonymous mapping of up to the store's capacity, handed out by bumping a pointer (see the module
    docstring). Pages are populated (faulted in) `prefault_bytes` at once when it is built and then, when
    `ahead` > 0, by a background thread that keeps `ahead` bytes populated past the bump pointer, so values
    are written into memory that is already there."""

    def __init__(self, nbytes: int, prefault_bytes: int = 0, ahead: int = 0) -> None:
        start = time.perf_counter()
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            try:
                self._map.madvise(advice)
            except OSError:  # a kernel without transparent huge pages: plain pages, still pre-faulted
                pass
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)
        self.size = nbytes
        self.used = 0
        self.ahead = ahead
        self.populated = 0  # bytes from the start known to be faulted in (grows only)
        self._wake = threading.Condition()
        self._closed = False
        self._populate(min(prefault_bytes, nbytes))
        self.prefault_seconds = time.perf_counter() - start
        if ahead > 0 and self.populated < nbytes:
            threading.Thread(target=self._populate_ahead, name="ems-arena-prefault", daemon=True).start()

    def _populate(self, end: int) -> None:
        """Fault in the pages up to `end` (page-rounded): MADV_POPULATE_WRITE where the kernel has it (a system call
        that runs without the GIL), else one write per page."""
        begin, end = self.populated, min(self.size, -(-end // mmap.PAGESIZE) * mmap.PAGESIZE)
        if end <= begin:
            return
        if not populate_pages(self.address + begin, end - begin):
            self.array[begin : end : mmap.PAGESIZE] = 0  # pages not yet handed out: nothing is overwritten
        self.populated = end

    def _populate_ahead(self) -> None:
        """The background thread: populate in steps until `ahead` bytes past `used` are there, then wait for takes;
        steps taken on spare CPU (`SpareCpuPacer`: an engine on the same host keeps its cores)."""
        pacer = SpareCpuPacer()
        while True:
            with self._wake:
                while not self._closed and self.populated >= min(self.size, self.used + self.ahead):
                    if self.populated >= self.size:
                        return
                    self._wake.wait()
                if self._closed:
                    return
            pacer.run(functools.partial(self._populate, min(self.populated + POPULATE_STEP, self.size)))

    def close(self) -> None:
        """Stop the background thread (the mapping stays valid for as long as buffers of it are referenced)."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()

    def take(self, nbytes: int, count: int = 1) -> tuple[list[np.ndarray], range]:
        """Up to `count` buffers of `nbytes` of arena memory, back to back (each at `VALUE_LEAD` past an
        `ARENA_ALIGN` boundary), and their addresses; fewer, or none, when the arena is used up (caller holds the
        store's lock)."""
        step = (nbytes + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN
        start = (self.used - VALUE_LEAD + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN + VALUE_LEAD
        count = min(count, max(0, (self.size - start - nbytes) // step + 1))
        if count <= 0:
            return [], range(0)
        self.used = start + (count - 1) * step + nbytes
        if self.ahead > 0 and self.populated < min(self.size, self.used + self.ahead // 2):
            with self._wake:  # the background thread falls behind: wake it (it may already be running)
                self._wake.notify()
        array, offsets = self.array, range(start, start + count * step, step)
        return [array[at : at + nbytes] for at in offsets], range(self.address + start, self.address + offsets.stop, step)

    def release(self, buffer: np.ndarray) -> None:
        """A buffer of this arena that will never be handed out again: give its whole pages back to the system
        (the address range stays the arena's; touching it again would fault in zeroed pages)."""
        offset = int(buffer.ctypes.data) - self.address
        begin = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (offset + buffer.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > begin:
            release_pages(self.address + begin, end - begin)


def _store_made(value: Buffer, arena: _Arena | None = None) -> TypeGuard[np.ndarray]:
    """Whether `value` is a buffer of the kind this store makes (or a node received into): an array owning its
    memory, carved from the arena, or a `_new_buffer` view (its base owns its memory and is at most a cache line
    larger). Structural only: it says nothing about who else holds it."""
    if type(value) is not np.ndarray:
        return False
    base = value.base
    return (
        base is None
        or (arena is not None and base is arena.array)
        or (type(base) is np.ndarray and base.base is None and base.nbytes <= value.nbytes + ARENA_ALIGN)
    )


def _recyclable(value: Buffer, arena: _Arena | None = None) -> TypeGuard[np.ndarray]:
    """A store-made buffer whose memory nobody else can reach through its base: a `_new_buffer` view's base is held
    by the view alone (references: the view's own, getrefcount's argument, and `base` here). The caller checks the
    buffer's own references (`_retire`). Called with the store's lock held, so two checks never race."""
    if not _store_made(value, arena):
        return False
    base = value.base
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
    arena_populated_bytes: int = 0  # arena bytes faulted in so far (at start-up, then ahead of use)
    prefault_seconds: float = 0.0
    leased_bytes: int = 0  # charges of the keys leased to lookups (`hold_many`)
    pinned_bytes: int = 0
    held_evictions: int = 0  # held keys evicted because nothing else could make room


class KvStore:
    """A bounded, thread-safe LRU store of EMS values."""

    def __init__(
        self,
        capacity_bytes: int,
        verify_on_put: bool = True,
        prefault_bytes: int = 0,
        prefault_ahead: int = 0,
        on_evict: Callable[[bytes, Buffer], None] | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if prefault_bytes < 0 or prefault_ahead < 0:
            raise ValueError(f"prefault_bytes and prefault_ahead must be >= 0, got {prefault_bytes}, {prefault_ahead}")
        # the arena spans the capacity when it grows in the background, else just the bytes pre-faulted up front
        arena_bytes = capacity_bytes if prefault_ahead > 0 else min(prefault_bytes, capacity_bytes)
        self._arena = _Arena(arena_bytes, prefault_bytes, prefault_ahead) if arena_bytes > 0 else None
        self._capacity = capacity_bytes
        self._verify_on_put = verify_on_put
        self._on_evict = on_evict
        self._entries: OrderedDict[bytes, Buffer] = OrderedDict()
        self._addresses: dict[bytes, int] = {}  # each entry's buffer address, where the store knows it
        self._used = 0  # charges of stored entries and of reservations being filled
        self._spare: dict[int, list[_Spare]] = {}  # evicted buffers free for reuse (and their addresses), by size
        self._spare_bytes = 0
        self._lock = threading.Lock()
        self._holds = Holds.for_capacity(capacity_bytes)
        self._stats = StoreStats(capacity_bytes=capacity_bytes)
        if self._arena is not None:
            self._stats.arena_bytes = self._arena.size
            self._stats.prefault_seconds = self._arena.prefault_seconds

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @staticmethod
    def _charge(key: bytes, value: Buffer) -> int:
        nbytes = value.nbytes if type(value) is np.ndarray else memoryview(value).nbytes  # (the store's own: cheaper)
        return len(key) + nbytes + ENTRY_OVERHEAD

    # ---- memory accounting (all under the lock) ----

    def _retire(self, value: Buffer, address: int | None) -> None:
        """A value left the index: keep its buffer (at `address`, if known) as a spare when nobody else holds it."""
        if _recyclable(value, self._arena) and sys.getrefcount(value) <= _UNSHARED_REFCOUNT:
            self._spare.setdefault(len(value), []).append((value, address))
            self._spare_bytes += len(value)

    def _drop_spare(self, keep_size: int, keep_count: int) -> bool:
        """Free one spare buffer, the oldest first and sizes other than `keep_size` first (of that size `keep_count`
        stay); False if there is none to drop."""
        for size, buffers in self._spare.items():
            if len(buffers) > (keep_count if size == keep_size else 0):
                dropped, _ = buffers.pop(0)
                self._spare_bytes -= size
                if self._arena is not None and dropped.base is self._arena.array:
                    self._arena.release(dropped)  # lost to the arena: at least its pages go back to the system
                return True
        return False

    def _make_room(self, charge: int, nbytes: int, count: int = 1) -> None:
        """Evict (LRU first) and free spares until values of `charge` in all fit, counting the spares of `nbytes`
        that `count` values of that size will reuse."""
        spare, entries, addresses, on_evict, holds = self._spare, self._entries, self._addresses, self._on_evict, self._holds
        if holds:
            holds.expire()
        passed = 0  # held entries passed by (moved to the most recently used end) in this call
        while True:
            reusable = nbytes * min(len(spare.get(nbytes, ())), count)
            excess = self._used + self._spare_bytes - reusable + charge - self._capacity
            if excess <= 0:
                return
            # spares beyond those the values will reuse are freed first (none: no need to look for one)
            if self._spare_bytes > reusable and self._drop_spare(nbytes, count):
                continue
            if not entries:  # nothing left to evict: a value up to the capacity fits by now
                return
            # evict until the excess is covered, as if each evicted buffer were reused or let go (a spare of another
            # size is not: the next round frees it, or evicts more)
            evictions = 0
            while excess > 0 and entries:
                evicted_key, evicted = entries.popitem(last=False)
                if holds:
                    if passed < len(holds) and holds.keeps(evicted_key):
                        entries[evicted_key] = evicted  # kept: back at the far end, reached again only after the rest
                        passed += 1
                        continue
                    if holds.keeps(evicted_key):  # every entry left is held: a capacity is a hard limit
                        self._stats.held_evictions += 1
                    holds.forget(evicted_key)
                freed = self._charge(evicted_key, evicted)
                self._used -= freed
                excess -= freed
                evictions += 1
                if on_evict is not None:
                    on_evict(evicted_key, evicted)
                self._retire(evicted, addresses.pop(evicted_key, None))
            self._stats.evictions += evictions

    def _remove(self, key: bytes) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._used -= self._charge(key, old)
            self._retire(old, self._addresses.pop(key, None))
            if self._holds:
                self._holds.forget(key)

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
                return self._take_buffer(nbytes)[0]
            except BaseException:  # e.g. MemoryError: the reservation goes back
                self._used -= reserve
                raise

    def allocate_many(self, sizes: Sequence[int] | np.ndarray, reserves: Sequence[int]) -> tuple[list[np.ndarray], list[int]]:
        """`allocate` for several values under one lock: value i gets `sizes[i]` bytes and reserves `reserves[i]`;
        returns the buffers and their addresses (the store knows them: callers need not read them back).
        Buffers come in address order where the store can: recycled spares of one size are taken as the run most
        recently evicted (a run that was allocated together comes back in its order), fresh ones from the arena
        back to back, so a caller usually finds them at the offsets of a packed layout and copies them in one
        operation. A `MemoryError` gives every reservation and buffer back."""
        size_list = sizes.tolist() if isinstance(sizes, np.ndarray) else list(sizes)
        total = sum(reserves)
        taken: list[np.ndarray] = []
        addresses: list[int] = []
        with self._lock:
            if total > 0 and size_list:
                nbytes = size_list[0]
                self._make_room(total, nbytes, size_list.count(nbytes))
                self._used += total
            try:
                position = 0
                while position < len(size_list):
                    nbytes = size_list[position]
                    same = position + 1
                    while same < len(size_list) and size_list[same] == nbytes:
                        same += 1
                    spares = self._spare.get(nbytes)
                    if spares:  # the newest spares in their order: a run evicted together, lowest address first
                        count = min(len(spares), same - position)
                        run = spares[len(spares) - count :]
                        del spares[len(spares) - count :]
                        self._spare_bytes -= nbytes * count
                        self._stats.reused_buffers += count
                        for buffer, address in run:
                            taken.append(buffer)
                            addresses.append(address_of(buffer) if address is None else address)
                        position += count
                        continue
                    fresh, fresh_addresses = self._fresh_buffers(nbytes, same - position)
                    taken.extend(fresh)
                    addresses.extend(fresh_addresses)
                    position = same
            except BaseException:
                self._used -= total
                for buffer, address in zip(taken, addresses):
                    if _recyclable(buffer, self._arena):
                        self._spare.setdefault(len(buffer), []).append((buffer, address))
                        self._spare_bytes += len(buffer)
                raise
        return taken, addresses

    def put_owned_many(
        self, keys: Sequence[bytes], values: Sequence[np.ndarray], reserved: Sequence[int], addresses: Sequence[int]
    ) -> None:
        """`put_owned` of well-formed values under one lock (the embedded pool's save: the caller built them in
        buffers from `allocate_many`, which gave their `addresses`; each value one-dimensional uint8, as those
        are)."""
        with self._lock:
            entries, known = self._entries, self._addresses
            if entries.keys().isdisjoint(keys):  # new keys, the usual save: the index takes them in C loops
                entries.update(zip(keys, values))
                known.update(zip(keys, addresses))
                self._used += sum(map(len, keys)) + sum(map(len, values)) + ENTRY_OVERHEAD * len(keys) - sum(reserved)
            else:
                for key, value, reserve, address in zip(keys, values, reserved, addresses):
                    old = entries.pop(key, None)
                    if old is not None:
                        self._used -= self._charge(key, old)
                        self._retire(old, known.pop(key, None))
                        self._holds.forget(key)
                    entries[key] = value
                    known[key] = address
                    self._used += self._charge(key, value) - reserve
            self._stats.puts += len(keys)
            self._make_room(0, -1)  # a no-op when every value's reservation was its charge (the usual case)

    def close(self) -> None:
        """Stop the arena's background thread, if any (the store stays usable)."""
        if self._arena is not None:
            self._arena.close()

    @staticmethod
    def charge_of(key_len: int, nbytes: int) -> int:
        """What a value of `nbytes` under a key of `key_len` bytes counts against the capacity."""
        return key_len + nbytes + ENTRY_OVERHEAD

    def _take_buffer(self, nbytes: int) -> _Spare:
        """`allocate` with the lock held: a buffer and its address (None: not known)."""
        spares = self._spare.get(nbytes)
        if spares:
            self._spare_bytes -= nbytes
            self._stats.reused_buffers += 1
            return spares.pop()
        buffers, addresses = self._fresh_buffers(nbytes, 1)
        return buffers[0], addresses[0]

    def _fresh_buffers(self, nbytes: int, count: int) -> tuple[list[np.ndarray], list[int]]:
        """`count` new buffers of `nbytes` and their addresses (lock held): back to back from the arena while it has
        room, then fresh memory."""
        taken, at = self._arena.take(nbytes, count) if self._arena is not None else ([], range(0))
        addresses = list(at)
        for _ in range(count - len(taken)):
            buffer, address = _new_buffer(nbytes)
            taken.append(buffer)
            addresses.append(address)
        return taken, addresses

    def recycle(self, buffer: np.ndarray, reserved: int = 0, address: int | None = None) -> None:
        """Give back a buffer from `allocate` (at `address`, if known) that was never stored and that the caller no
        longer uses (kept as a spare when there is room), and the bytes `allocate` reserved for it."""
        with self._lock:
            self._used -= reserved
            if _recyclable(buffer, self._arena) and self._used + self._spare_bytes + len(buffer) <= self._capacity:
                self._spare.setdefault(len(buffer), []).append((buffer, address))
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
            buffer, address = self._take_buffer(nbytes)
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
                self._retire(buffer, address)
                return False
            self._insert(key, buffer, charge, address)
        return True

    def put_owned(self, key: bytes, value: Buffer, reserved: int = 0, verified: bool = False) -> bool:
        """Store `value` itself (no copy) under `key`; the caller never writes to it again. False if refused.
        `reserved`: the bytes `allocate` reserved for this value (released here, on every path). `verified`: the
        caller has checked it is well formed (it is not checked again)."""
        charge = self._charge(key, value)
        if charge > self._capacity or (self._verify_on_put and not verified and not is_well_formed(value)):
            with self._lock:
                self._used -= reserved
                self._stats.rejected_puts += 1
            return False
        with self._lock:
            self._used -= reserved
            self._insert(key, value, charge)
        return True

    def put_owned_each(self, keys: Sequence[bytes], values: Sequence[Buffer], reserved: Sequence[int]) -> list[bool]:
        """`put_owned` of each value (a pool node's PUT), the values checked in one batch first (`well_formed_many`:
        one call, which gives the GIL away once for a large batch instead of holding it per value)."""
        good = well_formed_many(values) if self._verify_on_put else [True] * len(values)
        return [self.put_owned(k, v, reserved=r, verified=ok) for k, v, r, ok in zip(keys, values, reserved, good)]

    def put_copied_each(
        self, keys: Sequence[bytes], buffers: Sequence[np.ndarray], sources: Sequence[Buffer], reserved: Sequence[int]
    ) -> list[bool]:
        """`put_owned_each` of `buffers` (from `allocate`), each first filled with the bytes of the source beside it
        (same lengths): a node's save out of memory its client can still write (a shared-memory region), so the
        copies are what is checked and stored. Copy and check in one pass (`copy_well_formed_many`). A refused
        buffer's reservation is released here, as `put_owned` does; on an error nothing is stored and the caller
        still owns every buffer."""
        if self._verify_on_put:
            good = copy_well_formed_many(buffers, sources)
        else:
            copy_buffers(buffers, sources)
            good = [True] * len(buffers)
        return [self.put_owned(k, v, reserved=r, verified=ok) for k, v, r, ok in zip(keys, buffers, reserved, good)]

    @staticmethod
    def read_into(values: Sequence[Buffer], outs: Sequence[Buffer], progress: int = 0, signalled: int = 0) -> None:
        """Copy each value (as `get_many` returned it) into the writable buffer of `outs` beside it (same lengths),
        in one call for the batch: a node's load into a shared-memory region (`copy_buffers`; `progress`,
        `signalled`: its reader's progress word, published as each of the first `signalled` values lands)."""
        copy_buffers(outs, values, progress, signalled)

    def _insert(self, key: bytes, value: Buffer, charge: int, address: int | None = None) -> None:
        self._remove(key)
        self._make_room(charge, -1)
        self._entries[key] = value
        if address is not None:
            self._addresses[key] = address
        self._used += charge
        self._stats.puts += 1

    def put_many(self, keys: Sequence[bytes], values: Sequence[Sequence[Buffer]]) -> list[bool]:
        return [self.put(key, parts) for key, parts in zip(keys, values)]

    # ---- reads ----

    def get(self, key: bytes) -> Buffer | None:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self._stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self._stats.hits += 1
            if self._holds:
                self._holds.release(key)
        # a read-only view: holds the buffer (so it is never reused under the reader) and cannot write to it
        return memoryview(value).toreadonly() if _store_made(value, self._arena) else value

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """`get` of each key under one lock (a hit is a read-only view, as `get` gives)."""
        return self._get_many(keys, None)

    def get_many_with_addresses(self, keys: Sequence[bytes]) -> tuple[list[Buffer | None], list[int | None]]:
        """`get_many`, and each hit's buffer address where the store knows it (None for a miss, or where it does
        not: a buffer handed in by `put_owned`), read under the same lock as the values, so that an address is
        always the address of the value returned beside it (a load may hash and copy from the address)."""
        addresses: list[int | None] = []
        return self._get_many(keys, addresses), addresses

    def _get_many(self, keys: Sequence[bytes], addresses: list[int | None] | None) -> list[Buffer | None]:
        values: list[Buffer | None] = []
        with self._lock:
            entries, stats, known, holds = self._entries, self._stats, self._addresses, self._holds
            for key in keys:
                value = entries.get(key)
                if value is None:
                    stats.misses += 1
                else:
                    entries.move_to_end(key)
                    stats.hits += 1
                    if holds:
                        holds.release(key)  # the read a lookup's lease was for
                values.append(value)
                if addresses is not None:
                    addresses.append(None if value is None else known.get(key))
        arena = self._arena
        return [value if value is None or not _store_made(value, arena) else memoryview(value).toreadonly() for value in values]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._entries for key in keys]

    def hold_many(self, keys: Sequence[bytes], hold: Hold) -> list[bool]:
        """Hold each key the store has as `hold` asks (`ems.store.holds`); True where it holds the key and keeps it
        (False: absent, or the budget of that kind of hold is used up)."""
        with self._lock:
            entries, holds, charge = self._entries, self._holds, self._charge
            out = []
            for key in keys:
                value = entries.get(key)
                out.append(value is not None and holds.grant(key, charge(key, value), hold))
            return out

    def keys(self) -> list[bytes]:
        """The keys held now, least recently used first: a snapshot taken under the lock (a pool node's repair
        walks it, `ems.pool.repair`)."""
        with self._lock:
            return list(self._entries)

    def peek_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """`get_many` that leaves the LRU order and the hit and miss counts alone: a node's repair reading what it
        copies to another node is not a client's read."""
        with self._lock:
            values = [self._entries.get(key) for key in keys]
        arena = self._arena
        return [value if value is None or not _store_made(value, arena) else memoryview(value).toreadonly() for value in values]

    def delete(self, key: bytes) -> bool:
        with self._lock:
            if key not in self._entries:
                return False
            self._remove(key)
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._addresses.clear()
            self._holds.clear()
            self._spare.clear()
            self._used = 0
            self._spare_bytes = 0

    def stats(self) -> StoreStats:
        with self._lock:
            self._stats.entries = len(self._entries)
            self._stats.used_bytes = self._used
            self._stats.spare_bytes = self._spare_bytes
            self._stats.arena_used_bytes = self._arena.used if self._arena is not None else 0
            self._stats.arena_populated_bytes = self._arena.populated if self._arena is not None else 0
            self._stats.leased_bytes = self._holds.leased_bytes
            self._stats.pinned_bytes = self._holds.pinned_bytes
            return StoreStats(**vars(self._stats))

"""A store's buffers: where a value's buffer comes from (a spare of its size, else the arena, else fresh memory) and
where a buffer goes when its value leaves (kept as a spare for reuse when nobody else can reach it).

Contract (`BufferSupply`, used by `ems.store.kv_store.KvStore` and `ems.store.index.LruIndex` under the store's lock;
not thread-safe by itself):
* Reuse: a buffer is taken first from the spares of its size (evicted or given-back buffers), so a full pool, which
  evicts as much as it stores, writes into memory that is already faulted in (a copy into fresh memory is several
  times slower than into reused memory: perf/RESULTS.md, "Figures behind design choices"). Then from the arena
  (`Arena`, below: back to back), then fresh memory (`new_buffer`). A taken buffer holds stale bytes,
  possibly another tenant's: its taker overwrites every byte before the value is stored.
* A buffer becomes a spare only when the store made it (`store_made`: an array owning its memory, carved from the
  arena, or a `new_buffer` view) and nobody else can reach it (`recyclable`, and for a value leaving the index its
  reference count: `retire`), so a reader never sees its bytes change and memory handed in from outside is never
  written.
* Addresses: each spare keeps its buffer's address where known (None: a pool node's receive buffer, read back
  with `address_of` when taken), so `take_many` returns every buffer's address without reading it back.
* `drop_one` frees a spare (other sizes first, the oldest first); a dropped arena buffer is lost to the arena and its
  pages go back to the system. Spares' bytes count against the store's capacity (`spare_bytes`).

The arena: where a store's fresh buffers come from: one anonymous mapping handed out by bumping a pointer, its pages faulted
in ahead of use; and plain fresh memory once the mapping is used up.

Contract (used by `BufferSupply` under the store's lock; `Arena` is not thread-safe by itself,
except for its background thread, which only faults pages in):
* `Arena(nbytes, prefault_bytes, ahead)` maps `nbytes` of address space (`MAP_NORESERVE`), advised for transparent
  huge pages (`madvise(MADV_HUGEPAGE)` where the kernel allows). `take(nbytes, count)` hands out up to `count`
  buffers back to back, each with its payload (at `VALUE_LEAD`) on an `ARENA_ALIGN` boundary, and their addresses;
  fewer, or none, once the mapping is used up. A buffer is never handed out twice by the arena (reuse is the
  supply's, by size).
* Pages are faulted in before use, so a growing pool does not pay first-touch page faults on the hot path (measured
  on this project's VMs: 2 ms and more per MiB touched for the first time, against 0.1 ms to write it afterwards):
  `prefault_bytes` when the arena is built (`prefault_seconds`: about the time to touch those bytes once), and with
  `ahead` > 0 by a background thread that keeps that many bytes faulted in past the bump pointer
  (`MADV_POPULATE_WRITE`, a system call that runs without the GIL). Cost: `ahead` bytes of memory in use beyond what
  the values use, and one core busy for about as long as it takes to touch them, in the background after start-up;
  nothing on the caller's path (it goes in steps of `POPULATE_STEP`: other threads' mmap and munmap, which wait for
  the mmap lock a populate holds, wait at most one small step; each step on spare CPU, `SpareCpuPacer`).
* `release(buffer)` gives the whole pages of a buffer that will never be handed out again back to the system
  (`MADV_DONTNEED`); `close()` stops the background thread (the mapping stays valid while buffers of it are held).
* `new_buffer(nbytes)`: fresh memory outside any arena, uninitialised (every byte is written before a value is
  stored, so zero-filling would only add a pass), placed like an arena buffer.
"""

from __future__ import annotations

import functools
import mmap
import platform
import sys
import threading
import time
from collections.abc import Sequence
from typing import TypeGuard

import numpy as np

from ems.buffers import POPULATE_STEP, Buffer, SpareCpuPacer, populate_pages, release_pages
from ems.kernels.host_copy import address_of
from ems.store.value_format import VALUE_LEAD

ARENA_ALIGN = 64  # cache line

# Python's `mmap` module names MAP_NORESERVE only from 3.13 on; Linux takes the flag all the same (0x4000 on x86-64
# and arm64, the hosts this package runs on; elsewhere the mapping is simply charged). Without it the whole mapping
# is charged to the commit limit: on Linux's default overcommit heuristic a mapping past the host's memory is
# refused, and a process whose mappings add up past it can no longer fork (`subprocess` fails with ENOMEM), so a
# store of a large capacity would stop an engine from starting its pool node.
_LINUX_MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64") else 0
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", _LINUX_MAP_NORESERVE)


def new_buffer(nbytes: int) -> tuple[np.ndarray, int]:
    """Uninitialised memory (no zero-filling pass: every byte is written before the value is stored), placed at
    `VALUE_LEAD` past a cache line: a view of a slightly larger array that nothing else holds; and its address."""
    raw = np.empty(nbytes + ARENA_ALIGN, dtype=np.uint8)
    address = raw.__array_interface__["data"][0]
    skip = (VALUE_LEAD - address) % ARENA_ALIGN
    return raw[skip : skip + nbytes], address + skip


class Arena:
    """One anonymous mapping of up to the store's capacity, handed out by bumping a pointer (see the module
    docstring). Pages are populated (faulted in) `prefault_bytes` at once when it is built and then, when
    `ahead` > 0, by a background thread that keeps `ahead` bytes populated past the bump pointer, so values
    are written into memory that is already there."""

    def __init__(self, nbytes: int, prefault_bytes: int = 0, ahead: int = 0) -> None:
        start = time.perf_counter()
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
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


# References to a retired value inside `BufferSupply.retire`: the caller's one local, the parameter, getrefcount's
# argument. Every caller of `retire` holds the value in exactly one local (and nothing else of its own).
_UNSHARED_REFCOUNT = 3

# A free buffer kept for reuse and its address (None: not known yet, e.g. a pool node's receive buffer).
Spare = tuple[np.ndarray, "int | None"]


def store_made(value: Buffer, arena: Arena | None = None) -> TypeGuard[np.ndarray]:
    """Whether `value` is a buffer of the kind a store makes (or a node received into): an array owning its
    memory, carved from the arena, or a `new_buffer` view (its base owns its memory and is at most a cache line
    larger). Structural only: it says nothing about who else holds it."""
    if type(value) is not np.ndarray:
        return False
    base = value.base
    return (
        base is None
        or (arena is not None and base is arena.array)
        or (type(base) is np.ndarray and base.base is None and base.nbytes <= value.nbytes + ARENA_ALIGN)
    )


def recyclable(value: Buffer, arena: Arena | None = None) -> TypeGuard[np.ndarray]:
    """A store-made buffer whose memory nobody else can reach through its base: a `new_buffer` view's base is held
    by the view alone (references: the view's own, getrefcount's argument, and `base` here). The caller checks the
    buffer's own references (`BufferSupply.retire`). Called with the store's lock held, so two checks never race."""
    if not store_made(value, arena):
        return False
    base = value.base
    return base is None or base is getattr(arena, "array", None) or sys.getrefcount(base) <= 3


class BufferSupply:
    """The arena (if any) and the spares of one store, by size (see the module contract)."""

    def __init__(self, arena: Arena | None) -> None:
        self.arena = arena
        self._spare: dict[int, list[Spare]] = {}  # free buffers for reuse (and their addresses), by size
        self.spare_bytes = 0
        self.reused_buffers = 0  # buffers handed out again (stats)

    def readonly(self, values: list[Buffer | None]) -> list[Buffer | None]:
        """What a reader gets of each value: a read-only view of a store-made buffer (it holds the buffer, so it is
        never reused under the reader, and cannot write to it); a value handed in from outside as it is."""
        arena = self.arena
        return [value if value is None or not store_made(value, arena) else memoryview(value).toreadonly() for value in values]

    def recyclable(self, buffer: Buffer) -> TypeGuard[np.ndarray]:
        return recyclable(buffer, self.arena)

    def reusable(self, nbytes: int, count: int) -> int:
        """The bytes of the spares of `nbytes` that `count` values of that size would reuse."""
        return nbytes * min(len(self._spare.get(nbytes, ())), count)

    def keep(self, buffer: np.ndarray, address: int | None) -> None:
        """Keep a recyclable buffer (at `address`, if known) as a spare."""
        self._spare.setdefault(len(buffer), []).append((buffer, address))
        self.spare_bytes += len(buffer)

    def retire(self, value: Buffer, address: int | None) -> None:
        """A value left the index: keep its buffer (at `address`, if known) as a spare when nobody else holds it.
        The caller holds `value` in exactly one local (`_UNSHARED_REFCOUNT`)."""
        if recyclable(value, self.arena) and sys.getrefcount(value) <= _UNSHARED_REFCOUNT:
            self.keep(value, address)

    def drop_one(self, keep_size: int, keep_count: int) -> bool:
        """Free one spare buffer, the oldest first and sizes other than `keep_size` first (of that size `keep_count`
        stay); False if there is none to drop."""
        for size, buffers in self._spare.items():
            if len(buffers) > (keep_count if size == keep_size else 0):
                dropped, _ = buffers.pop(0)
                self.spare_bytes -= size
                if self.arena is not None and dropped.base is self.arena.array:
                    self.arena.release(dropped)  # lost to the arena: at least its pages go back to the system
                return True
        return False

    def take(self, nbytes: int) -> Spare:
        """A buffer of `nbytes` and its address (None: not known): the newest spare of that size, else fresh."""
        spares = self._spare.get(nbytes)
        if spares:
            self.spare_bytes -= nbytes
            self.reused_buffers += 1
            return spares.pop()
        buffers, addresses = self.fresh(nbytes, 1)
        return buffers[0], addresses[0]

    def take_many(self, sizes: Sequence[int]) -> tuple[list[np.ndarray], list[int]]:
        """A buffer of each size and each one's address, in address order where it can: spares of one size are
        taken as the run most recently kept (a run that was allocated together comes back in its order), fresh ones
        from the arena back to back. On an error (a `MemoryError`) the buffers taken so far are kept as spares."""
        taken: list[np.ndarray] = []
        addresses: list[int] = []
        try:
            position = 0
            while position < len(sizes):
                nbytes = sizes[position]
                same = position + 1
                while same < len(sizes) and sizes[same] == nbytes:
                    same += 1
                spares = self._spare.get(nbytes)
                if spares:  # the newest spares in their order: a run evicted together, lowest address first
                    count = min(len(spares), same - position)
                    run = spares[len(spares) - count :]
                    del spares[len(spares) - count :]
                    self.spare_bytes -= nbytes * count
                    self.reused_buffers += count
                    for buffer, address in run:
                        taken.append(buffer)
                        addresses.append(address_of(buffer) if address is None else address)
                    position += count
                    continue
                fresh, fresh_addresses = self.fresh(nbytes, same - position)
                taken.extend(fresh)
                addresses.extend(fresh_addresses)
                position = same
        except BaseException:
            for buffer, address in zip(taken, addresses):
                if recyclable(buffer, self.arena):
                    self.keep(buffer, address)
            raise
        return taken, addresses

    def fresh(self, nbytes: int, count: int) -> tuple[list[np.ndarray], list[int]]:
        """`count` new buffers of `nbytes` and their addresses: back to back from the arena while it has room, then
        fresh memory."""
        taken, at = self.arena.take(nbytes, count) if self.arena is not None else ([], range(0))
        addresses = list(at)
        for _ in range(count - len(taken)):
            buffer, address = new_buffer(nbytes)
            taken.append(buffer)
            addresses.append(address)
        return taken, addresses

    def clear(self) -> None:
        self._spare.clear()
        self.spare_bytes = 0

"""Where a store's fresh buffers come from: one anonymous mapping handed out by bumping a pointer, its pages faulted
in ahead of use; and plain fresh memory once the mapping is used up.

Contract (used by `ems.store.recycling.BufferSupply` under the store's lock; `Arena` is not thread-safe by itself,
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

import numpy as np

from ems.buffers import POPULATE_STEP, SpareCpuPacer, populate_pages, release_pages
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

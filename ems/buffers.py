"""Bytes-like types shared by the client side (`ems/`) and the transport (`ems.transport`): one definition that
both import; and the page helpers both use on their mappings (populate ahead of use, give back).

A leaf module: it imports nothing of `ems`, so the transport can use it without importing the store or any other
client module (tests/transport/test_layering.py checks the transport's imports).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, Union

if TYPE_CHECKING:
    import numpy as np

#: bytes-like values as they cross a transport and live in the pool: stored values, their parts, callers' receive
#: buffers (numpy arrays included: the store keeps values in them)
Buffer = Union[bytes, bytearray, memoryview, "np.ndarray"]
T = TypeVar("T")


def byte_view(buffer: Buffer) -> memoryview:
    """`buffer`'s bytes as a flat memoryview of format "B" (no copy)."""
    view = memoryview(buffer)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def writable_bytes(buffer: Buffer) -> memoryview:
    """`byte_view` of a buffer to receive into; ValueError for a read-only one."""
    view = byte_view(buffer)
    if view.readonly:
        raise ValueError("get_into needs writable buffers")
    return view


def copy_bytes(dst: Any, src: Any) -> None:
    """Copy the bytes of `src` into `dst` (writable, same length), holding the GIL: a memoryview copy. numpy's copy
    of a large array releases the GIL, and beside a busy Python thread each such copy then waits up to the
    interpreter's switch interval to get it back (perf/RESULTS.md, "Issue 16: the client's progress model")."""
    memoryview(dst).cast("B")[:] = memoryview(src).cast("B")


# ---- pages of a mapping ----

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
# A background populate's step (it checks whether to go on between steps). One transparent huge page: the kernel
# holds the process's mmap lock for a whole MADV_POPULATE_WRITE call, so every mmap or munmap of another thread (an
# engine's large allocations, UCX's) waits for the step: with 32 MiB steps a 1 MiB allocation right after Ems.init
# waited 140-210 ms, with 2 MiB steps at most ~10 ms (perf/RESULTS.md, "Background populate and the mmap lock").
POPULATE_STEP = 2 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def _madvise(address: int, length: int, advice: int) -> int:
    """madvise(2) through ctypes: unlike `mmap.madvise` it releases the GIL, and takes any address."""
    return int(_libc.madvise(address, length, advice))


def populate_pages(address: int, length: int) -> bool:
    """Fault in the pages of [address, address + length) writable without writing them (MADV_POPULATE_WRITE: the
    kernel allocates what is missing and maps it; the bytes stay as they are). Runs without the GIL. False where
    the kernel lacks it (before 5.14): the caller then touches the pages itself, or lets them fault on use."""
    return _madvise(address, length, _MADV_POPULATE_WRITE) == 0


def release_pages(address: int, length: int) -> None:
    """Give the whole pages of [address, address + length) back to the system (MADV_DONTNEED): the range stays
    mapped, and reads as zeros (anonymous memory) when touched again."""
    _madvise(address, length, mmap.MADV_DONTNEED)


_MADV_REMOVE = 9


def remove_pages(address: int, length: int) -> bool:
    """Free the pages of a shared file mapping's [address, address + length) in the file itself (MADV_REMOVE: a hole
    punched in the memfd), so that they are gone from every process that maps it, not only from this one: another
    process's mapping reads zeros there, and a page it touches again is a new page of its own faulting. False when
    the kernel refuses (then nothing was freed)."""
    return _madvise(address, length, _MADV_REMOVE) == 0


_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def host_idle_seconds() -> float | None:
    """Seconds the host's CPUs have spent idle (idle and iowait, all CPUs together) since boot, from /proc/stat;
    None where it cannot be read."""
    try:
        with open("/proc/stat", "rb") as stat:
            fields = stat.readline().split()
        return (int(fields[4]) + int(fields[5])) / _TICKS_PER_S
    except (OSError, ValueError, IndexError):
        return None


class SpareCpuPacer:
    """Paces a background thread whose work can wait (pages populated ahead of use) to CPU time that no other
    thread wants: `run(step)` runs one step once the host has a spare core. The host has one when, over the last
    window of at least `WINDOW_S`, its idle time plus this thread's own CPU time came to at least `SPARE_CORES`
    of the window (this thread alone would have found that much of a core idle); else the step waits, window by
    window, until one does. Where the idle time cannot be read it never waits.

    Why: an engine's forward pass keeps every core busy in bursts (its OpenMP threads meet at barriers, so one of
    them losing its core stalls them all), and a pool node on the same host populating its arena in the background
    took a core for about 2 ms per MiB right then: in a vLLM engine a 0.1 s prefill step took 0.3-0.5 s
    (perf/RESULTS.md, "A node's background populate and an engine's step"). The kernel's own view of the thread
    does not tell: a thread that sleeps often is scheduled first when it wakes, so it never waits for a CPU itself;
    the others wait for it.

    A wait backs off: each busy window doubles the next (up to `MAX_WINDOW_S`), and a step that runs starts over at
    `WINDOW_S`. Polling every 30 ms while every core stays busy cost ~10 ms of CPU a second per waiting thread (a
    /proc/stat read and a wake-up each window): 32 pool nodes on one host took a third of a core doing nothing
    (perf/RESULTS.md, "Issue 46: what 32 nodes on one host cost while they wait")."""

    WINDOW_S = 0.03
    MAX_WINDOW_S = 0.48  # a busy host is looked at twice a second, at most
    SPARE_CORES = 0.75
    STALE_S = 4 * WINDOW_S  # a window this much longer than it was meant to be (the thread waited for work): stale

    def __init__(
        self,
        idle: Callable[[], float | None] = host_idle_seconds,
        own_cpu: Callable[[], float] = time.thread_time,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._idle, self._own_cpu, self._clock, self._sleep = idle, own_cpu, clock, sleep
        self.waited_s = 0.0  # waited for a spare core, in all
        self._window = self._sample()  # where the current window started: (idle, own CPU, clock)

    def _sample(self) -> tuple[float | None, float, float]:
        return self._idle(), self._own_cpu(), self._clock()

    def run(self, step: Callable[[], T]) -> T:
        """`step()` once the host has a spare core (see the class docstring); its result."""
        window = self.WINDOW_S
        while self._clock() - self._window[2] >= self.WINDOW_S:
            (idle, own, start), now = self._window, self._sample()
            self._window = now
            if idle is None or now[0] is None:
                break  # the kernel does not say: never wait
            elapsed = now[2] - start
            fresh = elapsed <= self.STALE_S * window / self.WINDOW_S
            if fresh and (now[0] - idle) + (now[1] - own) >= self.SPARE_CORES * elapsed:
                break
            self._sleep(window)  # busy (or not known lately): this window is spent waiting, then looked at
            self.waited_s += window
            if fresh:  # (busy: the next look comes later; after a stale window the first fresh one is short)
                window = min(2 * window, self.MAX_WINDOW_S)
        return step()


def populate_in_background(array: Any, nbytes: int, name: str, stop: threading.Event | None = None) -> threading.Thread | None:
    """Populate the first `nbytes` of `array` (a uint8 numpy array over a mapping) on a daemon thread, in steps,
    so that its first use does not fault page by page (on a VM, touching fresh memory costs about 2 ms per MiB).
    The thread holds `array` (so the mapping stays) until it is done; once `stop` is set it populates no further
    step (a joiner waits one step at most). None when there is nothing to do. Not paced (`SpareCpuPacer`): it runs
    once, when a connection's region is new, and a first save into a region still being populated would take the
    faults on its own path."""
    end = min(int(nbytes), int(array.nbytes)) // mmap.PAGESIZE * mmap.PAGESIZE
    if end <= 0:
        return None
    address = int(array.ctypes.data)

    def run(held: Any = array) -> None:
        for begin in range(0, end, POPULATE_STEP):
            if stop is not None and stop.is_set():
                break
            if not populate_pages(address + begin, min(POPULATE_STEP, end - begin)):
                break  # an old kernel: the pages fault in on use
        del held

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread

"""Bytes-like types shared by the client side (`ems/`) and the transport (`ems.transport`): one definition that
both import; and the page helpers both use on their mappings (populate ahead of use, give back).

A leaf module: it imports nothing of `ems`, so the transport can use it without importing the store or any other
client module (tests/transport/test_layering.py checks the transport's imports).
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    import numpy as np

#: bytes-like values as they cross a transport and live in the pool: stored values, their parts, callers' receive
#: buffers (numpy arrays included: the store keeps values in them)
Buffer = Union[bytes, bytearray, memoryview, "np.ndarray"]


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


def populate_in_background(array: Any, nbytes: int, name: str) -> threading.Thread | None:
    """Populate the first `nbytes` of `array` (a uint8 numpy array over a mapping) on a daemon thread, in steps,
    so that its first use does not fault page by page (on a VM, touching fresh memory costs about 2 ms per MiB).
    The thread holds `array` (so the mapping stays) until it is done. None when there is nothing to do."""
    end = min(int(nbytes), int(array.nbytes)) // mmap.PAGESIZE * mmap.PAGESIZE
    if end <= 0:
        return None
    address = int(array.ctypes.data)

    def run(held: Any = array) -> None:
        for begin in range(0, end, POPULATE_STEP):
            if not populate_pages(address + begin, min(POPULATE_STEP, end - begin)):
                return  # an old kernel: the pages fault in on use
        del held

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread

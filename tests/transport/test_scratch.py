"""`ScratchBuffers`: exact sizes, reuse of what was given back (same memory), the byte limit, and nothing kept that
it did not hand out."""

from __future__ import annotations

import threading

import numpy as np

from ems.transport.scratch import GRANULE, ScratchBuffers


def test_take_gives_exact_sizes_and_reuses_what_was_given_back() -> None:
    scratch = ScratchBuffers(8 * GRANULE)
    a = scratch.take(GRANULE + 40)
    assert a.nbytes == GRANULE + 40 and a.dtype == np.uint8 and a.flags.writeable
    address = a.ctypes.data
    scratch.give([a])
    assert scratch.kept_bytes == 2 * GRANULE
    b = scratch.take(GRANULE + 7)  # the same rounded size: the same memory
    assert b.ctypes.data == address and b.nbytes == GRANULE + 7 and scratch.kept_bytes == 0
    c = scratch.take(GRANULE + 7)  # none free: a new one
    assert c.ctypes.data != address


def test_the_limit_bounds_what_is_kept_and_foreign_arrays_are_not_kept() -> None:
    scratch = ScratchBuffers(3 * GRANULE)
    taken = [scratch.take(GRANULE) for _ in range(5)]
    scratch.give(taken)
    assert scratch.kept_bytes == 3 * GRANULE
    scratch.give([np.empty(1000, np.uint8), np.empty(GRANULE + 1, np.uint8)])  # not rounded: not one of ours
    assert scratch.kept_bytes == 3 * GRANULE


def test_concurrent_takers_never_share_a_buffer() -> None:
    scratch = ScratchBuffers(64 * GRANULE)
    scratch.give([scratch.take(GRANULE) for _ in range(16)])
    seen: list[int] = []
    shared: list[int] = []  # addresses two takers held at once (must stay empty)
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(200):
            buffer = scratch.take(GRANULE)
            with lock:
                if buffer.ctypes.data in seen:
                    shared.append(buffer.ctypes.data)
                seen.append(buffer.ctypes.data)
            with lock:
                seen.remove(buffer.ctypes.data)
            scratch.give([buffer])

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not shared and scratch.kept_bytes <= 64 * GRANULE

"""The CPU scatter (what every load ends with) keeps the GIL: a copy that gives it away waits up to the interpreter's
switch interval to get it back beside a busy Python thread (an engine's loop), per op. With a switch interval of
0.4 s, one such wait is plainly visible against a scatter of a few ms (the best of three calls: a lost race for
the GIL in a tiny call elsewhere must not fail it); the bytes are checked against the reference.

Covers the torch backend's three scatter shapes: one piece (a one-block load), a grid of pieces x planes under
numpy's 500-element threshold, and a larger one (moved line by line).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from kernel_cases import as_bytes, make_layout, pieces_case, random_tensor, reference_pieces

from ems.kernels.torch_backend import TorchBackend

SWITCH_S = 0.4
TRIES = 20  # GIL-free calls a busy host gets to schedule the other thread in


@contextmanager
def busy_python_thread() -> Iterator[None]:
    """A thread spinning in pure Python, with a long switch interval (so a GIL hand-over costs SWITCH_S)."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    previous = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_S)
    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(previous)


@pytest.mark.parametrize(
    ("layers", "blocks_moved"),
    [(4, 1), (4, 24), (8, 40)],  # one piece; 24 x 8 planes = 192 spans; 40 x 16 = 640 spans (line by line)
)
def test_cpu_scatter_never_gives_the_gil_away(layers: int, blocks_moved: int) -> None:
    gen = torch.Generator().manual_seed(11)
    bs, blocks = 16, 64
    bases, planes = make_layout("plain", layers, blocks, bs, 2, 64, torch.float16, gen)
    chosen = torch.randperm(blocks, generator=gen)[:blocks_moved].tolist()
    slots = [b * bs + k for b in chosen for k in range(bs)]
    pieces, tok_start, part_base, total = pieces_case(planes, slots, [bs] * blocks_moved)
    src = random_tensor([total], torch.uint8, gen)
    _, written = reference_pieces(planes, slots, tok_start, part_base, total)
    backend = TorchBackend()
    backend.scatter_pieces(planes, pieces, src)  # warm: per-layout tables
    fresh = random_tensor([total], torch.uint8, gen)
    times = []
    with busy_python_thread():
        for _ in range(3):  # the best of 3: a copy that gives the GIL away loses it nearly every time
            time.sleep(0)  # the busy thread runs, then hands the GIL back: this thread starts with a whole interval
            start = time.perf_counter()
            backend.scatter_pieces(planes, pieces, fresh)
            times.append(time.perf_counter() - start)
    seconds = min(times)
    again = torch.empty(total, dtype=torch.uint8)
    backend.gather_pieces(planes, pieces, again)
    assert torch.equal(as_bytes(again[written]), as_bytes(fresh[written]))
    assert seconds < SWITCH_S / 2, f"the scatter waited for the GIL: {seconds:.3f} s"
    del bases


def _host_backend():
    from ems.kernels.host_backend import HostBackend
    from ems.kernels.host_copy import host_copy

    library = host_copy()
    if library is None:
        pytest.fail("the compiled host copy did not build")
    return HostBackend(library)


def test_host_scatter_keeps_the_gil_below_its_threshold() -> None:
    """A compiled scatter of less than `GIL_HELD_BELOW` bytes (24 blocks x 8 planes of 2 KiB here) keeps the GIL:
    no switch interval lost beside the busy thread."""
    from ems.kernels.host_copy import GIL_HELD_BELOW

    gen = torch.Generator().manual_seed(12)
    bs, blocks, moved = 16, 64, 24
    _bases, planes = make_layout("plain", 4, blocks, bs, 1, 64, torch.float16, gen)
    slots = [b * bs + k for b in torch.randperm(blocks, generator=gen)[:moved].tolist() for k in range(bs)]
    pieces, tok_start, part_base, total = pieces_case(planes, slots, [bs] * moved)
    assert total < GIL_HELD_BELOW
    backend = _host_backend()
    src = random_tensor([total], torch.uint8, gen)
    times = []
    with busy_python_thread():
        for _ in range(3):
            time.sleep(0)
            start = time.perf_counter()
            backend.scatter_pieces(planes, pieces, src)
            times.append(time.perf_counter() - start)
    assert min(times) < SWITCH_S / 2, f"the scatter waited for the GIL: {min(times):.3f} s"
    _, written = reference_pieces(planes, slots, tok_start, part_base, total)
    again = torch.empty(total, dtype=torch.uint8)
    backend.gather_pieces(planes, pieces, again)
    assert torch.equal(as_bytes(again[written]), as_bytes(src[written]))


def test_host_scatter_above_its_threshold_lets_other_threads_run() -> None:
    """A large compiled scatter releases the GIL for the copy: with a switch interval of SWITCH_S, a thread counting
    in pure Python cannot run while this thread holds the GIL (no forced switch comes sooner), so it advances
    across the call only if the C loop released it. A small scatter, which keeps the GIL, is the control."""
    from ems.kernels.host_copy import GIL_HELD_BELOW

    gen = torch.Generator().manual_seed(13)
    bs, blocks = 16, 128
    _bases, planes = make_layout("plain", 8, blocks, bs, 4, 128, torch.float16, gen)  # 16 planes x 16 KiB per block
    order = torch.randperm(blocks, generator=gen).tolist()
    backend = _host_backend()

    def case(moved: int) -> tuple:
        slots = [b * bs + k for b in order[:moved] for k in range(bs)]
        pieces, tok_start, part_base, total = pieces_case(planes, slots, [bs] * moved)
        return slots, pieces, tok_start, part_base, total, random_tensor([total], torch.uint8, gen)

    large, small = case(blocks), case(2)
    assert large[4] > 4 * GIL_HELD_BELOW > 4 * small[4]
    for c in (large, small):
        backend.scatter_pieces(planes, c[1], c[5])  # warm: the pages of both sides
    counter = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counter[0] += 1

    def advance_across(c: tuple) -> int:
        before = counter[0]
        backend.scatter_pieces(planes, c[1], c[5])
        return counter[0] - before

    previous = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_S)
    thread = threading.Thread(target=count, daemon=True)
    thread.start()
    try:
        time.sleep(0.01)  # the counter runs; this thread gets the GIL back within SWITCH_S
        # The counter advances across a GIL-free call only if the OS runs its thread meanwhile: on a host whose cores
        # are busy it may not in one call (a few ms), so up to TRIES calls, stopping at the first it ran in.
        advanced = []
        while len(advanced) < TRIES and not any(advanced):
            advanced.append(advance_across(large))
        time.sleep(0.01)
        kept = [advance_across(small) for _ in range(2)]
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(previous)
    assert max(advanced) > 0, f"the other thread never ran during {len(advanced)} 32 MiB scatters: the GIL was held"
    assert min(kept) == 0, "a scatter below the threshold gave the GIL away"
    slots, pieces, tok_start, part_base, total, src = large
    backend.scatter_pieces(planes, pieces, src)  # (the small case overwrote two of its blocks)
    _, written = reference_pieces(planes, slots, tok_start, part_base, total)
    again = torch.empty(total, dtype=torch.uint8)
    backend.gather_pieces(planes, pieces, again)
    assert torch.equal(as_bytes(again[written]), as_bytes(src[written]))

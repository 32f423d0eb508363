"""Layer-wise transfers of the vLLM connector (`transfer_granularity: "layer"`): a host mirror of engine blocks that
the SDK moves to and from the pool, and the copies between vLLM's KV cache and that mirror, one layer at a time, off
the forward thread.

Why a mirror. A pool value is one engine block with every layer (the SDK's value format: `header | layer 0's K and V
| layer 1's | ...`), so a value can go to the pool only once its last layer is written, and its bytes arrive from the
pool all together. Writing per-layer values instead would give every layer a key of its own: a layer-wise engine
and a step-wise engine would then never share a block. So values stay whole, and what goes layer by layer is the
copy between the engine's cache and a host buffer shaped like the engine's blocks (`HostMirror`): a producer copies
layer i of the step's blocks out while layer i+1 computes, and sends the assembled values after the forward; a
consumer receives whole values into the mirror, then copies them into the cache layer by layer, and the attention
of layer i waits only for layer i's copy. The mirror has the engine's plane shapes and dtypes, so registering it
(instead of the cache) gives the same layout signature, namespace and keys: both granularities read and write the
same values (`tests/integrations/vllm_connector/test_layer_transfers.py`).

Contract (no vLLM imports):
* `HostMirror.build(shapes, capacity, device)`: `capacity` blocks of every layer's two planes (pinned host memory
  where the cache is on an accelerator); `take(n)` a run of `n` free blocks (its first index, None when no run is
  free: the caller saves nothing or loads later), `give(start, n)` frees it.
* `LayerCopyQueue(device)`: one daemon thread runs submitted copies in order (on an accelerator: on a side stream,
  after the event `after` recorded on the forward's stream). `submit(fn, after)` returns a `CopyDone`: `wait()` (the
  forward thread, before a layer's attention: blocks until the copy is issued, then orders the current stream after
  it), `synchronize()` (the host: the copy's bytes are in place). A copy that raises is logged and its `CopyDone`
  says `ok` False; it never leaves a waiter behind. `close()` drains the queue.
* `gather(src_plane, ids, rows)` copies the engine rows `ids` of a plane into `rows` (a run of mirror rows);
  `scatter(rows, dst_plane, ids)` the reverse. One vectorised copy per plane: no per-block Python loop.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ems.integrations.kv_layouts import PlaneShape

logger = logging.getLogger("ems.integrations.vllm")


@dataclass
class HostMirror:
    """See the module contract."""

    planes: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, `[capacity, 1, 1, elems]` each
    capacity: int
    _free: list[tuple[int, int]] = field(default_factory=list)  # (start, length), by start
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def build(cls, shapes: Sequence[PlaneShape], capacity: int, device: torch.device) -> HostMirror:
        if capacity < 1:
            raise ValueError(f"a host mirror needs at least one block, got {capacity}")
        pin = device.type != "cpu" and torch.cuda.is_available()
        planes = [
            (
                torch.empty((capacity, 1, 1, s.elems), dtype=s.dtype, pin_memory=pin),
                torch.empty((capacity, 1, 1, s.elems), dtype=s.dtype, pin_memory=pin),
            )
            for s in shapes
        ]
        return cls(planes, capacity, [(0, capacity)])

    def take(self, n: int) -> int | None:
        """The first index of a free run of `n` blocks, now taken; None when no run that long is free."""
        if n < 1:
            raise ValueError(f"take needs n >= 1, got {n}")
        with self._lock:
            for i, (start, length) in enumerate(self._free):
                if length >= n:
                    if length == n:
                        del self._free[i]
                    else:
                        self._free[i] = (start + n, length - n)
                    return start
        return None

    def give(self, start: int, n: int) -> None:
        """Free the run `start .. start + n` (merged with its free neighbours)."""
        with self._lock:
            runs = sorted([*self._free, (start, n)])
            merged: list[tuple[int, int]] = []
            for s, length in runs:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((s, length))
            self._free = merged

    def free_blocks(self) -> int:
        with self._lock:
            return sum(length for _, length in self._free)


def gather(src_plane: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Engine rows `ids` of `src_plane` into `rows` (mirror rows, contiguous)."""
    if src_plane.device == rows.device:
        torch.index_select(src_plane, 0, ids, out=rows)
    else:
        rows.copy_(src_plane.index_select(0, ids), non_blocking=True)


def scatter(rows: torch.Tensor, dst_plane: torch.Tensor, ids: torch.Tensor) -> None:
    """Mirror rows `rows` into the engine rows `ids` of `dst_plane`."""
    dst_plane.index_copy_(0, ids, rows.to(dst_plane.device, non_blocking=True))


class CopyDone:
    """One submitted copy (see the module contract)."""

    def __init__(self) -> None:
        self._issued = threading.Event()
        self.event: torch.Event | None = None  # recorded on the side stream after the copy (an accelerator)
        self.ok = True

    def _finish(self, event: torch.Event | None, ok: bool) -> None:
        self.event, self.ok = event, ok
        self._issued.set()

    def wait(self) -> None:
        """Blocks until the copy is issued; on an accelerator, the current stream then waits for it."""
        self._issued.wait()
        if self.event is not None:
            self.event.wait()

    def synchronize(self) -> None:
        """Blocks until the copy's bytes are in place."""
        self._issued.wait()
        if self.event is not None:
            self.event.synchronize()

    def issued(self) -> bool:
        return self._issued.is_set()


class LayerCopyQueue:
    """See the module contract."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[Callable[[], None], torch.Event | None, CopyDone]] = collections.deque()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="ems-layer-copy", daemon=True)
        self._thread.start()

    def after_forward(self) -> torch.Event | None:
        """An event on the forward's current stream (None on CPU: the forward thread's work is done when it asks)."""
        if self._stream is None:
            return None
        event = torch.Event(device=self._device)
        event.record()
        return event

    def submit(self, fn: Callable[[], None], after: torch.Event | None = None) -> CopyDone:
        done = CopyDone()
        with self._cond:
            if self._closing:
                raise RuntimeError("LayerCopyQueue is closed")
            self._queue.append((fn, after, done))
            self._cond.notify_all()
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                fn, after, done = self._queue.popleft()
            event: torch.Event | None = None
            ok = True
            try:
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        if after is not None:
                            self._stream.wait_event(after)
                        fn()
                        event = torch.Event(device=self._device)
                        event.record(self._stream)
                else:
                    fn()
            except Exception:  # never leave a waiter behind: the forward waits for this copy
                logger.exception("EmsConnector: a layer copy failed (its blocks are recomputed or not saved)")
                ok = False
            finally:
                done._finish(event, ok)

    def close(self, timeout_s: float = 30.0) -> bool:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


@dataclass
class LayerStage:
    """A worker's layer-wise state: the mirror the SDK moves values through, the copier, the engine's planes (per
    layer, rows: blocks) and each layer's index by vLLM's layer name."""

    mirror: HostMirror
    copier: LayerCopyQueue
    planes: list[tuple[torch.Tensor, torch.Tensor]]
    index: dict[str, int]

    @property
    def device(self) -> torch.device:
        return self.planes[0][0].device

    def ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def copy_out(self, layer: int, ids: torch.Tensor, start: int) -> Callable[[], None]:
        """A copy of layer `layer`'s engine rows `ids` into mirror rows `start ..`."""
        n = int(ids.shape[0])
        pairs = list(zip(self.planes[layer], self.mirror.planes[layer]))

        def run() -> None:
            for plane, rows in pairs:
                gather(plane, ids, rows[start : start + n])

        return run

    def copy_in(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Mirror rows `src` of layer `layer` into its engine rows `dst` (a run of rows: read in place, from pinned
        memory where the mirror is pinned)."""
        n = int(src.numel())
        first = int(src[0]) if n else 0
        run = n > 0 and bool(torch.equal(src, torch.arange(first, first + n, dtype=src.dtype)))
        for plane, rows in zip(self.planes[layer], self.mirror.planes[layer]):
            scatter(rows[first : first + n] if run else rows.index_select(0, src), plane, dst)

    def close(self) -> None:
        if not self.copier.close():
            logger.warning("EmsConnector shutdown: layer copies still running after 30 s")

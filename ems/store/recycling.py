"""A store's buffers: where a value's buffer comes from (a spare of its size, else the arena, else fresh memory) and
where a buffer goes when its value leaves (kept as a spare for reuse when nobody else can reach it).

Contract (`BufferSupply`, used by `ems.store.kv_store.KvStore` and `ems.store.index.LruIndex` under the store's lock;
not thread-safe by itself):
* Reuse: a buffer is taken first from the spares of its size (evicted or given-back buffers), so a full pool, which
  evicts as much as it stores, writes into memory that is already faulted in (a copy into fresh memory is several
  times slower than into reused memory: perf/RESULTS.md, "Figures behind design choices"). Then from the arena
  (`ems.store.arena.Arena`, back to back), then fresh memory (`new_buffer`). A taken buffer holds stale bytes,
  possibly another tenant's: its taker overwrites every byte before the value is stored.
* A buffer becomes a spare only when the store made it (`store_made`: an array owning its memory, carved from the
  arena, or a `new_buffer` view) and nobody else can reach it (`recyclable`, and for a value leaving the index its
  reference count: `retire`), so a reader never sees its bytes change and memory handed in from outside is never
  written.
* Addresses: each spare keeps its buffer's address where known (None: a pool node's receive buffer, read back
  with `address_of` when taken), so `take_many` returns every buffer's address without reading it back.
* `drop_one` frees a spare (other sizes first, the oldest first); a dropped arena buffer is lost to the arena and its
  pages go back to the system. Spares' bytes count against the store's capacity (`spare_bytes`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TypeGuard

import numpy as np

from ems.buffers import Buffer
from ems.kernels.raw_memory import address_of
from ems.store.arena import ARENA_ALIGN, Arena, new_buffer

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

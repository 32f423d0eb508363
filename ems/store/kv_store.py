"""The key-value store behind every pool: the embedded pool and each pool node use this same code.

Contract:
* Keys are opaque `bytes` (the client has already folded tenant, model, rank and layout into them).
* A value is an EMS value (`value_format`): `put` refuses a malformed or damaged one (bad header, wrong length,
  wrong checksum), so a torn write is never stored.
* Capacity is a hard limit in bytes (keys, values, a fixed per-entry overhead, and spare buffers kept for reuse);
  when full, the least recently used entries are evicted (`ems.store.index`). A value that alone exceeds the
  capacity is refused. Never an out-of-memory.
* `get` returns a read-only buffer that stays valid for as long as the caller holds it, evicted or not.
  `put_owned` stores a buffer the caller hands over without copying it (a pool node's receive buffer); the caller
  promises never to write to it again, and `get` then returns that buffer.
* Buffers (`ems.store.recycling`): `put` copies into a buffer recycled from an evicted value of the same size when
  one is free, else into the arena (`ems.store.recycling.Arena`: one mapping, pre-faulted `prefault_bytes` when the store is
  built and, with `prefault_ahead` > 0, kept faulted in that far ahead of use by a background thread; then it spans
  the capacity as reserved address space; 0 and 0 reserve nothing), else into fresh memory; a full pool evicts as
  much as it stores, so reuse keeps the steady state at memcpy speed. An evicted buffer is reused only when no
  reader still holds it. `allocate` hands such a buffer out with the evicted value's bytes (possibly another
  tenant's) still in it: its caller must overwrite every byte before `put_owned`, and a pool node does so only
  through receives whose length is verified (`transport.ucx.frames`), so old bytes are never stored again; the
  embedded pool's one-pass save does so by gathering every payload byte (its pieces cover every row of every plane
  of the value) and writing the header (`ems.datapath.jobs.SaveJob`). The arena's bytes are not charged to the
  capacity until values use them.
* Addresses: the store knows where every buffer it made lies (arena offsets; a spare or an entry keeps its buffer's
  address), so `allocate_many` returns each buffer's address with it and `get_many_with_addresses` each hit's (None
  for a buffer handed in by `put_owned`): the embedded jobs address a request's values together without reading each
  address back (about 0.75 µs a value through ctypes).
* `on_evict(key, value)` (optional): called with each value evicted to make room (not with overwritten or deleted
  ones), with the store's lock held: it must return at once and never call the store (a pool node's disk tier
  queues the value for writing). While it holds the value, its buffer is not reused.
* Holds (`ems.store.index.Holds`): `hold_many(keys, hold)` leases or pins the keys the store has, within its budgets, and
  says which it holds and keeps; eviction passes held keys by while anything else can make room; a read (`get`,
  `get_many`, `get_many_with_addresses`) of a leased key releases one holder of its lease; a value that leaves the
  store takes its holds with it.
* Thread-safe: one lock, held only for index updates, never while checksumming or copying. `KvStore` owns the lock
  and its parts (`LruIndex`, `BufferSupply`, `Holds`), which run under it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ems.buffers import Buffer
from ems.kernels.host_copy import copy_buffers
from ems.store.index import ENTRY_OVERHEAD, Holds, LruIndex, charge
from ems.store.recycling import Arena, BufferSupply
from ems.store.value_format import copy_well_formed_many, is_well_formed, well_formed_many
from ems.transport.exists_holds import Hold

__all__ = ["ENTRY_OVERHEAD", "KvStore", "StoreStats"]


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
        self._arena = Arena(arena_bytes, prefault_bytes, prefault_ahead) if arena_bytes > 0 else None
        self._capacity = capacity_bytes
        self._verify_on_put = verify_on_put
        self._lock = threading.Lock()
        self._holds = Holds.for_capacity(capacity_bytes)
        self._supply = BufferSupply(self._arena)
        self._index = LruIndex(capacity_bytes, self._supply, self._holds, on_evict)
        self._entries = self._index.entries  # the same mapping (read under the lock on the hot paths)
        self._addresses = self._index.addresses
        self._stats = StoreStats(capacity_bytes=capacity_bytes)
        if self._arena is not None:
            self._stats.arena_bytes = self._arena.size
            self._stats.prefault_seconds = self._arena.prefault_seconds

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @staticmethod
    def charge_of(key_len: int, nbytes: int) -> int:
        """What a value of `nbytes` under a key of `key_len` bytes counts against the capacity."""
        return key_len + nbytes + ENTRY_OVERHEAD

    # ---- buffers for values to come ----

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
                self._index.make_room(reserve, nbytes)
                self._index.used += reserve
            try:
                return self._supply.take(nbytes)[0]
            except BaseException:  # e.g. MemoryError: the reservation goes back
                self._index.used -= reserve
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
        with self._lock:
            if total > 0 and size_list:
                nbytes = size_list[0]
                self._index.make_room(total, nbytes, size_list.count(nbytes))
                self._index.used += total
            try:
                return self._supply.take_many(size_list)
            except BaseException:
                self._index.used -= total
                raise

    def recycle(self, buffer: np.ndarray, reserved: int = 0, address: int | None = None) -> None:
        """Give back a buffer from `allocate` (at `address`, if known) that was never stored and that the caller no
        longer uses (kept as a spare when there is room), and the bytes `allocate` reserved for it."""
        with self._lock:
            index, supply = self._index, self._supply
            index.used -= reserved
            if supply.recyclable(buffer) and index.used + supply.spare_bytes + len(buffer) <= self._capacity:
                supply.keep(buffer, address)

    def close(self) -> None:
        """Stop the arena's background thread, if any (the store stays usable)."""
        if self._arena is not None:
            self._arena.close()

    # ---- writes: every one ends in `_admit` (stored) or `_refuse` ----

    def _admit(self, key: bytes, value: Buffer, charge_: int, reserved: int, address: int | None = None) -> bool:
        """Store `value` under `key`, releasing the bytes reserved for it."""
        with self._lock:
            self._index.used -= reserved
            self._index.insert(key, value, charge_, address)
            self._stats.puts += 1
        return True

    def _refuse(self, reserved: int) -> bool:
        """A value refused: release the bytes reserved for it."""
        with self._lock:
            self._index.used -= reserved
            self._stats.rejected_puts += 1
        return False

    def put(self, key: bytes, parts: Sequence[Buffer]) -> bool:
        """Store the concatenation of `parts` under `key` (replacing any old value); False if refused."""
        views = [memoryview(p).cast("B") for p in parts]
        nbytes = sum(v.nbytes for v in views)
        charge_ = len(key) + nbytes + ENTRY_OVERHEAD
        if charge_ > self._capacity:
            return self._refuse(0)
        with self._lock:
            self._index.remove(key)
            self._index.make_room(charge_, nbytes)
            buffer, address = self._supply.take(nbytes)
            self._index.used += charge_  # reserved while the copy runs outside the lock
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
                self._index.used -= charge_
            raise
        if well_formed:
            return self._admit(key, buffer, charge_, charge_, address)
        with self._lock:  # here, not in `_refuse`: the buffer goes back to the spares (this frame's one reference)
            self._index.used -= charge_
            self._stats.rejected_puts += 1
            self._supply.retire(buffer, address)
        return False

    def put_many(self, keys: Sequence[bytes], values: Sequence[Sequence[Buffer]]) -> list[bool]:
        return [self.put(key, parts) for key, parts in zip(keys, values)]

    def put_owned(self, key: bytes, value: Buffer, reserved: int = 0, verified: bool = False) -> bool:
        """Store `value` itself (no copy) under `key`; the caller never writes to it again. False if refused.
        `reserved`: the bytes `allocate` reserved for this value (released here, on every path). `verified`: the
        caller has checked it is well formed (it is not checked again)."""
        return self._own(key, value, reserved, verified or not self._verify_on_put or is_well_formed(value))

    def _own(self, key: bytes, value: Buffer, reserved: int, well_formed: bool) -> bool:
        """`put_owned` of a value whose check is done (`well_formed`)."""
        charge_ = charge(key, value)
        if charge_ > self._capacity or not well_formed:
            return self._refuse(reserved)
        return self._admit(key, value, charge_, reserved)

    def put_owned_each(self, keys: Sequence[bytes], values: Sequence[Buffer], reserved: Sequence[int]) -> list[bool]:
        """`put_owned` of each value (a pool node's PUT), the values checked in one batch first (`well_formed_many`:
        one call, which gives the GIL away once for a large batch instead of holding it per value)."""
        good = well_formed_many(values) if self._verify_on_put else [True] * len(values)
        return [self._own(k, v, r, ok) for k, v, r, ok in zip(keys, values, reserved, good)]

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
        return [self._own(k, v, r, ok) for k, v, r, ok in zip(keys, buffers, reserved, good)]

    def put_owned_many(
        self, keys: Sequence[bytes], values: Sequence[np.ndarray], reserved: Sequence[int], addresses: Sequence[int]
    ) -> None:
        """`put_owned` of well-formed values under one lock (the embedded pool's save: the caller built them in
        buffers from `allocate_many`, which gave their `addresses`; each value one-dimensional uint8, as those
        are)."""
        with self._lock:
            self._index.insert_many(keys, values, reserved, addresses)
            self._stats.puts += len(keys)

    @staticmethod
    def read_into(values: Sequence[Buffer], outs: Sequence[Buffer], progress: int = 0, signalled: int = 0) -> None:
        """Copy each value (as `get_many` returned it) into the writable buffer of `outs` beside it (same lengths),
        in one call for the batch: a node's load into a shared-memory region (`copy_buffers`; `progress`,
        `signalled`: its reader's progress word, published as each of the first `signalled` values lands)."""
        copy_buffers(outs, values, progress, signalled)

    # ---- reads ----

    def get(self, key: bytes) -> Buffer | None:
        return self._get_many((key,), None)[0]

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
                    if holds.leases:  # (a dict's truth: no call while nothing is leased)
                        holds.release(key)  # the read a lookup's lease was for
                values.append(value)
                if addresses is not None:
                    addresses.append(None if value is None else known.get(key))
        return self._supply.readonly(values)

    def peek_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """`get_many` that leaves the LRU order and the hit and miss counts alone: a node's repair reading what it
        copies to another node is not a client's read."""
        with self._lock:
            values = [self._entries.get(key) for key in keys]
        return self._supply.readonly(values)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._entries for key in keys]

    def hold_many(self, keys: Sequence[bytes], hold: Hold) -> list[bool]:
        """Hold each key the store has as `hold` asks (`ems.store.index.Holds`); True where it holds the key and keeps it
        (False: absent, or the budget of that kind of hold is used up)."""
        with self._lock:
            entries, holds = self._entries, self._holds
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

    def delete(self, key: bytes) -> bool:
        with self._lock:
            return self._index.remove(key)

    def clear(self) -> None:
        with self._lock:
            self._index.clear()
            self._holds.clear()
            self._supply.clear()

    def stats(self) -> StoreStats:
        with self._lock:
            stats, index, supply, arena = self._stats, self._index, self._supply, self._arena
            stats.entries = len(index)
            stats.used_bytes = index.used
            stats.spare_bytes = supply.spare_bytes
            stats.reused_buffers = supply.reused_buffers
            stats.evictions = index.evictions
            stats.held_evictions = index.held_evictions
            stats.arena_used_bytes = arena.used if arena is not None else 0
            stats.arena_populated_bytes = arena.populated if arena is not None else 0
            stats.leased_bytes = self._holds.leased_bytes
            stats.pinned_bytes = self._holds.pinned_bytes
            return StoreStats(**vars(stats))

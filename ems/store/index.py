"""A store's index and its eviction policy: which values it holds, least recently used first, what they (and the
values being filled) are charged against the capacity, and which leave when room is needed.

Contract (`LruIndex`, used by `ems.store.kv_store.KvStore` under the store's lock; not thread-safe by itself):
* `entries` maps each key to its value in LRU order (least recently used first); `addresses` holds each entry's
  buffer address where the store knows it. `used` counts the charges of the entries (`charge`: key, value and
  `ENTRY_OVERHEAD`) and of the reservations being filled (`reserve`, `unreserve`).
* `make_room(charge, nbytes, count)` evicts until values of `charge` in all fit beside `used` and the spares
  (`ems.store.recycling.BufferSupply`), counting the spares of `nbytes` that `count` values of that size will reuse:
  first spares nobody will reuse are freed, then the least recently used entries are evicted, passing held keys by
  (`ems.store.holds.Holds`: moved to the most recently used end, at most as many as are held) while anything else
  can make room; when nothing else can, held keys are evicted too, oldest first (a capacity is a hard limit:
  `held_evictions`). An evicted value goes to `on_evict` (if any), then its buffer to the supply (`retire`); its
  holds go with it.
* A value that leaves the index any other way (`remove`: replaced, deleted) is retired the same way but does not
  go to `on_evict`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from ems.buffers import Buffer
from ems.store.holds import Holds
from ems.store.recycling import BufferSupply

ENTRY_OVERHEAD = 96  # bytes charged per entry for the index, so many tiny values cannot exceed the capacity


def charge(key: bytes, value: Buffer) -> int:
    """What `value` under `key` counts against the capacity."""
    nbytes = value.nbytes if type(value) is np.ndarray else memoryview(value).nbytes  # (the store's own: cheaper)
    return len(key) + nbytes + ENTRY_OVERHEAD


class LruIndex:
    """The entries of one store and its capacity accounting (see the module contract)."""

    def __init__(
        self, capacity: int, supply: BufferSupply, holds: Holds, on_evict: Callable[[bytes, Buffer], None] | None = None
    ) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[bytes, Buffer] = OrderedDict()
        self.addresses: dict[bytes, int] = {}  # each entry's buffer address, where the store knows it
        self.used = 0  # charges of stored entries and of reservations being filled
        self.evictions = 0
        self.held_evictions = 0  # held keys evicted because nothing else could make room
        self._supply = supply
        self._holds = holds
        self._on_evict = on_evict

    def __len__(self) -> int:
        return len(self.entries)

    def make_room(self, charge_: int, nbytes: int, count: int = 1) -> None:
        """Evict (LRU first) and free spares until values of `charge_` in all fit, counting the spares of `nbytes`
        that `count` values of that size will reuse."""
        supply, entries, addresses, on_evict, holds = self._supply, self.entries, self.addresses, self._on_evict, self._holds
        if holds:
            holds.expire()
        passed = 0  # held entries passed by (moved to the most recently used end) in this call
        while True:
            reusable = supply.reusable(nbytes, count)
            excess = self.used + supply.spare_bytes - reusable + charge_ - self.capacity
            if excess <= 0:
                return
            # spares beyond those the values will reuse are freed first (none: no need to look for one)
            if supply.spare_bytes > reusable and supply.drop_one(nbytes, count):
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
                        self.held_evictions += 1
                    holds.forget(evicted_key)
                freed = charge(evicted_key, evicted)
                self.used -= freed
                excess -= freed
                evictions += 1
                if on_evict is not None:
                    on_evict(evicted_key, evicted)
                supply.retire(evicted, addresses.pop(evicted_key, None))
            self.evictions += evictions

    def remove(self, key: bytes) -> bool:
        """Take `key`'s value out of the index (its buffer retired, its holds gone); False if it had none."""
        old = self.entries.pop(key, None)
        if old is None:
            return False
        self.used -= charge(key, old)
        self._supply.retire(old, self.addresses.pop(key, None))
        if self._holds:
            self._holds.forget(key)
        return True

    def insert(self, key: bytes, value: Buffer, charge_: int, address: int | None = None) -> None:
        """Store `value` (charged `charge_`) under `key`, replacing any old value and making room for it."""
        self.remove(key)
        self.make_room(charge_, -1)
        self.entries[key] = value
        if address is not None:
            self.addresses[key] = address
        self.used += charge_

    def insert_many(
        self, keys: Sequence[bytes], values: Sequence[np.ndarray], reserved: Sequence[int], addresses: Sequence[int]
    ) -> None:
        """Store each value (one-dimensional uint8, at its address) under its key, replacing old values; each one's
        reservation (`reserved`, made by the caller) becomes its charge. Then make room for whatever the charges
        exceed the reservations by (nothing, when each reservation was its value's charge: the usual case)."""
        entries, known = self.entries, self.addresses
        if entries.keys().isdisjoint(keys):  # new keys, the usual save: the index takes them in C loops
            entries.update(zip(keys, values))
            known.update(zip(keys, addresses))
            self.used += sum(map(len, keys)) + sum(map(len, values)) + ENTRY_OVERHEAD * len(keys) - sum(reserved)
        else:
            for key, value, reserve, address in zip(keys, values, reserved, addresses):
                old = entries.pop(key, None)
                if old is not None:
                    self.used -= charge(key, old)
                    self._supply.retire(old, known.pop(key, None))
                    self._holds.forget(key)
                entries[key] = value
                known[key] = address
                self.used += charge(key, value) - reserve
        self.make_room(0, -1)

    def clear(self) -> None:
        self.entries.clear()
        self.addresses.clear()
        self.used = 0

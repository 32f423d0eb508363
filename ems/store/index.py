"""A store's index and its eviction policy: which values it holds, least recently used first, what they (and the
values being filled) are charged against the capacity, which leave when room is needed, and the holds eviction
passes by (leases and pins).

Contract (`LruIndex`, used by `ems.store.kv_store.KvStore` under the store's lock; not thread-safe by itself):
* `entries` maps each key to its value in LRU order (least recently used first); `addresses` holds each entry's
  buffer address where the store knows it. `used` counts the charges of the entries (`charge`: key, value and
  `ENTRY_OVERHEAD`) and of the reservations being filled (`reserve`, `unreserve`).
* `make_room(charge, nbytes, count)` evicts until values of `charge` in all fit beside `used` and the spares
  (`ems.store.recycling.BufferSupply`), counting the spares of `nbytes` that `count` values of that size will reuse:
  first spares nobody will reuse are freed, then the least recently used entries are evicted, passing held keys by
  (`Holds`, below: moved to the most recently used end, at most as many as are held) while anything else
  can make room; when nothing else can, held keys are evicted too, oldest first (a capacity is a hard limit:
  `held_evictions`). An evicted value goes to `on_evict` (if any), then its buffer to the supply (`retire`); its
  holds go with it.
* A value that leaves the index any other way (`remove`: replaced, deleted) is retired the same way but does not
  go to `on_evict`.

Holds: what a store keeps from eviction for its clients: leases (a lookup's promise to the load that follows) and pins
(records the pool must not lose, such as a model's namespace epoch).

Contract (used by `ems.store.kv_store.KvStore` under its lock; not thread-safe by itself):
* A **lease** on a key is granted by a lookup that asks for one (`ems.transport.exists_holds.Hold`, `HoldKind.LEASE`: an
  EXISTS with a lease, `ContextCaching.exists(..., lease_ms=...)`) and lasts until the key is read once (`release`: the load the
  lookup promised; any read of the key counts, so a read by another client in between ends it early, having made the
  key the most recently used one) or until `lease_ms` has passed, whichever comes first. Each grant adds a holder:
  two lookups of one key need two reads (or the timeout) to end it. A lease's time is capped at `MAX_LEASE_MS`.
* A **pin** (`HoldKind.PIN`) keeps a key until its value is replaced or deleted; pins are for small records.
* Budgets bound what clients can keep: leased keys' charges at most `lease_budget` bytes (half the store's capacity
  by default), pinned keys' at most `pin_budget` (1/64 of it). A grant past its budget is refused: the key is
  reported as not held (`hold_many`), so a lookup never promises a block it could not keep.
* Holds belong to a value: when the key's value leaves the store (replaced, deleted, or evicted because nothing
  else could make room) its holds go with it (`forget`).
* Eviction skips held keys while anything else can be evicted (`LruIndex.make_room`); a store whose
  evictable entries cannot make room for a new value evicts held ones too, oldest first (a capacity is a hard limit).
  With leases at most half the capacity, that takes a value larger than what is left unheld.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ems.buffers import Buffer
from ems.store.recycling import BufferSupply
from ems.transport.exists_holds import MAX_LEASE_MS, Hold, HoldKind

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


LEASE_SHARE = 2  # leased bytes: at most capacity // LEASE_SHARE
PIN_SHARE = 64  # pinned bytes: at most capacity // PIN_SHARE


@dataclass
class _Lease:
    holders: int
    expires: float  # time.monotonic()
    charge: int


class Holds:
    """The leases and pins of one store (see the module contract)."""

    def __init__(self, lease_budget: int, pin_budget: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_budget = lease_budget
        self.pin_budget = pin_budget
        self._clock = clock
        self.leases: dict[bytes, _Lease] = {}  # the keys leased now (read by the store's reads: `release`)
        self._pins: dict[bytes, int] = {}  # key -> its charge
        self._expiries: list[tuple[float, bytes]] = []  # a heap; entries of leases extended or ended are stale
        self.leased_bytes = 0
        self.pinned_bytes = 0
        self.refused = 0  # grants refused for want of budget

    @classmethod
    def for_capacity(cls, capacity_bytes: int) -> Holds:
        return cls(capacity_bytes // LEASE_SHARE, capacity_bytes // PIN_SHARE)

    def __len__(self) -> int:
        """Keys held (leases not yet found expired, and pins)."""
        return len(self.leases) + len(self._pins)

    def expire(self) -> None:
        """End the leases whose time has passed."""
        expiries = self._expiries
        if not expiries:
            return
        now = self._clock()
        while expiries and expiries[0][0] <= now:
            _, key = heapq.heappop(expiries)
            lease = self.leases.get(key)
            if lease is not None and lease.expires <= now:
                self._end_lease(key, lease)

    def keeps(self, key: bytes) -> bool:
        """Whether `key` is leased (not expired) or pinned: eviction passes it by."""
        if key in self._pins:
            return True
        lease = self.leases.get(key)
        return lease is not None and lease.expires > self._clock()

    def grant(self, key: bytes, charge: int, hold: Hold) -> bool:
        """Hold `key` (a value of `charge` bytes, in the store) as `hold` asks; False when its budget is used up."""
        if hold.kind is HoldKind.PIN:
            if key in self._pins:
                return True
            if self.pinned_bytes + charge > self.pin_budget:
                self.refused += 1
                return False
            self._pins[key] = charge
            self.pinned_bytes += charge
            return True
        expires = self._clock() + min(hold.lease_ms, MAX_LEASE_MS) / 1000.0
        lease = self.leases.get(key)
        if lease is None:
            if self.leased_bytes + charge > self.lease_budget:
                self.expire()  # leases past their time still count until found expired
                if self.leased_bytes + charge > self.lease_budget:
                    self.refused += 1
                    return False
            lease = self.leases[key] = _Lease(0, expires, charge)
            self.leased_bytes += charge
        lease.holders += 1
        if expires > lease.expires or lease.holders == 1:
            lease.expires = expires
            heapq.heappush(self._expiries, (expires, key))
        return True

    def release(self, key: bytes) -> None:
        """One read of `key`: one holder of its lease is done."""
        lease = self.leases.get(key)
        if lease is not None:
            lease.holders -= 1
            if lease.holders <= 0:
                self._end_lease(key, lease)

    def forget(self, key: bytes) -> None:
        """`key`'s value left the store: its holds go with it."""
        lease = self.leases.get(key)
        if lease is not None:
            self._end_lease(key, lease)
        charge = self._pins.pop(key, None)
        if charge is not None:
            self.pinned_bytes -= charge

    def clear(self) -> None:
        self.leases.clear()
        self._pins.clear()
        self._expiries.clear()
        self.leased_bytes = self.pinned_bytes = 0

    def _end_lease(self, key: bytes, lease: _Lease) -> None:
        del self.leases[key]
        self.leased_bytes -= lease.charge
        if not self.leases:
            self._expiries.clear()  # every entry is stale

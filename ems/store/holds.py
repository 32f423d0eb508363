"""What a store keeps from eviction for its clients: leases (a lookup's promise to the load that follows) and pins
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
* Eviction skips held keys while anything else can be evicted (`ems.store.index.LruIndex.make_room`); a store whose
  evictable entries cannot make room for a new value evicts held ones too, oldest first (a capacity is a hard limit).
  With leases at most half the capacity, that takes a value larger than what is left unheld.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass

from ems.transport.exists_holds import MAX_LEASE_MS, Hold, HoldKind

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
        self._leases: dict[bytes, _Lease] = {}
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
        return len(self._leases) + len(self._pins)

    def expire(self) -> None:
        """End the leases whose time has passed."""
        expiries = self._expiries
        if not expiries:
            return
        now = self._clock()
        while expiries and expiries[0][0] <= now:
            _, key = heapq.heappop(expiries)
            lease = self._leases.get(key)
            if lease is not None and lease.expires <= now:
                self._end_lease(key, lease)

    def keeps(self, key: bytes) -> bool:
        """Whether `key` is leased (not expired) or pinned: eviction passes it by."""
        if key in self._pins:
            return True
        lease = self._leases.get(key)
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
        lease = self._leases.get(key)
        if lease is None:
            if self.leased_bytes + charge > self.lease_budget:
                self.expire()  # leases past their time still count until found expired
                if self.leased_bytes + charge > self.lease_budget:
                    self.refused += 1
                    return False
            lease = self._leases[key] = _Lease(0, expires, charge)
            self.leased_bytes += charge
        lease.holders += 1
        if expires > lease.expires or lease.holders == 1:
            lease.expires = expires
            heapq.heappush(self._expiries, (expires, key))
        return True

    def release(self, key: bytes) -> None:
        """One read of `key`: one holder of its lease is done."""
        lease = self._leases.get(key)
        if lease is not None:
            lease.holders -= 1
            if lease.holders <= 0:
                self._end_lease(key, lease)

    def forget(self, key: bytes) -> None:
        """`key`'s value left the store: its holds go with it."""
        lease = self._leases.get(key)
        if lease is not None:
            self._end_lease(key, lease)
        charge = self._pins.pop(key, None)
        if charge is not None:
            self.pinned_bytes -= charge

    def clear(self) -> None:
        self._leases.clear()
        self._pins.clear()
        self._expiries.clear()
        self.leased_bytes = self.pinned_bytes = 0

    def _end_lease(self, key: bytes, lease: _Lease) -> None:
        del self._leases[key]
        self.leased_bytes -= lease.charge
        if not self._leases:
            self._expiries.clear()  # every entry is stale

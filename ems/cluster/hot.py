"""Hot placement units: how many read copies a unit every request reads (a shared system prompt) should have, so that
no node's reads grow with its popularity (Mooncake's "hot-replica fanout" is the anchor).

Contract (`HotUnits`, one per client):
* `read(units)` counts one call's reads (a u64 unit per value read, `ems.datapath.keys.chain_keys`) into a rate per
  unit that decays exponentially (half-life `half_life_s`), as it does the total.
* `copies(units, nodes)`: int per value, 1 for a cold unit. A unit whose share of the reads exceeds `target` times
  a group's fair share (1 / (nodes // UNIT_WIDTH)) gets ceil(share / (target * fair)) copies, at most `max_copies`:
  copy c is the unit's group of the `UNIT_WIDTH` nodes after its first c * UNIT_WIDTH in the unit's rendezvous
  order (`ems.cluster.rendezvous.ranked_by_hash`, `copy`), so copies move with membership as groups do. A reader spreads
  a hot unit's reads over its copies (`spread`), falling back to the unit's own group on a miss.
* Bounded and dropped when cold: at most `max_units` units are tracked (the coldest forgotten first), a unit whose
  rate decayed below `floor` of the total is forgotten, and a unit whose rate falls back gets fewer copies at once:
  reads stop going to the copy groups past its count, whose values the nodes' LRU eviction then reclaims.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np

from ems.cluster.rendezvous import UNIT_WIDTH

HALF_LIFE_S = 30.0
TARGET = 0.1  # a copy group takes at most this many fair group shares of a hot unit's reads
MAX_COPIES = 256
MAX_UNITS = 4096
FLOOR = 1e-5


class HotUnits:
    """Decayed read rates per unit and the copies they call for; see the module docstring. Thread-safe."""

    def __init__(
        self,
        half_life_s: float = HALF_LIFE_S,
        target: float = TARGET,
        max_copies: int = MAX_COPIES,
        max_units: int = MAX_UNITS,
        floor: float = FLOOR,
    ) -> None:
        if half_life_s <= 0 or target <= 0 or max_copies < 1 or max_units < 1:
            raise ValueError("half_life_s and target must be > 0, max_copies and max_units >= 1")
        self.half_life_s, self.target, self.max_copies = half_life_s, target, max_copies
        self.max_units, self.floor = max_units, floor
        self._rates: dict[int, float] = {}
        self._total = 0.0
        self._at: float | None = None  # when the rates were last decayed
        self._lock = threading.Lock()

    def _decay(self, now: float) -> None:
        if self._at is None or now <= self._at:
            self._at = now if self._at is None else self._at
            return
        factor = 0.5 ** ((now - self._at) / self.half_life_s)
        self._at = now
        self._total *= factor
        self._rates = {u: r * factor for u, r in self._rates.items() if r * factor >= self.floor * self._total}

    def read(self, units: np.ndarray, now: float | None = None) -> None:
        """Count one call's reads: one per value, by its unit."""
        uniq, counts = np.unique(np.asarray(units, dtype=np.uint64), return_counts=True)
        with self._lock:
            self._decay(time.monotonic() if now is None else now)
            self._total += float(counts.sum())
            for u, c in zip(uniq.tolist(), counts.tolist()):
                self._rates[u] = self._rates.get(u, 0.0) + c
            if len(self._rates) > self.max_units:
                keep = sorted(self._rates.items(), key=lambda item: item[1], reverse=True)[: self.max_units]
                self._rates = dict(keep)

    def copies(self, units: np.ndarray, nodes: int) -> np.ndarray:
        """int64 per value: how many copies its unit is read from (1: cold)."""
        units = np.asarray(units, dtype=np.uint64)
        groups = max(1, nodes // UNIT_WIDTH)
        out = np.ones(units.size, dtype=np.int64)
        with self._lock:
            if self._total <= 0 or groups == 1:
                return out
            fair = self._total / groups
            limit = min(self.max_copies, groups)
            uniq, inverse = np.unique(units, return_inverse=True)
            wanted = [min(limit, max(1, math.ceil(self._rates.get(u, 0.0) / (self.target * fair)))) for u in uniq.tolist()]
        return np.asarray(wanted, dtype=np.int64)[inverse.reshape(-1)]


def spread(copies: np.ndarray, salt: int) -> np.ndarray:
    """int64 per value: which of its unit's copies a reader asks first (the same copy for all values of a unit in
    one call, varying with `salt`: the call's, e.g. a counter or the engine's rank)."""
    picked: np.ndarray = np.int64(salt) % np.maximum(copies, 1)
    return picked

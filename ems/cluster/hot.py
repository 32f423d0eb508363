"""Hot placement units: how many read copies a unit every request reads (a shared system prompt) should have, so that
no node's reads grow with its popularity (Mooncake's "hot-replica fanout" is the anchor).

Contract (`HotUnits`, one per client):
* `read(units)` counts one call's reads (a u64 unit per value read, `ems.datapath.keys.chain_keys`) into a rate per
  unit that decays exponentially (half-life `half_life_s`), as it does the total; `read_copies(units, nodes)` counts
  them and gives their copies in one pass (what `ems.backends.node_router.NodeRouter` calls per read, with a few
  numpy operations for a call of cold units).
* `copies(units, nodes)`: int per value, 1 for a cold unit. A unit whose share of the reads exceeds `target` times
  a group's fair share (1 / (nodes // UNIT_WIDTH)), that was read at least `min_reads` times (decayed: a client's
  first few reads make no unit hot) and by at least `min_calls` calls (decayed: one prompt read once, however many
  blocks long, is not hot; a shared system prompt is read by call after call), gets ceil(share / (target * fair))
  copies, at most `max_copies`: copy c is the unit's group of the `UNIT_WIDTH` nodes after its first
  c * UNIT_WIDTH in the unit's rendezvous order (`ems.cluster.rendezvous.ranked_by_hash`, `copy`), so copies move
  with membership as groups do. A reader spreads a hot unit's reads over its copies (`spread`), falling back to the
  unit's own group on a miss.
* Bounded and dropped when cold: at most `max_units` units are tracked (the coldest forgotten first), a unit whose
  rate decayed below `floor` of the total is forgotten (when the table is pruned or renormalised), and a unit whose
  rate falls back gets fewer copies at once: reads stop going to the copy groups past its count, whose values the
  nodes' LRU eviction then reclaims.
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
MIN_READS = 256.0  # a unit needs this many reads (decayed) before its share counts: a client's first reads are not hot
MIN_CALLS = 4.0  # ... and this many calls that read it (decayed): a long prompt read once is not hot
RESCALE_HALF_LIVES = 64.0  # scores are renormalised once they have grown by 2 ** this


class HotUnits:
    """Decayed read rates per unit and the copies they call for; see the module docstring. Thread-safe.

    Rates decay lazily: a read at time t adds 2 ** ((t - t0) / half_life_s) to its unit's score and to the total (t0:
    the last renormalisation), so every rate and the total keep their ratios without touching every unit per call;
    once the scale passes 2 ** RESCALE_HALF_LIVES everything is brought back to t0 = now (and the units under `floor`
    dropped) in one pass."""

    def __init__(
        self,
        half_life_s: float = HALF_LIFE_S,
        target: float = TARGET,
        max_copies: int = MAX_COPIES,
        max_units: int = MAX_UNITS,
        floor: float = FLOOR,
        min_reads: float = MIN_READS,
        min_calls: float = MIN_CALLS,
    ) -> None:
        if half_life_s <= 0 or target <= 0 or max_copies < 1 or max_units < 1 or min_reads < 0 or min_calls < 0:
            raise ValueError("half_life_s and target must be > 0, max_copies and max_units >= 1, min_reads and min_calls >= 0")
        self.half_life_s, self.target, self.max_copies = half_life_s, target, max_copies
        self.max_units, self.floor, self.min_reads, self.min_calls = max_units, floor, min_reads, min_calls
        self._rates: dict[int, float] = {}  # unit -> score (its decayed rate, scaled as the total is)
        self._calls: dict[int, float] = {}  # unit -> the calls that read it, on the same scale
        self._total = 0.0
        self._t0: float | None = None  # the time scores are scaled from
        self._latest = 0.0  # the latest time seen (a read never counts as earlier)
        self._lock = threading.Lock()

    def _weight(self, now: float) -> float:
        """What one read at `now` adds to a score (renormalising first when the scale has grown too large)."""
        if self._t0 is None:
            self._t0 = self._latest = now
        now = max(now, self._latest)
        self._latest = now
        exponent = (now - self._t0) / self.half_life_s
        if exponent > RESCALE_HALF_LIVES:
            factor = 0.5**exponent
            self._total *= factor
            self._rates = {
                u: r * factor for u, r in self._rates.items() if r * factor > 0 and r * factor >= self.floor * self._total
            }
            self._calls = {u: self._calls.get(u, 0.0) * factor for u in self._rates}
            self._t0, exponent = now, 0.0
        return float(2.0**exponent)

    def _prune(self) -> None:
        """Back under `max_units` (to 3/4 of it, so the sort is paid once per many new units): the coldest and the
        units under `floor` forgotten."""
        keep = sorted(self._rates.items(), key=lambda item: item[1], reverse=True)[: max(1, self.max_units * 3 // 4)]
        self._rates = {u: r for u, r in keep if r >= self.floor * self._total}
        self._calls = {u: self._calls.get(u, 0.0) for u in self._rates}

    def read(self, units: np.ndarray, now: float | None = None) -> None:
        """Count one call's reads: one per value, by its unit."""
        uniq, counts = np.unique(np.asarray(units, dtype=np.uint64), return_counts=True)
        with self._lock:
            self._count(uniq.tolist(), counts.tolist(), time.monotonic() if now is None else now)

    def _count(self, uniq: list[int], counts: list[int], now: float) -> None:
        weight = self._weight(now)
        self._total += weight * sum(counts)
        for u, c in zip(uniq, counts):
            self._rates[u] = self._rates.get(u, 0.0) + weight * c
            self._calls[u] = self._calls.get(u, 0.0) + weight
        if len(self._rates) > self.max_units:
            self._prune()

    def _wanted(self, uniq: list[int], nodes: int) -> list[int]:
        groups = max(1, nodes // UNIT_WIDTH)
        if self._total <= 0 or groups == 1:
            return [1] * len(uniq)
        share = self.target * self._total / groups
        scale = 2.0 ** ((self._latest - (self._t0 or 0.0)) / self.half_life_s)  # (the scores' scale now)
        least, least_calls = self.min_reads * scale, self.min_calls * scale
        limit = min(self.max_copies, groups)
        wanted = []
        for u in uniq:
            rate = self._rates.get(u, 0.0)
            cold = rate < least or self._calls.get(u, 0.0) < least_calls
            wanted.append(1 if cold else min(limit, max(1, math.ceil(rate / share))))
        return wanted

    def copies(self, units: np.ndarray, nodes: int) -> np.ndarray:
        """int64 per value: how many copies its unit is read from (1: cold)."""
        uniq, inverse = np.unique(np.asarray(units, dtype=np.uint64), return_inverse=True)
        with self._lock:
            wanted = self._wanted(uniq.tolist(), nodes)
        return np.asarray(wanted, dtype=np.int64)[inverse.reshape(-1)]

    def read_copies(self, units: np.ndarray, nodes: int, now: float | None = None) -> np.ndarray | None:
        """`read(units)` then `copies(units, nodes)` in one pass (one `np.unique`, one lock): what a reader calls
        per call. None when every unit of the call is cold (1 copy: its own group)."""
        uniq, inverse, counts = _unique(np.asarray(units, dtype=np.uint64))
        keys = uniq.tolist()
        with self._lock:
            self._count(keys, counts.tolist(), time.monotonic() if now is None else now)
            wanted = self._wanted(keys, nodes)
        if max(wanted, default=1) <= 1:
            return None
        per_value: np.ndarray = np.asarray(wanted, dtype=np.int64)[inverse]
        return per_value

    def tracked(self) -> int:
        """How many units are tracked now (at most `max_units`)."""
        with self._lock:
            return len(self._rates)


def _unique(units: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`np.unique(units, return_inverse=True, return_counts=True)`, without its sort for a call of one unit (the
    usual: a call's blocks are consecutive in a chain)."""
    if units.size and units[0] == units[-1] and bool((units == units[0]).all()):
        return units[:1], np.zeros(units.size, dtype=np.int64), np.array([units.size], dtype=np.int64)
    uniq, inverse, counts = np.unique(units, return_inverse=True, return_counts=True)
    return uniq, inverse.reshape(-1), counts


def spread(copies: np.ndarray, salt: int) -> np.ndarray:
    """int64 per value: which of its unit's copies a reader asks first (the same copy for all values of a unit in
    one call, varying with `salt`: the call's, e.g. a counter or the engine's rank)."""
    picked: np.ndarray = np.int64(salt) % np.maximum(copies, 1)
    return picked

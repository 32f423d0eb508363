"""A client's reads of hot units' copies (`ems.cluster.hot`): which node a read asks first, and the background writes
that make the copies (used by `ems.backends.node_router.NodeRouter`; one per router).

Contract (`HotReads`):
* `first(request, wanted, view, count)`: per read call whose keys have units (`PoolCall.units`). Counts the wanted
  keys' reads by unit (`HotUnits.read_copies`; with `count` False, `HotUnits.copies` only: an `exists` asks where
  the reads go but is not a read) and returns int64 per key: the node to ask first (an index into `view.nodes`, -1:
  none), or None when no wanted key asks a copy (every unit cold, or the spread picked their own groups): the read is
  then exactly the owners' read. A key of a unit with k > 1 copies asks copy group `spread(k, salt)` (salt: a
  counter per router, one step per call), at the node its own hash ranks first in that group
  (`ems.cluster.rendezvous.ranked_by_hash`, `copy`); group 0 is the unit's own group, which asks no node first.
  A pool of fewer than two groups (`2 * UNIT_WIDTH` nodes) has no copies: nothing is counted.
* `write_back(view, first, served, keys, value)` (after the read, `first` as the read left it: -1 where it asked no
  node first): each key that asked a copy node first but took its value from
  another node (a miss there, a damaged value, a failed node: `served`, by `ems.backends.reads.read`) is written to
  that copy node in the background: its bytes are copied as the call returns (`value(i)`, a value already checked
  against the call's `expected`), then one PUT per copy node, within the request limits and `COPY_TIMEOUT_S`, on
  threads of its own. Saves make no copies: reads do.
* Bounded: at most `max_bytes` of values and `max_calls` PUTs in flight; what does not fit is not copied (the next
  read that misses there tries again). Never fails the caller's call and never waits for a write; a failed or
  refused write is only counted (`HotStats`). The copies are a cache: the copy nodes' LRU evicts them, a damaged or
  missing one is a miss that falls back to the owners.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import threading
from collections.abc import Callable, Sequence

import numpy as np

from ems.backends.base import PoolCall
from ems.backends.fanout import FanOut
from ems.buffers import Buffer
from ems.cluster.hot import HotUnits, spread
from ems.cluster.placement import View
from ems.cluster.rendezvous import UNIT_WIDTH, ranked_by_hash, route_hashes
from ems.records import Deadline
from ems.transport.base import NodeClient
from ems.transport.protocol import Costs, RequestLimits, key_lens

COPY_BYTES = 64 << 20  # value bytes of copy writes in flight, at most
COPY_CALLS = 8  # copy PUTs in flight (queued or sent), at most
COPY_THREADS = 2
COPY_TIMEOUT_S = 5.0


@dataclasses.dataclass
class HotStats:
    """What a client's hot reads did (values): asked of a copy first, taken from it, and the copy writes."""

    asked: int = 0  # values a read asked a copy node for first
    hits: int = 0  # ... and took from it
    written: int = 0  # values a copy node stored
    failed: int = 0  # values a copy write sent that were not stored (refused, the node failed or timed out)
    dropped: int = 0  # values not sent: the writes in flight were at their bound


class HotReads:
    """Hot units' copies as one client reads and writes them; see the module docstring. Thread-safe."""

    def __init__(
        self,
        fanout: FanOut,
        limits: RequestLimits,
        hot: HotUnits | None = None,
        max_bytes: int = COPY_BYTES,
        max_calls: int = COPY_CALLS,
        timeout_s: float = COPY_TIMEOUT_S,
    ) -> None:
        if max_bytes < 0 or max_calls < 0 or timeout_s <= 0:
            raise ValueError("max_bytes and max_calls must be >= 0, timeout_s > 0")
        self.fanout, self.limits = fanout, limits
        self.hot = hot if hot is not None else HotUnits()
        self.max_bytes, self.max_calls, self.timeout_s = max_bytes, max_calls, timeout_s
        self.stats = HotStats()
        self._salt = itertools.count()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._bytes = 0  # in flight
        self._calls = 0
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    def first(self, request: PoolCall, wanted: np.ndarray, view: View, count: bool = True) -> np.ndarray | None:
        """The node each key asks first, or None (see the module docstring)."""
        units, n = request.units, len(view.nodes)
        if units is None or n < 2 * UNIT_WIDTH:
            return None
        idx = np.nonzero(wanted)[0]
        if idx.size == 0:
            return None
        wanted_units = np.asarray(units, dtype=np.uint64)[idx]
        if count:
            copies = self.hot.read_copies(wanted_units, n)
        else:
            copies = self.hot.copies(wanted_units, n)
            copies = copies if int(copies.max()) > 1 else None
        if copies is None:
            return None
        pick = spread(copies, next(self._salt))
        asked = pick > 0
        if not asked.any():
            return None
        rows = idx[asked]
        route_keys = request.route_keys
        hashes = route_hashes([route_keys[i] for i in rows.tolist()])
        first = np.full(len(request.keys), -1, dtype=np.int64)
        first[rows] = ranked_by_hash(hashes, view.seeds, 1, wanted_units[asked], copy=pick[asked])[:, 0]
        return first

    def write_back(
        self,
        view: View,
        first: np.ndarray,
        served: np.ndarray,
        keys: Sequence[bytes],
        value: Callable[[int], Buffer],
    ) -> None:
        """Copy the values read elsewhere than their copy node to it, in the background (see the module docstring)."""
        back = (first >= 0) & (served >= 0) & (served != first)
        asked, hits = int((first >= 0).sum()), int(((first >= 0) & (served == first)).sum())
        rows = np.nonzero(back)[0]
        if rows.size == 0:
            with self._lock:
                self.stats.asked += asked
                self.stats.hits += hits
            return
        targets = first[rows]
        sizes = np.fromiter((memoryview(value(i)).nbytes for i in rows.tolist()), dtype=np.int64, count=rows.size)
        chosen: list[tuple[int, np.ndarray]] = []
        with self._lock:
            self.stats.asked += asked
            self.stats.hits += hits
            if self._closed:
                return
            for j in np.unique(targets).tolist():
                mine = rows[targets == j]
                nbytes = int(sizes[targets == j].sum())
                if self._calls >= self.max_calls or self._bytes + nbytes > self.max_bytes:
                    self.stats.dropped += int(mine.size)
                    continue
                self._calls += 1
                self._bytes += nbytes
                chosen.append((j, mine))
            executor = self._pool() if chosen else None
        for j, mine in chosen:
            # the bytes now: the caller may reuse its buffers once the call returns
            values = [memoryview(value(i)).tobytes() for i in mine.tolist()]
            node_keys = [keys[i] for i in mine.tolist()]
            try:
                assert executor is not None
                executor.submit(self._write, view.nodes[j], node_keys, values)
            except RuntimeError:  # closed meanwhile: nothing sent
                self._done(len(node_keys), 0, sum(len(v) for v in values))

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """(under the lock)"""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=COPY_THREADS, thread_name_prefix="ems-hot")
        return self._executor

    def _write(self, node: NodeClient, keys: list[bytes], values: list[bytes]) -> None:
        nbytes = sum(len(v) for v in values)
        stored = 0
        try:

            def put(target: NodeClient, idx: np.ndarray, d: Deadline) -> list[bool]:
                return target.put([keys[i] for i in idx.tolist()], [[values[i]] for i in idx.tolist()], d)

            lens = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
            costs: Costs = RequestLimits.put_costs(key_lens(keys), lens, np.ones(len(values), dtype=np.int64))
            answer = self.fanout.run(node, np.arange(len(keys)), put, costs, Deadline.after(self.timeout_s), observe=False)
            stored = sum(bool(a) for a in answer.answers)
        except Exception:  # a copy is a cache: whatever fails here is counted, never raised (this is no caller's call)
            pass
        finally:
            self._done(len(keys), stored, nbytes)

    def _done(self, sent: int, stored: int, nbytes: int) -> None:
        """A copy write ended (`stored` of its `sent` values stored): its bytes and call are no longer in flight."""
        with self._lock:
            self.stats.written += stored
            self.stats.failed += sent - stored
            self._calls -= 1
            self._bytes -= nbytes
            self._idle.notify_all()

    def idle(self, timeout_s: float) -> bool:
        """Wait until no copy write is in flight (tests, benchmarks); False when some still are after `timeout_s`."""
        deadline = Deadline.after(timeout_s)
        with self._lock:
            while self._calls > 0:
                left = deadline.left()
                if left <= 0:
                    return False
                self._idle.wait(left)
            return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

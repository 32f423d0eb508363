"""What the pool client has observed of each node's speed, and the waits derived from it: when a read is hedged to
another owner, how long a write waits for an owner that lags behind the others, and which nodes are slow.

Contract (`NodeLatency`, thread-safe):
* `observe(address, nbytes, seconds)`: one answered request of `nbytes` value bytes to a node, timed from its
  start. Each node's model is a round trip (`base_s`, an average of its requests under `SMALL_BYTES`) and a
  throughput (`bytes_per_s`, an average of its larger requests, their base taken off); both are exponentially
  weighted averages (`ALPHA`), so a node that slows down or recovers shows it within a few requests. A node with no
  observation yet gets `DEFAULT_BASE_S` and `DEFAULT_BYTES_PER_S`.
* `stopped(address, nbytes, seconds)`: a request of the node was stopped after `seconds` without its answer (its
  keys served elsewhere, `FanOut.abandon`): the node is at least that slow, and its model takes that figure as it is
  (the slower of it and the model, not averaged in), so it is seen slow at once instead of after several requests.
* `expected(nbytes)`: how long a request of `nbytes` takes on a typical node: the median of the nodes' models
  (so one slow node, which is what hedging is for, does not move it), recomputed at most every `TYPICAL_EVERY_S`.
* `hedge_delay(nbytes)`: how long a read waits for its node before asking the next owner too: `HEDGE_FACTOR`
  times `expected(nbytes)`, plus `HEDGE_FLOOR_S` (scheduling noise on a busy host). `abort_delay(nbytes)`: how long
  a request may run before it is stopped (its connection aborted) when its keys were served elsewhere:
  `ABORT_FACTOR` times `expected(nbytes)`, at least `ABORT_FLOOR_S`; a write whose every key already has a copy
  waits that long for the owners not done yet, a hedged read into the caller's buffers that long for the slow
  request to finish by itself.
* `slow(address)`: the node's own model predicts more than `SLOW_FACTOR` times the typical one for the request it
  last answered (at least `SMALL_BYTES`: a node slow at moving bytes is slow however short its round trip),
  after at least `SLOW_MIN_SAMPLES` answers of its own (one answer is no evidence: a node's first request pays for
  connecting, an in-process one's for a thread's first run) or one stopped request; reads then ask it last among a
  key's owners. A slow node is given another try (asked in its turn again) once
  `RETRY_SLOW_S` passed since it was marked, so a node that recovered is seen to.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time

SMALL_BYTES = 64 << 10
ALPHA = 0.2
DEFAULT_BASE_S = 0.001
DEFAULT_BYTES_PER_S = 1e9
HEDGE_FACTOR = 3.0
HEDGE_FLOOR_S = 0.005
# stopping a node's request aborts its connection (the node's other requests in flight fail too, and the next call
# reconnects): done only past a much larger wait, so that a busy host's scheduling noise never does it
ABORT_FACTOR = 10.0
ABORT_FLOOR_S = 0.05
# a node 10x slower reads as about 6x: the client's own part of every answer is the same on every node (measured
# through perf/sim_scale.py's router over 1,024 simulated nodes); a node judged slow by mistake is only asked last
# for RETRY_SLOW_S, its blocks read from their other owners
SLOW_FACTOR = 4.0
SLOW_MIN_SAMPLES = 3
RETRY_SLOW_S = 2.0
TYPICAL_EVERY_S = 0.05


@dataclasses.dataclass
class _Model:
    base_s: float = DEFAULT_BASE_S
    bytes_per_s: float = DEFAULT_BYTES_PER_S
    samples: int = 0
    slow_since: float | None = None

    def predict(self, nbytes: int) -> float:
        return self.base_s + nbytes / self.bytes_per_s


class NodeLatency:
    """Per-node speed models; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, _Model] = {}
        self._typical = _Model()  # the median model, recomputed at most every TYPICAL_EVERY_S
        self._typical_at = 0.0
        self.any_slow = False  # (read without the lock: a hint that spares the callers a look per node)

    def observe(self, address: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            model = self._models.setdefault(address, _Model())
            first = model.samples == 0
            if nbytes < SMALL_BYTES:
                model.base_s = seconds if first else (1 - ALPHA) * model.base_s + ALPHA * seconds
            else:
                rate = nbytes / max(seconds - model.base_s, seconds / 2, 1e-6)
                model.bytes_per_s = rate if first else (1 - ALPHA) * model.bytes_per_s + ALPHA * rate
            model.samples += 1
            self._update(model, nbytes, first, judged=model.samples >= SLOW_MIN_SAMPLES)

    def stopped(self, address: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            model = self._models.setdefault(address, _Model())
            first = model.samples == 0
            if nbytes < SMALL_BYTES:
                model.base_s = max(model.base_s, seconds)
            else:
                model.bytes_per_s = min(model.bytes_per_s, nbytes / max(seconds - model.base_s, seconds / 2, 1e-6))
            model.samples += 1
            self._update(model, nbytes, first, judged=True)

    def _update(self, model: _Model, nbytes: int, first: bool, judged: bool) -> None:
        """The typical model (now and then) and whether `model`'s node is slow at the size it was just asked for
        (`nbytes`, at least SMALL_BYTES: a node slow at moving bytes is slow whatever its round trip), after it
        changed (lock held); a node not `judged` yet (too few answers) is not marked slow."""
        now = time.monotonic()
        if first or now - self._typical_at > TYPICAL_EVERY_S:
            self._typical = self._median()
            self._typical_at = now
        size = max(nbytes, SMALL_BYTES)
        too_slow = model.predict(size) > SLOW_FACTOR * self._typical.predict(size)
        if too_slow and len(self._models) > 1:
            if model.slow_since is None and judged:
                model.slow_since = now
                self.any_slow = True
        elif model.slow_since is not None:
            model.slow_since = None
            self.any_slow = any(m.slow_since is not None for m in self._models.values())

    def _median(self) -> _Model:
        """The median model of the nodes observed (a default one before any)."""
        models = [m for m in self._models.values() if m.samples]
        if not models:
            return _Model()
        return _Model(statistics.median(m.base_s for m in models), statistics.median(m.bytes_per_s for m in models))

    def expected(self, nbytes: int) -> float:
        return self._typical.predict(nbytes)

    def hedge_delay(self, nbytes: int) -> float:
        return HEDGE_FACTOR * self.expected(nbytes) + HEDGE_FLOOR_S

    def abort_delay(self, nbytes: int) -> float:
        return max(ABORT_FACTOR * self.expected(nbytes), ABORT_FLOOR_S)

    def slow(self, address: str) -> bool:
        if not self.any_slow:
            return False
        with self._lock:
            model = self._models.get(address)
            if model is None or model.slow_since is None:
                return False
            if time.monotonic() - model.slow_since > RETRY_SLOW_S:
                model.slow_since = time.monotonic()  # one more try now; marked again only by its next answers
                return False
            return True

    def forget(self, address: str) -> None:
        """A node that left (or came back as another incarnation) starts afresh."""
        with self._lock:
            self._models.pop(address, None)
            self.any_slow = any(m.slow_since is not None for m in self._models.values())
            self._typical = self._median()

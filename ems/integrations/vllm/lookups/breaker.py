"""Scheduler lookups that a hung pool node cannot stall: a short timeout, then a circuit breaker.

Contract (no engine imports):
* `LookupBreaker.lookup(hashes, epoch)` is `block_transfer.lookup` with its own timeout (`lookup_timeout_ms`) and
  lease (`lease_ms`: the blocks it reports are kept for the load), so one lookup costs the scheduler's step at most
  that long. The breaker's probes ask without a lease (no load follows them).
* A lookup that comes back short only at its timeout (`exists` reports a failing node as 0 hits, so the time it
  took is what tells a hung node from a miss) opens the breaker: from then on `lookup` answers 0 at once, without
  the network. A daemon thread re-asks the pool for the keys of that last lookup every `cooldown_s`; the first
  answer that comes back in time closes the breaker. So a node that hangs costs the engine at most one lookup
  timeout per opening, never one per request or per step. A lookup that was merely slow (a loaded host) and trips
  it costs only misses until the next probe. `lookup(..., trips=False)` is the same lookup that never opens the
  breaker: a timeout is a short answer (a lookup of blocks still on their way to the pool, whose node may be busy
  receiving them: the caller asks again within its own bound). Saves are not held back: the workers' movers drop what their
  in-flight budget cannot take, so a hung node never blocks a step through them either.
* `lookup_within(hashes, epoch, timeout_s)`: the same lookup under the caller's own timeout (the step policy's
  in-step lookups, `step_policy`), answering a `TimedLookup` (hits, seconds, whether it used its whole timeout): it
  never trips the breaker (the caller decides what a timeout means; the lookup thread's lookups keep deciding
  whether the pool is down), and with the breaker open it answers 0 at once.
* `on_lookup` (optional): called with the seconds of every lookup that came back in time (the step policy's
  latency measurement).
* Counted in `stats`: `lookup_skipped_blocks` (asked while open) and `breaker_trips`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ems import CcKvOption, ContextCaching, EmsException
from ems.integrations.block_transfer import lookup
from ems.integrations.engine_keys import EngineHash
from ems.integrations.transfer_stats import StatsSink

logger = logging.getLogger("ems.integrations")

SLOW_FRACTION = 0.95  # a lookup this close to its timeout counts as timed out


@dataclass(frozen=True)
class TimedLookup:
    hits: int
    seconds: float
    timed_out: bool  # came back short only at its timeout (a slow or hung pool)


class LookupBreaker:
    def __init__(
        self,
        cc: ContextCaching,
        tp_size: int,
        shared: bool,
        lookup_timeout_ms: int,
        cooldown_s: float,
        stats: StatsSink | None = None,
        lease_ms: int = 0,
    ) -> None:
        self._cc = cc
        self._lease_ms = lease_ms
        self._tp_size, self._shared = tp_size, shared
        self._option = CcKvOption(timeout=lookup_timeout_ms)
        self._slow_s = SLOW_FRACTION * lookup_timeout_ms / 1000
        self._cooldown_s = cooldown_s
        self._stats = stats
        self._lock = threading.Lock()
        self._open = False
        self._probe: tuple[list[EngineHash], bytes, list[EngineHash] | None] | None = None
        self._stop = threading.Event()
        self.on_lookup: Callable[[float], None] | None = None

    @property
    def leases(self) -> bool:
        """Lookups lease what they report (`lease_ms` > 0)."""
        return self._lease_ms > 0

    def is_open(self) -> bool:
        with self._lock:
            return self._open

    def lookup(
        self, hashes: Sequence[EngineHash], epoch: bytes = b"", trips: bool = True, prefix: Sequence[EngineHash] | None = None
    ) -> int:
        """`block_transfer.lookup` under the breaker (`prefix`: its `chain_prefix`)."""
        if not hashes:
            return 0
        if self.is_open():
            if self._stats is not None:
                self._stats.add(lookup_skipped_blocks=len(hashes))
            return 0
        started = time.monotonic()
        hits = lookup(
            self._cc, hashes, self._tp_size, self._shared, self._option, epoch=epoch, lease_ms=self._lease_ms, chain_prefix=prefix
        )
        seconds = time.monotonic() - started
        if hits < len(hashes) and seconds >= self._slow_s:
            if not trips:
                return hits
            self._trip(list(hashes), epoch, prefix)
            return 0
        if self.on_lookup is not None:
            self.on_lookup(seconds)
        return hits

    def lookup_within(
        self, hashes: Sequence[EngineHash], epoch: bytes, timeout_s: float, prefix: Sequence[EngineHash] | None = None
    ) -> TimedLookup:
        """A lookup under `timeout_s` (at least 1 ms); never trips the breaker (see the module contract)."""
        if not hashes or self.is_open():
            return TimedLookup(self.lookup(hashes, epoch, prefix=prefix), 0.0, False)  # (open: skipped, 0 at once)
        timeout_ms = max(1, int(timeout_s * 1000))
        option = CcKvOption(timeout=timeout_ms)
        started = time.monotonic()
        hits = lookup(
            self._cc, hashes, self._tp_size, self._shared, option, epoch=epoch, lease_ms=self._lease_ms, chain_prefix=prefix
        )
        seconds = time.monotonic() - started
        timed_out = hits < len(hashes) and seconds >= SLOW_FRACTION * timeout_ms / 1000
        if not timed_out and self.on_lookup is not None:
            self.on_lookup(seconds)
        return TimedLookup(hits, seconds, timed_out)

    def _trip(self, hashes: list[EngineHash], epoch: bytes, prefix: Sequence[EngineHash] | None = None) -> None:
        with self._lock:
            if self._open:
                return
            self._open = True
            self._probe = (hashes, epoch, None if prefix is None else list(prefix))
        if self._stats is not None:
            self._stats.add(breaker_trips=1)
        logger.warning(
            "a pool lookup took its whole timeout (%.0f ms): the pool counts as down (lookups miss at once) "
            "until it answers in time again (asked every %.1f s)",
            self._option.timeout,
            self._cooldown_s,
        )
        threading.Thread(target=self._probe_until_closed, name="ems-breaker", daemon=True).start()

    def _probe_until_closed(self) -> None:
        while not self._stop.wait(self._cooldown_s):
            with self._lock:
                probe = self._probe
            if probe is None:
                return
            hashes, epoch, prefix = probe
            started = time.monotonic()
            try:
                lookup(self._cc, hashes, self._tp_size, self._shared, self._option, epoch=epoch, chain_prefix=prefix)
            except EmsException:  # the client was shut down under the probe: nothing left to watch
                return
            if time.monotonic() - started < self._slow_s:
                with self._lock:
                    self._open = False
                    self._probe = None
                logger.warning("the pool answers in time again: lookups and saves resume")
                return

    def close(self) -> None:
        self._stop.set()

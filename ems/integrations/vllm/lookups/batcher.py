"""Scheduler lookups off the scheduler's thread: asked in one batch per engine step, answered in the background.

Contract (no engine imports):
* `ask(req_id, hashes, epoch)` records a lookup (the request's blocks past its local hit, engine block hashes
  chained over the prefix as vLLM's are, so equal hashes mean equal prefixes); `dispatch()` (once per step, after
  the scheduler has seen every waiting request) hands everything asked since the last dispatch to one daemon
  thread as a batch, and returns at once. `answer(req_id)` gives the number of leading blocks the pool holds, once
  the batch is answered (None until then: vLLM asks again next step); `forget(req_id)` drops a request.
* A batch costs the network as little as it can: requests sharing a prefix share what was learnt. Requests are
  answered longest first; a request whose next unknown block is known missing is answered without the network; the
  rest is one `LookupBreaker.lookup` (`exists` under the lookup timeout, the circuit breaker). Without leases a
  request's leading blocks already known present are skipped, so a block is asked for once per batch; with leases
  (`LookupBreaker.leases`) every request that may hit asks for its blocks up to the first one known missing: each
  load ends one lease holder, so two requests that will both load a block must each hold one. With the breaker open
  every answer is 0 at once (no network). An ask with `trips=False` (a request waiting for blocks still on their
  way to the pool) never opens the breaker: its timeout is a short answer (`LookupBreaker.lookup`).
* `wait(timeout_s)` waits for the batch in flight (an engine step with nothing else to run, instead of spinning).
* `take_answered()`: the batches answered since the last call and their seconds on the thread (the per-step record).
* `close()` stops the thread.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ems.integrations.engine_keys import EngineHash
from ems.integrations.vllm.lookups.breaker import LookupBreaker

logger = logging.getLogger("ems.integrations")


@dataclass(frozen=True)
class _Ask:
    req_id: str
    hashes: tuple[EngineHash, ...]
    epoch: bytes
    trips: bool = True  # a timeout opens the breaker (False: a short answer)
    prefix: tuple[EngineHash, ...] | None = None  # the chain's hashes before hashes[0] (None: placed per key)

    def before(self, i: int) -> tuple[EngineHash, ...] | None:
        """The chain prefix of `hashes[i:]`."""
        return None if self.prefix is None else self.prefix + self.hashes[:i]


def answer_batch(asks: Sequence[_Ask], breaker: LookupBreaker) -> dict[str, int]:
    """Each ask's count of leading blocks in the pool, sharing what one answer tells about another's blocks."""
    present: set[tuple[bytes, EngineHash]] = set()
    missing: set[tuple[bytes, EngineHash]] = set()
    answers: dict[str, int] = {}
    leases = breaker.leases
    for ask in sorted(asks, key=lambda a: len(a.hashes), reverse=True):
        hashes, epoch = ask.hashes, ask.epoch
        known = 0
        while known < len(hashes) and (epoch, hashes[known]) in present:
            known += 1
        ends_known = known == len(hashes) or (epoch, hashes[known]) in missing
        if ends_known and (known == 0 or not leases):
            answers[ask.req_id] = known
            continue
        if leases:  # its own lease on every block it may load (up to the first known missing one)
            end = next((i for i in range(known, len(hashes)) if (epoch, hashes[i]) in missing), len(hashes))
            hits = breaker.lookup(hashes[:end], epoch, ask.trips, ask.before(0))
        else:
            hits = known + breaker.lookup(hashes[known:], epoch, ask.trips, ask.before(known))
        present.update((epoch, h) for h in hashes[known:hits])
        if hits < len(hashes):
            missing.add((epoch, hashes[hits]))
        answers[ask.req_id] = hits
    return answers


class LookupBatcher:
    def __init__(self, breaker: LookupBreaker) -> None:
        self._breaker = breaker
        self._cond = threading.Condition()
        self._asked: dict[str, _Ask] = {}  # since the last dispatch
        self._batches: collections.deque[list[_Ask]] = collections.deque()
        self._busy = False
        self._waiting: dict[str, _Ask] = {}  # dispatched, not answered
        self._answers: dict[str, tuple[_Ask, int]] = {}
        self._stop = False
        self._answered = (0, 0.0)  # batches answered since `take_answered`, their seconds
        self._thread = threading.Thread(target=self._run, name="ems-lookup", daemon=True)
        self._thread.start()

    def ask(
        self,
        req_id: str,
        hashes: Sequence[EngineHash],
        epoch: bytes = b"",
        trips: bool = True,
        prefix: Sequence[EngineHash] | None = None,
    ) -> None:
        """(`prefix`: the chain's hashes before hashes[0], for placement by units; None: placed per key.)"""
        with self._cond:
            self._answers.pop(req_id, None)
            self._asked[req_id] = _Ask(req_id, tuple(hashes), epoch, trips, None if prefix is None else tuple(prefix))

    def asked(self, req_id: str) -> bool:
        """A lookup of the request is recorded or in flight (not answered yet)."""
        with self._cond:
            return req_id in self._asked or req_id in self._waiting

    def dispatch(self) -> int:
        """Hand what was asked since the last dispatch to the thread as one batch; the number of lookups in it."""
        with self._cond:
            if not self._asked:
                return 0
            batch = list(self._asked.values())
            self._asked.clear()
            self._waiting.update((a.req_id, a) for a in batch)
            self._batches.append(batch)
            self._cond.notify_all()
            return len(batch)

    def answer(self, req_id: str) -> int | None:
        with self._cond:
            found = self._answers.pop(req_id, None)
        return None if found is None else found[1]

    def forget(self, req_id: str) -> None:
        with self._cond:
            self._asked.pop(req_id, None)
            self._waiting.pop(req_id, None)
            self._answers.pop(req_id, None)

    def pending(self) -> bool:
        with self._cond:
            return bool(self._waiting)

    def wait(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` until no dispatched lookup is left unanswered."""
        with self._cond:
            self._cond.wait_for(lambda: not self._waiting or self._stop, timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._batches or self._stop)
                if self._stop:
                    return
                batch = self._batches.popleft()
            started = time.perf_counter()
            try:
                answers = answer_batch(batch, self._breaker)
            except Exception:  # e.g. the client shut down under us: every request of the batch is a miss
                logger.exception("EmsConnector: a lookup batch failed; its requests count as misses")
                answers = {a.req_id: 0 for a in batch}
            with self._cond:
                count, seconds = self._answered
                self._answered = (count + 1, seconds + time.perf_counter() - started)
                for ask in batch:
                    # only the lookup still wanted: a request forgotten or asked again meanwhile drops this answer
                    if self._waiting.get(ask.req_id) is ask:
                        del self._waiting[ask.req_id]
                        self._answers[ask.req_id] = (ask, answers[ask.req_id])
                self._cond.notify_all()

    def take_answered(self) -> tuple[int, float]:
        """Batches answered since the last call, and their seconds on the lookup thread."""
        with self._cond:
            answered, self._answered = self._answered, (0, 0.0)
        return answered

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

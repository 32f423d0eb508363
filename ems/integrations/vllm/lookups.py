"""The scheduler half's pool lookups: how many blocks past vLLM's local hit the pool holds (and leases) for a request.

Contract (no vLLM imports; `scheduler.EmsScheduler` calls it from vLLM's scheduler thread):
* `match(req_id, start, full, epoch, hashes)`: the request's blocks `start..full` (`hashes()` gives their engine
  hashes, asked for only when needed) in `epoch`. Answers the number of leading blocks the pool holds, or None:
  "not known yet, ask again next step". Never asks the pool on the caller's thread: a new lookup is recorded for the
  step's batch (`lookup_batcher`), sent by `end_step`; its answer is taken at the next `match`. With the circuit
  breaker open (`lookup_breaker`: the pool counts as down) the answer is 0 at once, without the network.
* An answer is kept per request (`LookupAnswer`) and reused while it is fresh (the same blocks and epoch, younger
  than `lookup_cache_s`): vLLM asks again every step for a request it could not admit yet. `take(req_id)` hands the
  answer vLLM admitted the request with to `update_state_after_alloc`; `forget(req_id)` drops a request;
  `clear()` drops every answer (after a reset).
* The pool leases what a lookup reports (`lease_ms`, `ems.transport.holds`) to the load that follows, so a reported
  hit is not evicted before it is loaded.
* `end_step(idle)` dispatches the step's lookups (one batch, one background thread); a step with nothing else to
  run (`idle`) waits up to `IDLE_WAIT_S` for the batch instead of spinning. `close()` stops the threads.

Extending it: a policy that asks some lookups inside the step (a fast pool) would answer them in `match` by
`self.breaker.lookup(...)` directly; everything else (the answers' reuse, `take`, the epoch) stays the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ems.integrations.block_transfer import EngineHash
from ems.integrations.lookup_batcher import LookupBatcher
from ems.integrations.lookup_breaker import LookupBreaker
from ems.integrations.vllm.context import ConnectorContext
from ems.integrations.vllm.metadata import IDLE_WAIT_S


@dataclass(frozen=True)
class LookupAnswer:
    start: int  # first block asked for
    hits: int  # leading blocks the pool holds (and keeps for the load)
    asked: int  # blocks asked for
    epoch: bytes  # the namespace epoch the keys were in
    at: float  # time.monotonic() of the answer

    def fresh(self, start: int, asked: int, epoch: bytes, now: float, max_age_s: float) -> bool:
        return (self.start, self.asked, self.epoch) == (start, asked, epoch) and now - self.at <= max_age_s


class PoolLookups:
    """See the module contract."""

    def __init__(self, ctx: ConnectorContext) -> None:
        config = ctx.config
        self._ctx = ctx
        self.breaker = LookupBreaker(
            ctx.cc, ctx.tp_size, ctx.mla, config.lookup_timeout_ms, config.breaker_cooldown_s, ctx.stats, config.lease_ms
        )
        self._batcher = LookupBatcher(self.breaker)
        self._answers: dict[str, LookupAnswer] = {}
        self._asking: dict[str, tuple[int, int, bytes]] = {}  # request -> (start, blocks, epoch) asked, unanswered

    def match(self, req_id: str, start: int, full: int, epoch: bytes, hashes: Callable[[], Sequence[EngineHash]]) -> int | None:
        if full <= start:
            self._answers[req_id] = LookupAnswer(start, 0, 0, b"", 0.0)  # nothing to ask; saves start after the local hit
            return 0
        now = time.monotonic()
        cached = self._answers.get(req_id)
        # a request vLLM could not admit yet is asked again every step: the answer is reused for a while
        if cached is not None and cached.fresh(start, full - start, epoch, now, self._ctx.config.lookup_cache_s):
            return cached.hits
        wanted = (start, full - start, epoch)
        asked = self._asking.get(req_id)
        hits = self._batcher.answer(req_id)
        if asked == wanted and hits is None and self._batcher.asked(req_id):
            return None  # still being asked
        if asked != wanted or hits is None:  # not asked yet (or asked for other blocks, before a reset)
            wanted_hashes = hashes()
            if not self.breaker.is_open():
                self._ctx.register_shadow()
                self._batcher.ask(req_id, wanted_hashes, epoch)
                self._asking[req_id] = wanted
                return None
            hits = self.breaker.lookup(wanted_hashes, epoch)  # the pool counts as down: 0 at once, no network
        self._asking.pop(req_id, None)
        self._answers[req_id] = LookupAnswer(start, hits, full - start, epoch, now)
        return hits

    def take(self, req_id: str) -> LookupAnswer | None:
        return self._answers.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        self._answers.pop(req_id, None)
        if self._asking.pop(req_id, None) is not None:
            self._batcher.forget(req_id)

    def clear(self) -> None:
        self._answers.clear()

    def end_step(self, idle: bool) -> None:
        self._batcher.dispatch()
        if idle and self._batcher.pending():
            self._batcher.wait(IDLE_WAIT_S)

    def close(self) -> None:
        self._batcher.close()
        self.breaker.close()

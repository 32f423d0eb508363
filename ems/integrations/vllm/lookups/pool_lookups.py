"""The scheduler half's pool lookups: how many blocks past vLLM's local hit the pool holds (and leases) for a request.

Contract (no vLLM imports; `scheduler.EmsScheduler` calls it from vLLM's scheduler thread):
* `match(req_id, start, full, epoch, hashes, expect, prefix)`: the request's blocks `start..full` (`hashes()` gives
  their engine hashes, asked for only when needed; a hybrid model's: one per KV cache group and position, position by
  position, so a position counts once every group holds it) in `epoch`; `prefix()` the hashes of its blocks before
  `start` (the keys' placement units, `block_transfer`; None: keys placed per key, a hybrid model). Answers the number
  of leading blocks the pool holds, or None: "not known yet, ask again next step". `expect` blocks (from `start`) are
  on their way to the pool (a producer announced them, or this engine sent them to be saved): an answer short of them
  is not taken but asked again each step until `save_wait_ms` after the request's first ask; then the request takes
  what the pool holds (a save that failed costs that wait, bounded, and then recomputation). While it waits, a request
  asks again at most once per `IDLE_WAIT_S` (an answer short of them holds its next ask back that long; a step with
  nothing else to run sleeps until the first is due, instead of spinning on the CPU the save itself needs), and once
  the pool has answered it short its later lookups never open the circuit breaker (`LookupBreaker.lookup`'s `trips`):
  a node busy receiving the very blocks it waits for may answer late, and a late answer is a short one, asked again
  (its first lookup still opens the breaker on a hung node). Never asks the pool on the caller's thread: a new lookup
  is recorded for the step's batch (`lookup_batcher`), sent by `end_step`; its answer is taken at the next `match`.
  With the circuit breaker open (`lookup_breaker`: the pool counts as down) the answer is 0 at once, without the
  network. `skip(req_id, start)` records a request that asks nothing (a producer's).
* `hold(req_id)`: whether a request that waits for blocks on their way into vLLM's own prefix cache (another
  request's asynchronous load, `scheduler`) may wait one more step. Every wait of a request, this one and `match`'s
  `expect`, counts from its first and ends `save_wait_ms` after it: one bound per request, whatever it waits for.
* An answer is kept per request (`LookupAnswer`) and reused while it is fresh (the same blocks, or a later start
  within what it found, in the same epoch, younger than `lookup_cache_s`): vLLM asks again every step for a
  request it could not admit yet. `take(req_id)` hands the answer vLLM admitted the request with to
  `update_state_after_alloc`; `forget(req_id)` drops a request; `clear()` drops every answer (after a reset).
* The pool leases what a lookup reports (`lease_ms`, `ems.transport.exists_holds`) to the load that follows, so a reported
  hit is not evicted before it is loaded.
* `end_step(idle, record)` dispatches the step's lookups (one batch, one background thread); a step with nothing
  else to run (`idle`) waits up to `IDLE_WAIT_S` for the batch (or, with none in flight, until a request waiting for
  blocks on their way may ask again) instead of spinning. It fills the step's record
  (`steps.SchedulerStep`: lookups sent, the step's wait, batches answered and their seconds). `close()` stops the threads.

* The step policy (`policy`, `ems.integrations.vllm.lookups.step_policy`): where it says so (a fast pool, measured), a new lookup
  is asked in `match` itself, on the caller's thread, under what is left of the step's bound
  (`LookupBreaker.lookup_within`), and answered at once; one that times out marks the pool slow and is asked in the
  step's batch instead. Every lookup's latency (in the step or on the lookup thread) feeds the policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ems.integrations.engine_keys import EngineHash
from ems.integrations.vllm.context import ConnectorContext
from ems.integrations.vllm.lookups.batcher import LookupBatcher
from ems.integrations.vllm.lookups.breaker import LookupBreaker
from ems.integrations.vllm.lookups.step_policy import StepPolicy
from ems.integrations.vllm.metadata import IDLE_WAIT_S
from ems.integrations.vllm.steps import SchedulerStep


@dataclass(frozen=True)
class LookupAnswer:
    start: int  # first block asked for
    hits: int  # leading blocks the pool holds (and keeps for the load)
    asked: int  # blocks asked for
    epoch: bytes  # the namespace epoch the keys were in
    at: float  # time.monotonic() of the answer

    def hits_from(self, start: int, full: int, epoch: bytes, now: float, max_age_s: float) -> int | None:
        """The leading blocks from `start` the pool holds by this answer, or None where it does not tell: another
        epoch, other blocks, older than `max_age_s`, or a `start` past the first block it found missing. An answer
        for blocks `s..full` tells it for every later start up to its first missing block (a request whose prefix
        another request loaded meanwhile asks from further on)."""
        end = self.start + self.hits
        if self.epoch != epoch or self.start + self.asked != full or not self.start <= start <= end:
            return None
        return end - start if now - self.at <= max_age_s else None


class PoolLookups:
    """See the module contract."""

    def __init__(self, ctx: ConnectorContext) -> None:
        config = ctx.config
        self._ctx = ctx
        self.breaker = LookupBreaker(
            ctx.cc, ctx.tp_size, ctx.mla, config.lookup_timeout_ms, config.breaker_cooldown_s, ctx.stats, config.lease_ms
        )
        self.policy = StepPolicy(config.step_policy, config.in_step_ms / 1000, ctx.block_bytes)
        self.breaker.on_lookup = self.policy.record_lookup
        self._batcher = LookupBatcher(self.breaker)
        self._answers: dict[str, LookupAnswer] = {}
        self._asking: dict[str, tuple[int, int, bytes]] = {}  # request -> (start, blocks, epoch) asked, unanswered
        self._wait_until: dict[str, float] = {}  # request -> when it stops waiting for blocks still being saved
        self._next_ask: dict[str, float] = {}  # request waiting for blocks on their way -> when it may ask again
        self._per_block = len(ctx.groups)  # keys asked per block (a hybrid model: one per KV cache group)

    def match(
        self,
        req_id: str,
        start: int,
        full: int,
        epoch: bytes,
        hashes: Callable[[], Sequence[EngineHash]],
        expect: int = 0,
        prefix: Callable[[], Sequence[EngineHash]] | None = None,
    ) -> int | None:
        if full <= start:
            self.skip(req_id, start)  # nothing to ask; saves start after the local hit
            return 0
        now = time.monotonic()
        # blocks on their way to the pool (a producer's, or this engine's saves): an answer short of them is asked
        # again each step until `save_wait_ms` after the first ask, instead of recomputing them at once
        waiting = expect > 0 and self._may_wait(req_id, now)
        if waiting and now < self._next_ask.get(req_id, 0.0):
            return None  # its last answer, short of blocks on their way, came back moments ago
        wanted_hits = min(expect, full - start) if waiting else 0
        cached = self._answers.get(req_id)
        # a request vLLM could not admit yet is asked again every step: the answer is reused for a while (from a
        # later start too: another request's load of its prefix landed in vLLM's prefix cache meanwhile)
        known = None if cached is None else cached.hits_from(start, full, epoch, now, self._ctx.config.lookup_cache_s)
        if cached is not None and known is not None:
            if known >= wanted_hits:
                if cached.start != start:
                    self._answers[req_id] = LookupAnswer(start, known, full - start, epoch, cached.at)
                return known
            del self._answers[req_id]  # short of blocks still being saved: asked again below
        wanted = (start, full - start, epoch)
        asked = self._asking.get(req_id)
        held = self._batcher.answer(req_id)
        hits = None if held is None else self._blocks(held)
        if asked == wanted and hits is None and self._batcher.asked(req_id):
            return None  # still being asked
        if asked is not None and asked != wanted and hits is not None:
            # the answer to an ask of other blocks: a request that waited for another request's load of its prefix
            # asks from further on, and what that answer tells about these blocks is taken without another lookup
            self._asking.pop(req_id, None)
            earlier = LookupAnswer(asked[0], hits, asked[1], asked[2], now)
            known = earlier.hits_from(start, full, epoch, now, self._ctx.config.lookup_cache_s)
            if known is not None and known >= wanted_hits:
                self._answers[req_id] = LookupAnswer(start, known, full - start, epoch, now)
                return known
            asked = hits = None
        if hits is not None and hits < wanted_hits:
            self._ctx.stats.add(lookup_save_waits=1)  # short of blocks still being saved: asked again shortly
            self._asking.pop(req_id, None)
            self._ask_later(req_id)
            return None
        if asked != wanted or hits is None or hits < wanted_hits:  # not asked yet, for other blocks, or short
            wanted_hashes = hashes()
            chain = prefix() if prefix is not None else None
            breaker_open = self.breaker.is_open()
            timeout_s = self.policy.lookup_timeout_s(breaker_open)
            in_step_hits = None  # blocks held, answered in the step
            if timeout_s is not None:  # a fast pool: asked now, in the step, within what is left of its bound
                self._ctx.register_shadow()
                if asked is not None:
                    self._batcher.forget(req_id)
                    self._asking.pop(req_id, None)
                in_step = self.breaker.lookup_within(wanted_hashes, epoch, timeout_s, chain)
                self.policy.spend_lookup(in_step.seconds, in_step.timed_out)
                if not in_step.timed_out:
                    in_step_hits = self._blocks(in_step.hits)
                    if in_step_hits < wanted_hits:
                        self._ctx.stats.add(lookup_save_waits=1)  # short of blocks still being saved: asked shortly
                        self._ask_later(req_id)
                        return None
            if in_step_hits is not None:
                hits = in_step_hits
            elif not breaker_open:
                self._ctx.register_shadow()
                # a request whose wait already had a short answer from the pool (the node is up, maybe busy receiving
                # those very blocks) asks without opening the breaker; its first ask may open it (a hung node)
                self._batcher.ask(req_id, wanted_hashes, epoch, trips=not (waiting and req_id in self._next_ask), prefix=chain)
                self._asking[req_id] = wanted
                return None
            else:  # the pool counts as down: 0 at once, no network
                hits = self._blocks(self.breaker.lookup(wanted_hashes, epoch, prefix=chain))
        self._asking.pop(req_id, None)  # (its wait's end is kept until `take`: one wait per request)
        self._next_ask.pop(req_id, None)
        self._answers[req_id] = LookupAnswer(start, hits, full - start, epoch, now)
        return hits

    def _ask_later(self, req_id: str) -> None:
        """A request whose answer came back short of blocks on their way asks again `IDLE_WAIT_S` from now."""
        self._next_ask[req_id] = time.monotonic() + IDLE_WAIT_S

    def _blocks(self, keys_held: int) -> int:
        """The blocks held, from the first, given the keys held from the first (a hybrid model asks one key per KV
        cache group per block: a block is held when all of its keys are)."""
        return keys_held // self._per_block

    def _may_wait(self, req_id: str, now: float) -> bool:
        return now < self._wait_until.setdefault(req_id, now + self._ctx.config.save_wait_ms / 1000)

    def hold(self, req_id: str) -> bool:
        """True while the request may still wait for blocks on their way (see the module contract)."""
        return self._may_wait(req_id, time.monotonic())

    def skip(self, req_id: str, start: int) -> None:
        """The request asks the pool nothing (nothing past its local hit, or a producer, which never loads): its
        saves start at block `start`."""
        self._answers[req_id] = LookupAnswer(start, 0, 0, b"", 0.0)

    def take(self, req_id: str) -> LookupAnswer | None:
        self._wait_until.pop(req_id, None)
        self._next_ask.pop(req_id, None)
        return self._answers.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        self._answers.pop(req_id, None)
        self._wait_until.pop(req_id, None)
        self._next_ask.pop(req_id, None)
        if self._asking.pop(req_id, None) is not None:
            self._batcher.forget(req_id)

    def clear(self) -> None:
        self._answers.clear()
        self._wait_until.clear()
        self._next_ask.clear()

    def end_step(self, idle: bool, record: SchedulerStep) -> None:
        record.lookups_sent = self._batcher.dispatch()
        if idle and self._batcher.pending():
            started = time.perf_counter()
            self._batcher.wait(IDLE_WAIT_S)
            record.wait_s = time.perf_counter() - started
        elif idle and self._next_ask:  # requests wait for blocks on their way: sleep until the first may ask again
            due = min(self._next_ask.values()) - time.monotonic()
            if due > 0:
                started = time.perf_counter()
                time.sleep(min(due, IDLE_WAIT_S))
                record.wait_s = time.perf_counter() - started
        record.lookup_batches, record.lookup_s = self._batcher.take_answered()
        policy = self.policy
        record.in_step_lookups, record.in_step_lookup_s = policy.step_lookups, policy.step_lookup_s
        record.in_step_loads, record.in_step_load_blocks = policy.step_loads, policy.step_load_blocks
        record.policy_load_Bps, record.policy_lookup_s = policy.rate_Bps or 0.0, policy.lookup_s or 0.0
        policy.begin_step()

    def close(self) -> None:
        self._batcher.close()
        self.breaker.close()

"""The step policy: whether a request's pool lookup and load run inside the engine step or asynchronously.

Contract (no engine imports; the vLLM scheduler half asks it on the scheduler's thread, once per request and step):
* Two ways to serve a hit. **In the step**: the lookup is one `exists` on the scheduler's thread and the load runs
  before the step's forward (vLLM's synchronous path: `load_kv_async=False`), so the request is computed in the same
  step it is admitted in. **Asynchronously**: the lookup goes to the step's batch on the lookup thread (answered the
  next step) and the load runs while other steps go on (the request runs the step after its load is reported): at
  least two extra steps for that request, but nothing of the pool's time on any step.
* `StepMode` (`step_policy`): `AUTO` decides per request from measured costs, `IN_STEP` and `ASYNC` force one way.
  Every mode keeps the bound: the in-step work of one step (its lookups' measured seconds plus its loads' predicted
  seconds, and room held for requests put off from the last step) never exceeds `budget_s` (`in_step_ms`); what does
  not fit waits for the next step or goes asynchronously (below), and an in-step lookup's own timeout is what is left
  of the budget. A started in-step load that runs late may go on to
  `IN_STEP_LOAD_GRACE` times the bound (the worker's timeout: `ems.integrations.vllm.worker_loads`) before its
  blocks are recomputed, so a slow or hung pool holds a step at most that. With the circuit breaker open (the pool
  counts as down) nothing runs in the step.
* Measured costs: `record_lookup(seconds)` (every `exists` the scheduler makes, in the step or on the lookup
  thread) and `record_transfer(...)` (the workers' load and save jobs, as vLLM hands their statistics to the
  scheduler) keep exponential moving averages: the latency of one lookup and the load rate (bytes/s). The load rate
  is what an in-step load costs (`predict_s(blocks)` = blocks * block_bytes / rate): the workers' in-step loads
  (`in_step_bytes` over `in_step_s`, timed alone before the forward) move it either way; every load job's bytes over
  its seconds (asynchronous jobs beside a forward included, whose seconds are the load's own plus its waits for the
  cores) are at most that rate, so they only raise it (an asynchronous load slowed 10-50x beside a forward used to
  drag it down, and the next hits that would have taken milliseconds in the step went asynchronous); an account that
  holds an in-step phase moves it by the phase only (its in-step jobs, timed without the phase's settling copies,
  would read faster than the phase). The first load measured of either kind sets it. Until a load has been measured
  the save rate stands in for it (the same link, the other way). `AUTO` runs a lookup in the step once one has been
  measured and twice its latency fits what is left of the budget, and a load in the step once a rate is known and
  twice its predicted seconds fit (it reserves that much). An in-step load that ran out of its bound
  (`record_late_load`) drops the rate at once to what it shows (its bytes over the seconds it took: at most the true
  rate), so the next loads go asynchronously until measured loads raise it again (an average would keep placing
  loads in the step that time out and are recomputed). An in-step lookup that used its whole timeout marks the pool
  slow: `AUTO` asks asynchronously until a lookup on the lookup thread is fast again.
* **The next step** (`Placement.NEXT_STEP`): a hit that does not fit what is left of this step's bound but fits the
  next step's, where no earlier request holds that room yet, is asked again next step and loaded in it; the room is
  held for it through the next step (`decide_load(blocks, request_id=...)`; others there see only what is left
  besides it). One step's wait, where an asynchronous load costs the request at least two and runs beside the
  forwards (on a CPU host, taking the cores the forward runs on: perf/RESULTS.md, "the next step"). A request waits
  so at most one step in a row (held room it does not fit: asynchronously); held room that its request does not use
  lapses with the step. The engine must ask the request again (the scheduler half answers "not yet"); a caller that
  names no request never gets this placement.
* `begin_step()` starts a new step's budget (the scheduler calls it at the end of each step); `decide_load(blocks)`
  and `lookup_timeout_s()` spend it. `StepDecision` is what `decide_load` answers: the placement and the predicted
  seconds. Counted per step for the record: in-step lookups and their seconds, in-step loads (requests, blocks),
  loads put off to the next step.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

# Weight of the newest sample in the moving averages: a few samples move the estimate, one outlier does not.
EWMA_WEIGHT = 0.3
# An in-step lookup is tried only when its measured latency, times this margin, fits what is left of the budget.
LOOKUP_MARGIN = 2.0
# An in-step load is placed only when its predicted seconds, times this margin, fit what is left of the budget (the
# margin is what it reserves): a load that then runs up to twice its prediction still ends within the bound.
LOAD_MARGIN = 2.0
# The least an in-step lookup's timeout may be (the SDK's timeout is in whole milliseconds).
MIN_LOOKUP_TIMEOUT_S = 0.001


class StepMode(str, enum.Enum):
    """`step_policy`: how lookups and loads are placed."""

    AUTO = "auto"  # per request, from measured costs, within the bound
    IN_STEP = "in_step"  # always in the step while the budget lasts (the bound still holds)
    ASYNC = "async"  # always asynchronously (never any of the pool's time on a step)


class Placement(enum.Enum):
    IN_STEP = "in_step"  # loaded before this step's forward
    NEXT_STEP = "next_step"  # asked again next step, whose bound holds room for it
    ASYNC = "async"  # loaded off the step; the request waits for it


@dataclass(frozen=True)
class StepDecision:
    placement: Placement
    predicted_s: float  # the load's predicted seconds (0 when no rate is known)


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * sample


class StepPolicy:
    """See the module contract."""

    def __init__(self, mode: StepMode, budget_s: float, block_bytes: int) -> None:
        if budget_s < 0:
            raise ValueError(f"budget_s must be >= 0, got {budget_s}")
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        self.mode = mode
        self.budget_s = budget_s
        self.block_bytes = block_bytes
        self._lock = threading.Lock()  # lookups are recorded from the lookup thread too
        self.lookup_s: float | None = None  # one exists call, moving average
        self.load_Bps: float | None = None  # an in-step load's bytes per second, moving average
        self.save_Bps: float | None = None  # stands in for the load rate until a load was measured
        self.slow = False  # an in-step lookup used its whole timeout: asynchronous until a fast lookup
        self.spent_s = 0.0  # this step's in-step lookups (measured) and loads (predicted)
        self._held: dict[str, float] = {}  # this step's room held for requests put off last step (their reserves)
        self._promised: dict[str, float] = {}  # the next step's room, promised this step
        self.step_lookups = 0
        self.step_lookup_s = 0.0
        self.step_loads = 0
        self.step_load_blocks = 0
        self.step_deferred = 0

    # ---- measurements ----

    def record_lookup(self, seconds: float, timed_out: bool = False) -> None:
        """One `exists` call's latency (a lookup that hit its timeout marks the pool slow instead)."""
        with self._lock:
            if timed_out:
                self.slow = True
                return
            self.lookup_s = _ewma(self.lookup_s, seconds)
            if self.slow and self.lookup_s * LOOKUP_MARGIN <= self.budget_s:
                self.slow = False

    def record_transfer(
        self,
        load_bytes: int,
        load_s: float,
        save_bytes: int = 0,
        save_s: float = 0.0,
        in_step_bytes: int = 0,
        in_step_s: float = 0.0,
    ) -> None:
        """The workers' load and save jobs since the last call (their bytes and seconds, summed), and of the loads
        among them, those run in the step (the in-step phases' bytes and seconds)."""
        with self._lock:
            if in_step_bytes > 0 and in_step_s > 0:  # timed alone, before the forward: the rate itself
                self.load_Bps = _ewma(self.load_Bps, in_step_bytes / in_step_s)
            elif load_bytes > 0 and load_s > 0:  # asynchronous jobs only: at most the rate (waits beside a forward
                # included), so they only raise it. With an in-step phase in the same account, its own jobs are among
                # the loads, timed without the phase's settling copies: faster than the phase, not a bound of it.
                sample = load_bytes / load_s
                if self.load_Bps is None or sample > self.load_Bps:
                    self.load_Bps = _ewma(self.load_Bps, sample)
            if save_bytes > 0 and save_s > 0:
                self.save_Bps = _ewma(self.save_Bps, save_bytes / save_s)

    def record_late_load(self, nbytes: int, seconds: float) -> None:
        """In-step loads of `nbytes` that ran out of their bound after `seconds`: the rate was at most their ratio."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            current = self.load_Bps if self.load_Bps is not None else self.save_Bps
            late = nbytes / seconds
            self.load_Bps = late if current is None else min(current, late)

    @property
    def rate_Bps(self) -> float | None:
        """The load rate the predictions use (the save rate until a load was measured)."""
        with self._lock:
            return self.load_Bps if self.load_Bps is not None else self.save_Bps

    # ---- the step's budget ----

    def begin_step(self) -> None:
        self.spent_s = 0.0
        self._held, self._promised = self._promised, {}  # last step's promises; earlier held room lapses
        self.step_lookups = 0
        self.step_lookup_s = 0.0
        self.step_loads = 0
        self.step_load_blocks = 0
        self.step_deferred = 0

    def held_s(self) -> float:
        """Room of this step's bound held for requests put off from the last step, not yet taken."""
        return sum(self._held.values())

    def left_s(self) -> float:
        return max(0.0, self.budget_s - self.spent_s - self.held_s())

    def lookup_timeout_s(self, breaker_open: bool) -> float | None:
        """The timeout of a lookup run in this step, or None: ask it asynchronously."""
        if self.mode is StepMode.ASYNC or breaker_open:
            return None
        left = self.left_s()
        if left < MIN_LOOKUP_TIMEOUT_S:
            return None
        if self.mode is StepMode.AUTO:
            with self._lock:
                measured, slow = self.lookup_s, self.slow
            if slow or measured is None or measured * LOOKUP_MARGIN > left:
                return None
        return left

    def spend_lookup(self, seconds: float, timed_out: bool) -> None:
        """An in-step lookup took `seconds` of this step."""
        self.spent_s += seconds
        self.step_lookups += 1
        self.step_lookup_s += seconds
        if timed_out:  # (one that came back in time is recorded by the breaker's `on_lookup`)
            self.record_lookup(seconds, timed_out=True)

    def predict_s(self, blocks: int) -> float | None:
        """An in-step load's predicted seconds: its bytes over the rate (None: no rate known)."""
        rate = self.rate_Bps
        return None if rate is None else blocks * self.block_bytes / rate

    def decide_load(self, blocks: int, breaker_open: bool = False, request_id: str | None = None) -> StepDecision:
        """Where a hit of `blocks` blocks is loaded; an in-step load spends its predicted seconds of the budget, one
        put off to the next step holds them there. `request_id` names the request (None: never put off); room held
        for it since the last step is its own."""
        known = self.predict_s(blocks)
        predicted = 0.0 if known is None else known
        held = self._held.pop(request_id, None) if request_id is not None else None
        if blocks <= 0 or self.mode is StepMode.ASYNC or breaker_open:
            return StepDecision(Placement.ASYNC, predicted)
        if self.mode is StepMode.AUTO and known is None:
            return StepDecision(Placement.ASYNC, predicted)  # nothing measured yet
        need = predicted * LOAD_MARGIN
        if need <= self.left_s():
            self.spent_s += need
            self.step_loads += 1
            self.step_load_blocks += blocks
            return StepDecision(Placement.IN_STEP, predicted)
        promised = sum(self._promised.values())
        if request_id is not None and held is None and need <= self.budget_s - promised:
            self._promised[request_id] = need
            self.step_deferred += 1
            return StepDecision(Placement.NEXT_STEP, predicted)
        return StepDecision(Placement.ASYNC, predicted)

    def forget(self, request_id: str) -> None:
        """A request that ended (or will not be asked again): the room held or promised for it is free."""
        self._held.pop(request_id, None)
        self._promised.pop(request_id, None)

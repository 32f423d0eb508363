"""A pipelined job's chunks: how a request is cut, how its chunk calls are bounded, fenced and merged.

The request's staging is one lease, cut into chunks of consecutive values (`plan_chunks`: about `EMS_CHUNK_BYTES`,
default 16 MiB, and within the pool's request limits); `EMS_CHUNK_BYTES=0` makes the request one chunk. Chunk calls
run on the jobs' executor (`JobContext.executor`, `ems.datapath.executor`); a request of one chunk has nothing to
overlap, so its call runs on the calling thread (`run_now`).

In flight: a job keeps at most `PIPELINE_DEPTH` chunk requests on the wire (a save's chunk k is sent once chunk
k - depth has returned; a load starts chunk k + depth once chunk k verified), and at most `PIPELINE_THREADS` chunk
calls run at once per client (the rest queue, in order).

Fencing: the lease is released only when every chunk call has returned (queued ones are cancelled: `fence`), each
bounded by the request's deadline (+ `FENCE_GRACE_S`); a chunk whose call failed or timed out may leave UCX touching
its buffer a moment longer (the endpoint is aborted, not awaited), so then the lease is retired, never reused
(`StagingPool.retire`).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ems.backends.base import PoolOutcome
from ems.datapath.copier import Checked
from ems.datapath.planning import Plan
from ems.deadline import Deadline
from ems.errors import EmsErrorCode
from ems.transport.base import TransportError
from ems.transport.protocol import RequestLimits, key_lens

PIPELINE_DEPTH = 2  # chunk requests of one job on the wire at once (see perf/RESULTS.md, API over UCX)
FENCE_GRACE_S = 2.0  # past the request's deadline, how long a job waits for a chunk call that bounds itself anyway


@dataclass(frozen=True)
class Received:
    """A load chunk's receive: the pool's outcome; `written`: how many leading values were verified and written into
    the cache while the node placed them (`PlacedScatter`), of those the reply confirms; `checked`: what was
    checked of the values after those (the scatter's to write)."""

    outcome: PoolOutcome
    written: int
    checked: Checked

    @property
    def valid(self) -> int:
        """The chunk's leading values that are hits once the scatter has written them (as far as checked)."""
        return self.written + self.checked.count


def plan_chunks(plan: Plan, limits: RequestLimits, target: int) -> list[tuple[int, int]]:
    """The request's chunks, (first value, end) in order: consecutive values of at most `target` payload bytes each
    (a larger value is a chunk alone), within `limits` (keys, meta, frames; data bytes: the pool client splits a
    chunk whose headers take it over) so that a chunk is one request to a node; `target` 0: the whole request as
    one chunk (the pool client then splits it at the limits itself)."""
    if target <= 0 or plan.total == 0:
        return [(0, plan.total)]
    parts = 1 if plan.header_in_staging else 2  # data frames per value: the value, or its header and payload
    costs = limits.put_costs(key_lens(plan.keys), plan.expected.payload_len, np.full(plan.total, parts, dtype=np.int64))
    return [(s.start, s.stop) for s in limits.capped(target).batches(costs)]


def merge_outcomes(outcomes: list[PoolOutcome], total: int) -> PoolOutcome:
    """One outcome for a request from its chunks' (in order): results concatenated (keys of chunks that never ran:
    False), every error kept; nodes contacted add up, so the request is unreachable exactly when every chunk that
    ran found every node it needed failed."""
    results: list = [r for o in outcomes for r in o.results]
    results += [False] * (total - len(results))
    merged: PoolOutcome = PoolOutcome(results)
    for o in outcomes:
        merged.errors.extend(o.errors)
        merged.nodes_contacted += o.nodes_contacted
    return merged


def _failed_chunk(count: int, code: EmsErrorCode, message: str) -> PoolOutcome:
    """A chunk whose call did not give an outcome: none of its keys done, the failure as its one error."""
    return PoolOutcome([False] * count, [TransportError(code, message)], nodes_contacted=1)


def _fence_wait_s(deadline: Deadline) -> float:
    """How long a job still waits for a chunk call: until the request's deadline plus the grace."""
    return deadline.extended(FENCE_GRACE_S).left()


def chunk_outcome(future: concurrent.futures.Future, count: int, deadline: Deadline) -> Any:
    """A chunk call's result, waiting at most until `deadline` (+ grace); a call that raised or did not return is
    a failed chunk."""
    try:
        return future.result(timeout=_fence_wait_s(deadline))
    except concurrent.futures.TimeoutError:
        return _failed_chunk(count, EmsErrorCode.EMS_IO_TIMEOUT, "chunk: no answer in time")
    except concurrent.futures.CancelledError:
        return PoolOutcome([False] * count)
    except Exception as error:  # a bug below must not become a wrong block: the chunk's keys fail
        return _failed_chunk(count, EmsErrorCode.EMS_IO_ERROR, f"chunk failed: {error!r}")


def run_now(call: Callable[[], Any]) -> concurrent.futures.Future:
    """Run `call` in this thread; its result or exception as a finished future (what `fence` and `chunk_outcome`
    read). An interrupt is recorded too (the transfer may still touch its buffer: `fence` then says so), then
    raised."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        future.set_result(call())
    except BaseException as error:
        future.set_exception(error)
        if not isinstance(error, Exception):
            raise
    return future


def fence(futures: list[concurrent.futures.Future], deadline: Deadline) -> bool:
    """Stop a request's chunk calls: cancel those not started, wait (bounded by `deadline` + grace) for the others.
    True when none can touch the request's buffers any more: every call was cancelled, or returned an outcome
    without errors (a failed or timed-out transfer is aborted on its endpoint, not awaited)."""
    for future in futures:
        future.cancel()
    _, not_done = concurrent.futures.wait(futures, timeout=_fence_wait_s(deadline))
    if not_done:
        return False
    for future in futures:
        if future.cancelled():
            continue
        if future.exception() is not None:
            return False
        result = future.result()
        outcome = result.outcome if isinstance(result, Received) else result
        if outcome.errors:
            return False
    return True

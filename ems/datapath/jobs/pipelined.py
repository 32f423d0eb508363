"""Pipelined jobs: a save (`PipelinedSave`) and a V1 load (`PipelinedLoad`) through staging to and from pool nodes
(or an accelerator), chunk by chunk, and their chunks: how a request is cut, how its chunk calls are bounded,
fenced and merged.

Chunks. The request's staging is one lease, cut into chunks of consecutive values (`plan_chunks`: about
`EMS_CHUNK_BYTES`, default 16 MiB, and within the pool's request limits); `EMS_CHUNK_BYTES=0` makes the request one
chunk. Chunk calls run on the jobs' executor (`JobContext.executor`, `ems.datapath.executor`); a request of one chunk
has nothing to overlap, so its call runs on the calling thread (`run_now`).

In flight: a job keeps at most `PIPELINE_DEPTH` chunk requests on the wire (a save's chunk k is sent once chunk
k - depth has returned; a load starts chunk k + depth once chunk k verified), and at most `PIPELINE_THREADS` chunk
calls run at once per client (the rest queue, in order).

Fencing: the lease is released only when every chunk call has returned (queued ones are cancelled: `fence`), each
bounded by the request's deadline (+ `FENCE_GRACE_S`); a chunk whose call failed or timed out may leave UCX touching
its buffer a moment longer (the endpoint is aborted, not awaited), so then the lease is retired, never reused
(`StagingPool.retire`).

Save. The request's staging is one lease (`JobContext.staging`; with a pool node on this host it lies in that
node's shared-memory region where it has room: `PoolClient.shm_staging`, so the node copies straight out of it).
`begin` gathers chunk k into its range of staging (one backend call per layer group; then device → host on
accelerators) and starts its encode (checksum, headers in place, unless the fused copier's gather wrote them) and
put on the jobs' executor, then gathers chunk k+1 while k is encoded and on the wire; it returns once every chunk is
gathered (the engine may then overwrite its cache). `finish` waits for the puts and merges their outcomes; a
one-chunk save's put runs in `finish`, on the calling thread. The lease goes back only once no put can read it any
more (`fence`).

Load (V1; V0 loads from pool nodes: `staged.py`). Each chunk's receive (`PoolBackend.get_into`: values land in their
places in staging) and its check (`Copier.check`) run on the pipeline threads; the calling thread scatters chunk k's
checked prefix while later chunks arrive, stopping at the first miss. With the fused copier (staging in the cache's own memory,
CPU, and the compiled host copy) the receive checks only the headers and the scatter hashes each value just before
writing it (`FusedCopier.verify_scatter`: one pass over bytes still in cache).

A load staged in a same-host node's region is one chunk (the node only copies: nothing worth overlapping), received
on the calling thread. With the fused copier it overlaps within its one request instead: the node publishes how
many leading values it has placed (a progress word in the region), and the receive verifies and scatters each as it
lands, in one GIL-free C call, while the node copies the next (`FusedCopier.as_placed`); what that call did not take
(the node stopped counting: a miss, a value of another length; the reply came first) is checked and scattered from
the reply as before, and a value that fails its check ends the load there.

A load never writes a block it did not verify, nor one after the first miss; the lease goes back only once no
receive can touch it (`fence`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ems.backends.base import PoolOutcome
from ems.datapath.copier import Checked, Gathered, PlacedScatter, Verified, encode_values
from ems.datapath.jobs.staged import StagedLoad
from ems.datapath.jobs.transfer import JobContext, JobPath, Loaded, LoadJob, ReceivedValues, SaveJob, Transfer, pool_call
from ems.datapath.planning import BlockPlan, Plan
from ems.errors import EmsErrorCode
from ems.kernels.base import PlacedStop
from ems.records import Deadline, Stage
from ems.staging import StagingKind, StagingLease
from ems.store.value_format import HEADER_SIZE, ExpectedValues
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


class PipelinedSave(SaveJob):
    """A save through staging to pool nodes (or from an accelerator): see the module docstring."""

    def __init__(self, transfer: Transfer, context: JobContext) -> None:
        self.plan, self.device, self.copier = transfer.plan, transfer.device, transfer.copier
        self.option, self.record = transfer.option, transfer.record
        self.pool, self.staging, self.chunk_bytes = context.pool, context.staging, context.chunk_bytes
        self.executor = context.executor
        self.record.path = "pipelined"
        self._lease: StagingLease | None = None
        self._chunks: list[tuple[int, int]] = []
        self._sends: list[concurrent.futures.Future] = []  # each chunk's encode + put, in order
        self._stop = threading.Event()  # set: chunks not yet sent are not sent (an earlier one failed, or abandon)
        self._deadline = Deadline(0.0)
        self._lone: Callable[[], PoolOutcome] | None = None  # a one-chunk save's send, run by `finish`

    def _begin(self) -> None:
        """Per chunk: gather into its range of staging (then to host), start its encode + put; next chunk."""
        plan, record = self.plan, self.record
        self._deadline = Deadline.of(self.option)
        self._lease = lease = self.staging.acquire(plan.staging_bytes, self.device, self.pool.shm_staging)
        host = lease.host_view()
        self._chunks = plan_chunks(plan, self.pool.limits, self.chunk_bytes)
        for a, b in self._chunks:
            lo, hi = int(plan.value_start[a]), int(plan.value_start[b])
            with self.copier.device_work():  # waits for the chunk's device work at the end
                with record.stage(Stage.GATHER, plan.expected.payload_bytes(a, b)):
                    # host staging may come out of the gather encoded (the fused copier's one pass)
                    gathered = self.copier.gather(plan, lease.device, a, b)
                lease.copy_to_host(lo, hi, record)
            send = functools.partial(self._send_chunk, host, a, b, gathered)
            if len(self._chunks) == 1:  # nothing to overlap: `finish` sends it on its own thread (no thread hop)
                self._lone = functools.partial(send, None)
                return
            ahead = self._sends[-PIPELINE_DEPTH] if len(self._sends) >= PIPELINE_DEPTH else None
            self._sends.append(self.executor.start(functools.partial(send, ahead)))

    def _send_chunk(
        self, host: memoryview, a: int, b: int, gathered: Gathered, ahead: concurrent.futures.Future | None
    ) -> PoolOutcome:
        """On a pipeline thread: checksum and header values a..b-1 in place (unless their gather did: `gathered`),
        then, once the chunk `PIPELINE_DEPTH` places ahead (`ahead`, started earlier: running or done) has
        returned, put them (by the request's deadline)."""
        plan, record = self.plan, self.record
        if self._stop.is_set():  # the save's prefix already ends before this chunk: not sent
            return PoolOutcome([False] * (b - a))
        try:
            start = time.perf_counter()
            values = encode_values(plan, host, a, b, gathered)
            if gathered is Gathered.PAYLOADS:
                record.add(Stage.ENCODE, plan.expected.payload_bytes(a, b), time.perf_counter() - start)
            if ahead is not None:
                concurrent.futures.wait([ahead], timeout=self._deadline.left())
            if self._stop.is_set() or self._deadline.expired():
                return PoolOutcome([False] * (b - a))
            sent = time.perf_counter()
            value_lens = plan.expected.payload_len[a:b] + HEADER_SIZE
            outcome = self.pool.put(pool_call(plan, self.option, a, b, self._deadline), values, value_lens)
            record.add(Stage.SEND, int(value_lens.sum()), time.perf_counter() - sent)
        except BaseException:
            self._stop.set()
            raise
        if not all(outcome.results):
            self._stop.set()
        return outcome

    def finish(self) -> PoolOutcome:
        """Wait for every chunk's put; the merged outcome's results say which keys were acknowledged."""
        try:
            if self._lease is None:
                raise RuntimeError("PipelinedSave.finish() before begin()")
            lone, self._lone = self._lone, None
            if lone is not None:
                self._sends.append(run_now(lone))
            outcomes = [chunk_outcome(f, b - a, self._deadline) for f, (a, b) in zip(self._sends, self._chunks)]
            return merge_outcomes(outcomes, self.plan.total)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Give back the staging lease (idempotent). Chunks not yet sent are not sent; the lease goes back only once
        no put in flight can read it any more (`fence`)."""
        self._stop.set()
        sends, self._sends = self._sends, []
        clean = fence(sends, self._deadline) if sends else True
        lease, self._lease = self._lease, None
        if lease is not None:
            (self.staging.release if clean else self.staging.retire)(lease)


class PipelinedLoad:
    """A load from pool nodes (or into an accelerator) through staging, chunk by chunk: see the module docstring."""

    def __init__(self, transfer: Transfer, context: JobContext) -> None:
        if not isinstance(transfer.plan, BlockPlan):
            raise TypeError("PipelinedLoad moves V1 values (a BlockPlan): V0 loads from pool nodes are StagedLoad's")
        self.plan: BlockPlan = transfer.plan
        self.device, self.copier = transfer.device, transfer.copier
        self.option, self.record = transfer.option, transfer.record
        self.pool, self.staging, self.chunk_bytes = context.pool, context.staging, context.chunk_bytes
        self.executor = context.executor
        # what the pool checks of the values it places (replicas: each against the expected values, to fall back on
        # damage): they travel with that (`ReceivedValues.checked`), and the copier's check checks nothing more then
        self.read_check = context.pool.read_check
        self.record.path = "pipelined"

    def run(self) -> Loaded:
        return self._run_pipelined(self.plan)

    def _run_pipelined(self, plan: BlockPlan) -> Loaded:
        """Chunks' receive + verify run on the pipeline threads, `PIPELINE_DEPTH` at once; scatter chunk k's
        verified prefix while later chunks arrive; stop at the first miss (nothing after it is written)."""
        record = self.record
        deadline = Deadline.of(self.option)
        stop = threading.Event()
        lease = self.staging.acquire(plan.staging_bytes, self.device, self.pool.shm_staging)
        # staged in a same-host node's region: the node's part is a memcpy, with nothing worth overlapping, so the
        # request is one chunk, received on this thread (no hand-over to a pipeline thread and back, which beside a
        # busy engine thread waits for the GIL: perf/RESULTS.md, "A load beside a busy Python thread")
        try:
            chunks = plan_chunks(plan, self.pool.limits, 0 if lease.kind is StagingKind.SHARED else self.chunk_bytes)
        except BaseException:
            self.staging.release(lease)  # nothing was sent into it
            raise
        host = lease.host_view()
        receives: list[concurrent.futures.Future] = []
        # staged in a same-host node's region, as one chunk: the fused copier verifies and scatters values while the
        # node is still placing the later ones (`FusedCopier.as_placed`), from inside the receive
        placed = None
        if lease.kind is StagingKind.SHARED and len(chunks) == 1:
            placed = self.copier.as_placed(plan, lease.device, *chunks[0], record)

        def start(k: int) -> None:
            if k < len(chunks):
                a, b = chunks[k]
                call = functools.partial(self._receive_chunk, plan, host, a, b, deadline, stop, placed)
                # one chunk: nothing to overlap, so it runs here (no thread hop); else on the pipeline threads
                receives.append(run_now(call) if len(chunks) == 1 else self.executor.start(call))

        outcomes: list[PoolOutcome] = []
        hits = 0
        clean = False
        try:
            for k in range(PIPELINE_DEPTH):
                start(k)
            for k, (a, b) in enumerate(chunks):
                got = chunk_outcome(receives[k], b - a, deadline)
                received = got if isinstance(got, Received) else Received(got, 0, Verified(0))
                outcomes.append(received.outcome)
                valid, written = received.valid, received.written
                if valid == b - a:
                    start(k + PIPELINE_DEPTH)  # before the scatter: chunk k + depth arrives while chunk k is written
                if received.checked.count:  # (values a .. a + written were verified and written during the receive)
                    lo, hi = int(plan.value_start[a + written]), int(plan.value_start[a + valid])
                    with self.copier.device_work():
                        lease.copy_to_device(lo, hi, record)
                        with record.stage(Stage.SCATTER, plan.expected.payload_bytes(a + written, a + valid)):
                            valid = written + received.checked.scatter(
                                self.copier, plan, lease.device, plan.value_start, a + written
                            )
                if valid:
                    hits = a + valid
                if valid < b - a:
                    break
        finally:
            stop.set()
            clean = fence(receives, deadline)
            (self.staging.release if clean else self.staging.retire)(lease)
        return Loaded(hits, merge_outcomes(outcomes, plan.total))

    def _receive_chunk(
        self,
        plan: BlockPlan,
        host: memoryview,
        a: int,
        b: int,
        deadline: Deadline,
        stop: threading.Event,
        placed: PlacedScatter | None = None,
    ) -> Received:
        """On a pipeline thread: values a..b-1 straight into their places in staging, then what this load checks of
        them before the scatter (`Copier.check`: every value, or the headers where the scatter verifies the payloads;
        nothing more where the pool checked them). `placed` (passed to the pool) may already have verified and
        written leading values into the cache: those the reply confirms are hits; the rest are checked as without
        it."""
        record = self.record
        if stop.is_set():  # the load already stopped before this chunk
            return Received(PoolOutcome([False] * (b - a)), 0, Verified(0))
        request = pool_call(plan, self.option, a, b, deadline)
        expected = cast(ExpectedValues, request.expected)  # (a plan's requests carry its expected values)
        start = time.perf_counter()
        outs = plan.value_views(host, a, b)
        outcome = self.pool.get_into(request, outs, as_placed=placed.run if placed is not None else None)
        arrived = time.perf_counter()
        present = next((i for i, ok in enumerate(outcome.results) if not ok), b - a)
        written, why = placed.result() if placed is not None else (0, PlacedStop.INTERRUPTED)
        written = min(written, present)  # (a value the reply does not confirm is not a hit, whatever was written)
        record.add(Stage.RECEIVE, expected.payload_bytes(0, present) + HEADER_SIZE * present, arrived - start)
        if why == PlacedStop.DAMAGED and written < present:  # value `written` failed its check: the load ends there
            return Received(outcome, written, Verified(0))
        values = ReceivedValues(outs, expected, self.read_check).range(written, present)
        return Received(outcome, written, self.copier.check(values, record))


class PipelinedPath(JobPath):
    """The path through staging: remote pools, accelerators (V1 loads pipelined, V0 loads `StagedLoad`)."""

    def _save(self, transfer: Transfer, context: JobContext) -> SaveJob:
        return PipelinedSave(transfer, context)

    def _load(self, transfer: Transfer, context: JobContext) -> LoadJob:
        if isinstance(transfer.plan, BlockPlan):
            return PipelinedLoad(transfer, context)
        return StagedLoad(transfer, context)

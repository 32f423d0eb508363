"""A V1 load from pool nodes (or into an accelerator) through staging, chunk by chunk (`PipelinedLoad`).

Each chunk's receive (`PoolBackend.get_into`: values land in their places in staging) and its check (`Copier.check`)
run on the pipeline threads (`ems.datapath.jobs.chunks`); the calling thread scatters chunk k's checked prefix
while later chunks arrive, stopping at the first miss. With the fused copier (staging in the cache's own memory,
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
from typing import cast

from ems.backends.base import PoolOutcome
from ems.datapath.copier import PlacedScatter, Verified
from ems.datapath.devices import side_stream
from ems.datapath.jobs import chunks as chunking
from ems.datapath.jobs.chunks import Received, chunk_outcome, fence, merge_outcomes, plan_chunks, run_now
from ems.datapath.jobs.transfer import JobContext, Loaded, Transfer, pool_call
from ems.datapath.planning import BlockPlan
from ems.datapath.values import ReceivedValues
from ems.deadline import Deadline
from ems.kernels.base import PlacedStop
from ems.records import Stage
from ems.staging import StagingKind
from ems.store.value_format import HEADER_SIZE, ExpectedValues


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
            for k in range(chunking.PIPELINE_DEPTH):
                start(k)
            for k, (a, b) in enumerate(chunks):
                got = chunk_outcome(receives[k], b - a, deadline)
                received = got if isinstance(got, Received) else Received(got, 0, Verified(0))
                outcomes.append(received.outcome)
                valid, written = received.valid, received.written
                if valid == b - a:
                    start(k + chunking.PIPELINE_DEPTH)  # before the scatter: chunk k + depth arrives while chunk k is written
                if received.checked.count:  # (values a .. a + written were verified and written during the receive)
                    lo, hi = int(plan.value_start[a + written]), int(plan.value_start[a + valid])
                    with side_stream(self.device):
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

"""A save through staging to pool nodes (or from an accelerator), chunk by chunk (`PipelinedSave`).

The request's staging is one lease (`JobContext.staging`; with a pool node on this host it lies in that node's
shared-memory region where it has room: `PoolClient.shm_staging`, so the node copies straight out of it), cut into
chunks (`ems.datapath.jobs.chunks`). `begin` gathers chunk k into its range of staging (one backend call per layer
group; then device → host on accelerators) and starts its encode (checksum, headers in place, unless the fused
copier's gather wrote them) and put on the jobs' executor, then gathers chunk k+1 while k is encoded and on the
wire; it returns once every chunk is gathered (the engine may then overwrite its cache). `finish` waits for the puts
and merges their outcomes; a one-chunk save's put runs in `finish`, on the calling thread. The lease goes back only
once no put can read it any more (`fence`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable

from ems.backends.base import PoolOutcome
from ems.datapath.copier import Gathered, encode_values
from ems.datapath.devices import side_stream
from ems.datapath.jobs import chunks as chunking
from ems.datapath.jobs.chunks import chunk_outcome, fence, merge_outcomes, plan_chunks, run_now
from ems.datapath.jobs.transfer import JobContext, SaveJob, Transfer, pool_call
from ems.deadline import Deadline
from ems.records import Stage
from ems.staging import StagingLease
from ems.store.value_format import HEADER_SIZE


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
            with side_stream(self.device):  # waits for the chunk's device work at the end
                with record.stage(Stage.GATHER, plan.expected.payload_bytes(a, b)):
                    # host staging may come out of the gather encoded (the fused copier's one pass)
                    gathered = self.copier.gather(plan, lease.device, a, b)
                lease.copy_to_host(lo, hi, record)
            send = functools.partial(self._send_chunk, host, a, b, gathered)
            if len(self._chunks) == 1:  # nothing to overlap: `finish` sends it on its own thread (no thread hop)
                self._lone = functools.partial(send, None)
                return
            ahead = self._sends[-chunking.PIPELINE_DEPTH] if len(self._sends) >= chunking.PIPELINE_DEPTH else None
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

"""Save and load jobs: one request's data path as explicit stages, each recorded (`ems.datapath.records`).

A save runs gather → encode → send, a load receive → verify → scatter (plus `copy` between device and host
staging on accelerators). The copies are the job's copier's (`ems.datapath.copier`, chosen once per job by
`save_job` / `load_job`: fused or separate); where it is the fused one (the compiled host copy, CPU:
`FusedCopier.gather_at`) a save's encode is part of its gather stage, each value hashed and headed right after its
rows are written; where it verifies while it scatters, a load's verify is part of its scatter. `save_job` /
`load_job` pick the job type for a request's path (never the caller):

* **Embedded** (`EmbeddedSave`, `EmbeddedLoad`: the embedded pool on CPU), one pass: a save takes every value's
  buffer from the store at once (`KvStore.allocate_many`: usually back to back, the layout a plan packs values
  in), gathers every value straight into those buffers with one backend call per layer group (the buffers' own
  addresses as the values' places), checksums each payload and writes its header in place, and hands the buffers
  to the store (no copy). A load takes the stored values, verifies the present prefix (header and checksum) and
  scatters it straight from the stored bytes with one backend call per layer group. V0 values (raw ranges) move
  value by value (torch has no batched copy between arbitrary addresses).
* **Pipelined** (`PipelinedSave`, `PipelinedLoad`: remote pools, accelerators): the request's staging is one
  lease, cut into chunks of consecutive values (`plan_chunks`: about `EMS_CHUNK_BYTES`, default 16 MiB, and within
  the pool's request limits). A save gathers chunk k into its range of staging (one backend call per layer group;
  then device → host on accelerators) and starts its encode (checksum, headers in place) and put on the jobs'
  executor (`PoolBackend.executor`, `ems.datapath.executor`), then gathers chunk k+1 while k is encoded and on the wire;
  `begin` returns once every chunk is gathered, `finish` waits for the puts and merges their outcomes. A load runs
  each chunk's receive (`PoolClient.get_into`: values land in their places in staging) and its verification on
  the pipeline threads, and scatters chunk k's verified prefix while later chunks arrive, stopping at the first
  miss. Where the staging is the cache's own memory (CPU) and the copy backend verifies while it scatters (the
  compiled host copy), the receive checks only the headers and the scatter hashes each value just before writing
  it (`FusedCopier.verify_scatter`: one pass over bytes still in cache); the embedded load does the same.
  `EMS_CHUNK_BYTES=0` makes the request one chunk; so is a load staged in a same-host node's region (below: the
  node only copies). A request of one chunk has nothing to overlap, so its put (in `finish`) and its receive
  run on the calling thread. A load staged in the region, fused as above, overlaps within its one request
  instead: the node publishes how many leading values it has placed (a progress word in the region), and the
  receive verifies and scatters each as it lands, in one GIL-free C call, while the node copies the next
  (`FusedCopier.as_placed`); what that call did not take (the node stopped counting: a miss, a
  value of another length; the reply came first) is checked and scattered from the reply as before, and a value
  that fails its check ends the load there.
  In flight: a job keeps at most `PIPELINE_DEPTH` chunk requests on the wire (a save's chunk k is sent once chunk
  k - depth has returned; a load starts chunk k + depth once chunk k verified), and at most `PIPELINE_THREADS`
  chunk calls run at once per client (the rest queue, in order).
  Fencing: the lease is released only when every chunk call has returned (queued ones are cancelled), each
  bounded by the request's deadline; a chunk whose call failed or timed out may leave UCX touching its buffer a
  moment longer (the endpoint is aborted, not awaited), so then the lease is retired, never reused
  (`StagingPool.retire`). With a pool node on this host the lease lies in that node's shared-memory region where it
  has room (`PoolClient.shm_staging`), so the node copies straight out of it and into it.
* **Staged V0 load** (`StagedLoad`: V0 from pool nodes, whose staging has no room for the headers): receive one
  batch, verify, copy into staging, scatter.

Failure semantics are `ContextCaching`'s: a job never writes a block it did not verify, nor one after the first
miss, and gives back every buffer and lease on every path.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np
import torch

from ems.backends.base import PoolBackend, PoolOutcome
from ems.buffers import Buffer
from ems.datapath.copier import Checked, Copier, Gathered, PlacedScatter, Verified, copier_for, encode_values
from ems.datapath.devices import side_stream
from ems.datapath.planning import BlockPlan, Plan, RawPlan
from ems.datapath.records import JobRecord, Stage
from ems.datapath.staging import StagingLease, StagingPool
from ems.deadline import Deadline
from ems.errors import EmsErrorCode
from ems.kernels import CopyBackend
from ems.kernels.base import PlacedStop
from ems.kernels.raw_memory import buffer_addresses, raw_tensor
from ems.store.kv_store import ENTRY_OVERHEAD, KvStore
from ems.store.value_format import HEADER_SIZE, encode_in_place, valid_prefix
from ems.transport.base import TransportError
from ems.transport.protocol import RequestLimits, key_lens
from ems.types import CcKvOption

log = logging.getLogger("ems")
PIPELINE_DEPTH = 2  # chunk requests of one job on the wire at once (see perf/RESULTS.md, API over UCX)
FENCE_GRACE_S = 2.0  # past the request's deadline, how long a job waits for a chunk call that bounds itself anyway
# the embedded path views the address span of a request's buffers as one tensor: never one wider than this
# (buffers from unrelated mappings; then it moves value by value)
MAX_VALUE_SPAN = 1 << 40


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
    merged.verified = bool(outcomes) and all(o.verified for o in outcomes)
    return merged


def _failed_chunk(count: int, code: EmsErrorCode, message: str) -> PoolOutcome:
    """A chunk whose call did not give an outcome: none of its keys done, the failure as its one error."""
    return PoolOutcome([False] * count, [TransportError(code, message)], nodes_contacted=1)


def _fence_wait_s(deadline: Deadline) -> float:
    """How long a job still waits for a chunk call: until the request's deadline plus the grace."""
    return deadline.extended(FENCE_GRACE_S).left()


def _chunk_outcome(future: concurrent.futures.Future, count: int, deadline: Deadline) -> Any:
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
    """Run `call` in this thread; its result or exception as a finished future (what `fence` and `_chunk_outcome`
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


def stored_array(value: Buffer) -> np.ndarray:
    """A uint8 numpy array over a stored value's bytes, for reading (a scatter never writes its source; the copy
    backends take it as it is or view it): no copy."""
    owner = value.obj if isinstance(value, memoryview) else value
    if isinstance(owner, np.ndarray) and owner.dtype == np.uint8 and owner.ndim == 1 and owner.nbytes == len(value):
        return owner
    return np.frombuffer(value, dtype=np.uint8)


def span_of(addresses: np.ndarray, lengths: np.ndarray) -> tuple[torch.Tensor, np.ndarray] | None:
    """One uint8 CPU tensor over the address span of buffers (`addresses`, `lengths`: int64 `[n]`) and each
    buffer's offset in it; None when the span is wider than `MAX_VALUE_SPAN`. The tensor aliases memory between
    the buffers too: callers only touch bytes inside the buffers (a gather writes exactly the bytes its pieces
    name, a scatter only reads)."""
    lo = int(addresses.min())
    hi = int((addresses + lengths).max())
    if hi - lo > MAX_VALUE_SPAN:
        return None
    return raw_tensor(lo, hi - lo, torch.device("cpu")), addresses - lo


class SaveJob(Protocol):
    """One save: `begin()` takes every byte out of the engine's cache (then the engine may overwrite it),
    `finish()` stores them and returns the pool's outcome (which keys were acknowledged); `abandon()` gives
    everything back when `finish` will never run (idempotent)."""

    record: JobRecord

    def begin(self) -> None: ...

    def finish(self) -> PoolOutcome: ...

    def abandon(self) -> None: ...


class LoadJob(Protocol):
    """One load: `run()` writes only the verified prefix and returns (blocks written, the pool's outcome)."""

    record: JobRecord

    def run(self) -> tuple[int, PoolOutcome]: ...


class EmbeddedSave:
    """The embedded pool's one-pass save (see the module docstring)."""

    def __init__(self, plan: Plan, copier: Copier, store: KvStore, record: JobRecord) -> None:
        self.plan, self.copier, self.store, self.record = plan, copier, store, record
        record.path = "one-pass"
        self._buffers: list[np.ndarray] = []
        self._reserved: list[int] = []  # the store's reservation for each buffer
        self._addresses: list[int] = []  # each buffer's address (the store's)

    def begin(self) -> None:
        try:
            self._begin()
        except BaseException:  # interrupts included: nothing leaks
            self.abandon()
            raise

    def _begin(self) -> None:
        plan, store, record = self.plan, self.store, self.record
        # Python ints: for the few values of a typical call they cost less than numpy's per-call overhead
        sizes = [length + HEADER_SIZE for length in plan.expected.payload_len.tolist()]
        capacity = store.capacity_bytes
        charges = [len(key) + size + ENTRY_OVERHEAD for key, size in zip(plan.keys, sizes)]
        count = next((i for i, charge in enumerate(charges) if charge > capacity), plan.total)  # too big, and after: refused
        payload = sum(sizes[:count]) - HEADER_SIZE * count
        with record.stage(Stage.GATHER, payload):
            self._reserved = charges[:count]
            self._buffers, self._addresses = buffers, addresses = store.allocate_many(sizes[:count], self._reserved)
            if not count:
                return
            span = None
            if isinstance(plan, BlockPlan) and count > 1:
                span = span_of(np.array(addresses, dtype=np.int64), np.array(sizes[:count], dtype=np.int64))
            gathered = Gathered.PAYLOADS
            if isinstance(plan, BlockPlan) and span is not None:
                gathered = self.copier.gather_at(plan, span[0], span[1], 0, count)  # encoded too where it can be
            else:  # one value (its own buffer), V0 raw ranges (one copy each anyway), or buffers too far apart
                for i, buffer in enumerate(buffers):
                    self.copier.gather_value(plan, i, buffer)
        if gathered is Gathered.PAYLOADS:
            with record.stage(Stage.ENCODE, payload):
                encode_in_place(buffers, plan.expected, 0, addresses)

    def finish(self) -> PoolOutcome:
        """Hand the buffers to the store (no copy): every value that fitted the pool is acknowledged."""
        plan = self.plan
        try:
            buffers, reserved, addresses = self._buffers, self._reserved, self._addresses
            self._buffers, self._reserved, self._addresses = [], [], []  # the store owns them now
            count = len(buffers)
            with self.record.stage(Stage.SEND, sum(map(len, buffers))):
                self.store.put_owned_many(plan.keys[:count], buffers, reserved, addresses)
            del buffers
            outcome = PoolOutcome([True] * count + [False] * (plan.total - count))  # after: larger than the pool
            outcome.nodes_contacted = 1
            return outcome
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Give back every buffer not handed to the store (idempotent)."""
        buffers, self._buffers = self._buffers, []
        reserved, self._reserved = self._reserved, []
        addresses, self._addresses = self._addresses, []
        for buffer, reserve, address in zip(buffers, reserved, addresses):
            self.store.recycle(buffer, reserve, address)


class PipelinedSave:
    """A save through staging to pool nodes (or from an accelerator): see the module docstring."""

    def __init__(
        self,
        plan: Plan,
        device: torch.device,
        copier: Copier,
        pool: PoolBackend,
        staging: StagingPool,
        option: CcKvOption,
        record: JobRecord,
        chunk_bytes: int,
    ) -> None:
        self.plan, self.device, self.copier, self.pool = plan, device, copier, pool
        self.staging, self.option, self.record = staging, option, record
        self.chunk_bytes = chunk_bytes  # Settings.chunk_bytes
        record.path = "pipelined"
        self._lease: StagingLease | None = None
        self._chunks: list[tuple[int, int]] = []
        self._sends: list[concurrent.futures.Future] = []  # each chunk's encode + put, in order
        self._stop = threading.Event()  # set: chunks not yet sent are not sent (an earlier one failed, or abandon)
        self._deadline = Deadline(0.0)
        self._lone: Callable[[], PoolOutcome] | None = None  # a one-chunk save's send, run by `finish`

    def begin(self) -> None:
        try:
            self._begin()
        except BaseException:  # interrupts included: nothing leaks
            self.abandon()
            raise

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
                if lease.host is not lease.device:
                    with record.stage(Stage.COPY, hi - lo):
                        lease.host[lo:hi].copy_(lease.device[lo:hi], non_blocking=True)
            send = functools.partial(self._send_chunk, host, a, b, gathered)
            if len(self._chunks) == 1:  # nothing to overlap: `finish` sends it on its own thread (no thread hop)
                self._lone = functools.partial(send, None)
                return
            ahead = self._sends[-PIPELINE_DEPTH] if len(self._sends) >= PIPELINE_DEPTH else None
            self._sends.append(self.pool.executor.start(functools.partial(send, ahead)))

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
            outcome = self.pool.put(
                plan.route_keys[a:b], plan.keys[a:b], values, self.option, value_lens, deadline=self._deadline
            )
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
            outcomes = [_chunk_outcome(f, b - a, self._deadline) for f, (a, b) in zip(self._sends, self._chunks)]
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


class EmbeddedLoad:
    """The embedded pool's one-pass load (see the module docstring)."""

    def __init__(self, plan: Plan, copier: Copier, store: KvStore, record: JobRecord) -> None:
        self.plan, self.copier, self.store, self.record = plan, copier, store, record
        record.path = "one-pass"

    def run(self) -> tuple[int, PoolOutcome]:
        plan, record = self.plan, self.record
        with record.stage(Stage.RECEIVE):
            # the stored buffers themselves (read-only views), and their addresses where the store knows them
            values, addresses = self.store.get_many_with_addresses(plan.keys)
        outcome = PoolOutcome(values, nodes_contacted=1)
        present = next((i for i, value in enumerate(values) if value is None), len(values))
        if isinstance(plan, BlockPlan) and present > 1:
            # the copier's check: the headers only where its scatter verifies the payloads (the fused copier)
            checked = self.copier.check(values[:present], plan.expected, record)
            span = _stored_span(plan, values, addresses, checked.count) if checked.count > 1 else None
            if span is not None:
                with record.stage(Stage.SCATTER, plan.expected.payload_bytes(0, checked.count)):
                    return checked.scatter(self.copier, plan, span[0], span[1], 0), outcome
            hits = checked.confirm(values, plan.expected)
        else:
            with record.stage(Stage.VERIFY, plan.expected.payload_bytes(0, present)):
                hits = valid_prefix(values[:present], plan.expected)
        if hits:  # one value, V0 raw ranges, or stored values too far apart to view as one
            with record.stage(Stage.SCATTER, plan.expected.payload_bytes(0, hits)):
                for i in range(hits):
                    self.copier.scatter_value(plan, i, stored_array(cast(Buffer, values[i])))  # i < hits: present
        return hits, outcome


def _stored_span(
    plan: BlockPlan, values: list[Buffer | None], addresses: list[int | None], count: int
) -> tuple[torch.Tensor, np.ndarray] | None:
    """The first `count` stored values (present) as one span and their offsets in it (`span_of`), from the
    addresses the store knows, else from the buffers themselves."""
    known = addresses[:count]
    starts = np.array(known, dtype=np.int64) if None not in known else buffer_addresses(values[:count])
    return span_of(starts, plan.expected.payload_len[:count] + HEADER_SIZE)


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


class PipelinedLoad:
    """A load from pool nodes (or into an accelerator) through staging, chunk by chunk: see the module docstring."""

    def __init__(
        self,
        plan: BlockPlan,
        device: torch.device,
        copier: Copier,
        pool: PoolBackend,
        staging: StagingPool,
        option: CcKvOption,
        record: JobRecord,
        chunk_bytes: int,
    ) -> None:
        self.plan, self.device, self.copier, self.pool = plan, device, copier, pool
        self.staging, self.option, self.record = staging, option, record
        self.chunk_bytes = chunk_bytes  # Settings.chunk_bytes
        record.path = "pipelined"

    def run(self) -> tuple[int, PoolOutcome]:
        return self._run_pipelined(self.plan)

    def _run_pipelined(self, plan: BlockPlan) -> tuple[int, PoolOutcome]:
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
            chunks = plan_chunks(plan, self.pool.limits, 0 if lease.shared is not None else self.chunk_bytes)
        except BaseException:
            self.staging.release(lease)  # nothing was sent into it
            raise
        host = lease.host_view()
        receives: list[concurrent.futures.Future] = []
        # staged in a same-host node's region, as one chunk: the fused copier verifies and scatters values while the
        # node is still placing the later ones (`FusedCopier.as_placed`), from inside the receive
        placed = None
        if lease.shared is not None and len(chunks) == 1:
            placed = self.copier.as_placed(plan, lease.device, *chunks[0], record)

        def start(k: int) -> None:
            if k < len(chunks):
                a, b = chunks[k]
                call = functools.partial(self._receive_chunk, plan, host, a, b, deadline, stop, placed)
                # one chunk: nothing to overlap, so it runs here (no thread hop); else on the pipeline threads
                receives.append(run_now(call) if len(chunks) == 1 else self.pool.executor.start(call))

        outcomes: list[PoolOutcome] = []
        hits = 0
        clean = False
        try:
            for k in range(PIPELINE_DEPTH):
                start(k)
            for k, (a, b) in enumerate(chunks):
                got = _chunk_outcome(receives[k], b - a, deadline)
                received = got if isinstance(got, Received) else Received(got, 0, Verified(0))
                outcomes.append(received.outcome)
                valid, written = received.valid, received.written
                if valid == b - a:
                    start(k + PIPELINE_DEPTH)  # before the scatter: chunk k + depth arrives while chunk k is written
                if received.checked.count:  # (values a .. a + written were verified and written during the receive)
                    lo, hi = int(plan.value_start[a + written]), int(plan.value_start[a + valid])
                    with side_stream(self.device):
                        if lease.host is not lease.device:
                            with record.stage(Stage.COPY, hi - lo):
                                lease.device[lo:hi].copy_(lease.host[lo:hi], non_blocking=True)
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
        return hits, merge_outcomes(outcomes, plan.total)

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
        """On a pipeline thread: values a..b-1 straight into their places in staging, then what the copier checks of
        them before the scatter (`Copier.check`: every value, or the headers where the scatter verifies the
        payloads). `placed` (passed to the pool) may already have verified and written leading values into the
        cache: those the reply confirms are hits; the rest are checked as without it."""
        record = self.record
        if stop.is_set():  # the load already stopped before this chunk
            return Received(PoolOutcome([False] * (b - a)), 0, Verified(0))
        expected = plan.expected.range(a, b)
        start = time.perf_counter()
        outs = plan.value_views(host, a, b)
        outcome = self.pool.get_into(
            plan.route_keys[a:b],
            plan.keys[a:b],
            outs,
            self.option,
            expected,
            deadline,
            as_placed=placed.run if placed is not None else None,
        )
        received = time.perf_counter()
        present = next((i for i, ok in enumerate(outcome.results) if not ok), b - a)
        written, why = placed.result() if placed is not None else (0, PlacedStop.INTERRUPTED)
        written = min(written, present)  # (a value the reply does not confirm is not a hit, whatever was written)
        record.add(Stage.RECEIVE, expected.payload_bytes(0, present) + HEADER_SIZE * present, received - start)
        if why == PlacedStop.DAMAGED and written < present:  # value `written` failed its check: the load ends there
            return Received(outcome, written, Verified(0))
        # a pool that verified each value it placed (replicas: to fall back on damage) needs no second check
        if outcome.verified:
            return Received(outcome, written, Verified(present - written))
        return Received(outcome, written, self.copier.check(outs[written:present], expected.range(written, present), record))


class StagedLoad:
    """A V0 load from pool nodes (its staging has no room for the headers): see the module docstring."""

    def __init__(
        self,
        plan: RawPlan,
        device: torch.device,
        copier: Copier,
        pool: PoolBackend,
        staging: StagingPool,
        option: CcKvOption,
        record: JobRecord,
    ) -> None:
        self.plan, self.device, self.copier, self.pool = plan, device, copier, pool
        self.staging, self.option, self.record = staging, option, record
        record.path = "staged"

    def run(self) -> tuple[int, PoolOutcome]:
        return self._receive_copy_scatter(self.plan)

    def _receive_copy_scatter(self, plan: RawPlan) -> tuple[int, PoolOutcome]:
        """V0 (its staging has no room for the headers): receive, verify the prefix, copy it into staging, scatter."""
        record = self.record
        with record.stage(Stage.RECEIVE):
            outcome = self.pool.get(plan.route_keys, plan.keys, self.option, plan.expected)
        with record.stage(Stage.VERIFY, plan.expected.payload_bytes()):
            if outcome.verified:  # the pool checked every value it returned (replicas: to fall back on damage)
                hits = next((i for i, v in enumerate(outcome.results) if v is None), len(outcome.results))
            else:
                hits = valid_prefix(outcome.results, plan.expected)
        if hits:
            nbytes = int(plan.value_start[hits])
            lease = self.staging.acquire(nbytes, self.device)
            try:
                with record.stage(Stage.COPY, nbytes):
                    present = cast(list[Buffer], outcome.results[:hits])  # the first `hits` are present
                    _fill_from_values(plan, lease.host_array(), present)
                    with side_stream(self.device):
                        if lease.host is not lease.device:
                            lease.device[:nbytes].copy_(lease.host[:nbytes], non_blocking=True)
                with record.stage(Stage.SCATTER, plan.expected.payload_bytes(0, hits)):
                    with side_stream(self.device):
                        self.copier.scatter(plan, lease.device, 0, hits)
            finally:
                self.staging.release(lease)
        return hits, outcome


def _fill_from_values(plan: RawPlan, host: np.ndarray, values: list[Buffer]) -> None:
    """The payloads of the leading values (verified) into their places in staging (V0 staging holds no headers)."""
    starts = plan.value_start.tolist()
    for i, value in enumerate(values):
        host[starts[i] : starts[i + 1]] = np.frombuffer(value, dtype=np.uint8, offset=HEADER_SIZE)


class NothingToMove:
    """The job of a request of no values (a token-form call whose mask asks for no token): it copies nothing and
    contacts no pool; a save stores and a load writes nothing."""

    def __init__(self, record: JobRecord) -> None:
        self.record = record
        record.path = "none"

    def begin(self) -> None:
        return None

    def finish(self) -> PoolOutcome:
        return PoolOutcome([])

    def abandon(self) -> None:
        return None

    def run(self) -> tuple[int, PoolOutcome]:
        return 0, PoolOutcome([])


def _embedded_store(pool: PoolBackend, device: torch.device) -> KvStore | None:
    """The store a request's job works on directly (the one-pass path): the embedded pool's, for CPU tensors."""
    return pool.local_store if device.type == "cpu" else None


def save_job(
    plan: Plan,
    device: torch.device,
    backend: CopyBackend,
    pool: PoolBackend,
    staging: StagingPool,
    option: CcKvOption,
    record: JobRecord,
    chunk_bytes: int,
) -> SaveJob:
    """The save job for this request's path: embedded (CPU tensors, the embedded pool) or pipelined (or, for no
    values, nothing)."""
    if plan.total == 0:
        return NothingToMove(record)
    copier = copier_for(backend, in_cache_memory=device.type == "cpu")
    store = _embedded_store(pool, device)
    if store is not None:
        return EmbeddedSave(plan, copier, store, record)
    return PipelinedSave(plan, device, copier, pool, staging, option, record, chunk_bytes)


def load_job(
    plan: Plan,
    device: torch.device,
    backend: CopyBackend,
    pool: PoolBackend,
    staging: StagingPool,
    option: CcKvOption,
    record: JobRecord,
    chunk_bytes: int,
) -> LoadJob:
    """The load job for this request's path: embedded, pipelined (V1) or staged (V0 from pool nodes) (or, for no
    values, nothing)."""
    if plan.total == 0:
        return NothingToMove(record)
    copier = copier_for(backend, in_cache_memory=device.type == "cpu")
    store = _embedded_store(pool, device)
    if store is not None:
        return EmbeddedLoad(plan, copier, store, record)
    if isinstance(plan, BlockPlan):
        return PipelinedLoad(plan, device, copier, pool, staging, option, record, chunk_bytes)
    return StagedLoad(plan, device, copier, pool, staging, option, record)

"""`EmsTier`: the pool as a secondary tier of vLLM's native KV offloading (`TieringOffloadingSpec`).

Contract (vLLM's `vllm/v1/kv_offload/tiering/base.SecondaryTierManager`; loaded by vLLM's own
`SecondaryTierFactory` from `"secondary_tiers": [{"type": "EmsTier", "module_path": "ems.integrations.vllm_tier",
...}]`, the remaining keys passed as keyword arguments):

* Memory: the CPU primary tier's memory (`primary_kv_view`, `[chunks, chunk_bytes]`) is registered once as a host
  region of one slot per chunk (`host_region.HostRegion`), so a cascade (store) gathers the job's chunks from it and a
  promotion (load) scatters values straight into the job's chunk slots, one SDK call per job, by the package's copy
  path. Each tier has its own SDK client (`host_region.open_client`).
* Keys: an `OffloadKey` (block hash bytes + group index) is a V1 hash by `host_region.chunk_hash` (blake2b), in a
  namespace derived from what vLLM's own fs tier says decides a chunk's bytes (`FileMapper` fields: model, dtype,
  tokens per hash, blocks per chunk, parallel layout, KV groups) plus the chunk's byte size (the registered layout).
  vLLM's keys carry no chain position the tier can see, so values are placed per key.
* Non-blocking: every scheduler-side call only reads or writes in-memory state and queues work. `lookup` answers
  `RETRY` for a key it has not asked the pool about yet; the keys of one scheduler step are asked in one `exists`
  per request on vLLM's own lookup thread (`AsyncLookupManager`, as vLLM's fs tier does; flushed at
  `on_schedule_end`), each bounded by `lookup_timeout_ms`, and the blocks it reports are leased (`lease_ms`) for the
  promotion that follows. `submit_store` / `submit_load` queue a job for the tier's I/O threads (`io_threads`), whose
  calls are bounded by `timeout_ms`; `get_finished_jobs` drains their results. A dead or hung node therefore costs
  the scheduler nothing: lookups answer `RETRY` then `MISS`, jobs fail within the timeout.
* Results: a store succeeds when every chunk is in the pool. A promotion that loaded only a prefix reports
  `success=False` with `successful_keys` = that prefix (the framework keeps them) and marks the rest a miss for
  later lookups (so the scheduler stops asking for them). `transfer_time` and `transfer_bytes` feed vLLM's tier
  metrics; with `enable_kv_events` (and KV events on) a successful store emits an `OffloadingEvent` for its keys.
* Configuration: the pool keys of `connector_config.PLUGIN_KEYS` (connector names: `pool_nodes`, `model_id`, `timeout_ms`,
  ...) and the tier's own `io_threads`, `enable_kv_events`, `locality`; anything else, or a bad value, raises
  `ValueError` naming `secondary_tiers[EmsTier].<key>` before the engine starts.
* `drain_jobs` waits for every queued job; `shutdown` drains, stops the lookup thread and closes the client.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from ems import CcKvOption
from ems.integrations.connector_config import derive_model_id
from ems.integrations.host_region import HostRegion, chunk_hash, close_client, open_client, plugin_config

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger("ems.integrations.vllm_tier")

TIER_KEYS = ("io_threads", "enable_kv_events", "locality")
DEFAULT_IO_THREADS = 2


@dataclass(frozen=True)
class _Done:
    """One finished job, as the I/O thread saw it (read on the scheduler thread)."""

    job_id: JobId
    keys: tuple[OffloadKey, ...]
    promotion: bool
    succeeded: int  # consecutive chunks from the first
    seconds: float


class _PoolLookups(AsyncLookupManager):
    """vLLM's asynchronous lookup state, answered by one `exists` per request and step."""

    def __init__(self, tier: EmsTier) -> None:
        self._tier = tier
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        held = self._tier.region.exists(
            [chunk_hash(k) for k in keys], self._tier.lookup_option, lease_ms=self._tier.config.lease_ms
        )
        return [i < held for i in range(len(keys))]


class EmsTier(SecondaryTierManager):
    """The pool as a vLLM secondary offloading tier (see the module contract)."""

    medium: ClassVar[Medium] = Medium.CPU  # the pool's nodes hold values in memory

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **settings: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        where = f"secondary_tiers[{tier_type}]"
        own = {k: settings.pop(k) for k in TIER_KEYS if k in settings}
        self.config = plugin_config(where, settings)
        threads = own.get("io_threads", DEFAULT_IO_THREADS)
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
            raise ValueError(f"{where}.io_threads must be an int in 1..64, got {threads!r}")
        events = own.get("enable_kv_events", False)
        if not isinstance(events, bool):
            raise ValueError(f"{where}.enable_kv_events must be true or false, got {events!r}")
        try:
            self.locality = Locality(own["locality"]) if own.get("locality") is not None else None
        except ValueError:
            raise ValueError(f"{where}.locality must be one of {[x.value for x in Locality]}, got {own['locality']!r}") from None
        self.events: list[OffloadingEvent] | None = None
        if events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                logger.warning("%s.enable_kv_events is set but KV cache events are off: the tier emits none", where)
        self.option = CcKvOption(write_rcache=False, timeout=self.config.timeout_ms)  # the primary tier is the CPU copy
        self.lookup_option = CcKvOption(timeout=self.config.lookup_timeout_ms)
        memory = torch.frombuffer(primary_kv_view.cast("B"), dtype=torch.uint8)
        model_id = self.config.model_id or derive_model_id(offloading_spec.config.model.name, _namespace_parts(offloading_spec))
        self._cc = open_client(self.config, model_id)
        try:
            self.region = HostRegion(self._cc, memory, self.block_size_bytes)
        except BaseException:
            close_client(self._cc)
            raise
        self._io = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"ems-tier-{tier_type}")
        self._done: queue.SimpleQueue[_Done] = queue.SimpleQueue()
        self._pending = 0  # jobs queued and not yet done (under _idle)
        self._idle = threading.Condition()
        self._lookups = _PoolLookups(self)

    # ------------------------------------------------------------- scheduler-side calls (never block)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, promotion=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, promotion=True)

    def _submit(self, job: TransferJob, promotion: bool) -> None:
        keys = tuple(job.keys)
        chunks = [int(c) for c in job.chunk_ids]
        if len(chunks) != len(keys):
            raise ValueError(f"job {job.job_id}: {len(keys)} keys but {len(chunks)} chunk_ids")
        with self._idle:
            self._pending += 1
        self._io.submit(self._run, job.job_id, keys, chunks, promotion)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        while True:
            try:
                done = self._done.get_nowait()
            except queue.Empty:
                break
            results.append(self._result(done))
        return results

    def _result(self, done: _Done) -> JobResult:
        n = len(done.keys)
        moved = done.succeeded * self.block_size_bytes
        if done.promotion and done.succeeded < n:
            self._lookups.mark_miss(done.keys[done.succeeded :])
            kept = done.keys[: done.succeeded]
            return JobResult(done.job_id, False, kept or None, done.seconds, moved or None)
        if not done.promotion and done.succeeded == n and self.events is not None and n:
            self.events.append(OffloadingEvent(keys=list(done.keys), medium=self.medium, removed=False, locality=self.locality))
        return JobResult(done.job_id, done.succeeded == n, None, done.seconds, moved or None)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return ()
        taken, self.events = self.events, []
        return taken

    def has_pending_work(self) -> bool:
        return self._pending > 0 or not self._done.empty()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    # ------------------------------------------------------------- I/O threads

    def _run(self, job_id: JobId, keys: tuple[OffloadKey, ...], chunks: list[int], promotion: bool) -> None:
        start = time.monotonic()
        succeeded = 0
        try:
            hashes = [chunk_hash(k) for k in keys]
            move = self.region.load if promotion else self.region.save
            succeeded = move(hashes, chunks, 1, self.option).success
        except Exception:
            logger.exception("%s job %d failed", "promotion" if promotion else "cascade", job_id)
        finally:
            self._done.put(_Done(job_id, keys, promotion, succeeded, time.monotonic() - start))
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    # ------------------------------------------------------------- lifecycle

    def drain_jobs(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def shutdown(self) -> None:
        self.drain_jobs()
        self._lookups.shutdown()
        self._io.shutdown(wait=True)
        close_client(self._cc)
        # the client's registered layout and the region view the primary tier's memory: let them go, so the
        # primary tier can close its shared-memory mapping
        del self.region, self._cc


def _namespace_parts(spec: OffloadingSpec) -> dict[str, str]:
    """What decides a chunk's bytes, as vLLM's own fs tier names it (its `FileMapper` fields)."""
    mapper = FileMapper.from_offloading_spec(root_dir="", offloading_spec=spec, blocks_per_file=spec.blocks_per_chunk)
    fields = dict(mapper.fields, rank=mapper.rank, engine="vllm-offloading-tier")
    return {name: json.dumps(value, sort_keys=True) for name, value in fields.items()}

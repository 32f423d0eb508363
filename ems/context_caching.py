"""`ContextCaching`: the save/load/exists pipeline behind the SDK's calls.

One save: check the arguments (`requests`) → plan keys and copies (`planning`) → lease staging → gather the named
rows into it with the device's copy backend (`ems.kernels`) → copy to host (accelerators) → checksum and header per
value → one batched put per owning pool node (`PoolClient`) → `CcResult(consecutive acknowledged blocks, total)`.
A load mirrors it: batched get → keep the prefix of values that are present and exactly what the request expects
(header and checksum) → copy that prefix into staging → host → device → scatter only the hit prefix into the cache.

Failure semantics: bad arguments raise `EmsException(EMS_INVALID_ARGUMENT)` before anything moves; a save or load
whose keys partly fail returns the consecutive prefix; one that reached no node raises `EMS_IO_ERROR` (or
`EMS_IO_TIMEOUT`); `exists` never raises for pool failures, it reports 0 hits. A load never writes a block it did not
verify, nor any block after the first miss.

Counters (`metrics()`, `ems.cc_metrics`): every finished call adds its blocks, bytes and stage times once (no
per-block work); they are registered with prometheus_client's default registry when it is installed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator, List, Optional, Sequence, Union, cast, overload

import numpy as np
import torch

from ems.cc_metrics import CcMetrics
from ems.config import CcConfig, Settings
from ems.devices import default_raw_device, parse_device, side_stream
from ems.errors import EmsErrorCode, EmsException
from ems.kernels import CopyBackend, get_backend
from ems.keys import namespace, v0_keys, v1_keys
from ems.layout import RegisteredLayout, register_layout
from ems.planning import Plan, plan_blocks, plan_raw
from ems.pool_client import PoolClient, PoolOutcome
from ems.requests import Operation, RawRequest, Request, bind_exists, bind_request
from ems.staging import StagingLease, StagingPool
from ems.types import CcFuture, CcKvOption, CcResult, KvBufferWrapper, PrimaryKey, StoreLayerGroupDesc, V0Key
from ems.value_format import HEADER_SIZE, Buffer, build_headers, checksum, valid_prefix

logger = logging.getLogger("ems")

# The argument types of the public call forms (what `requests.bind_request` accepts).
IntList = Union[Sequence[int], np.ndarray, torch.Tensor]  # slot_mapping, offsets
HashList = Union[Sequence[int], np.ndarray, torch.Tensor]  # block hashes: int64 or u64 values
ChunkDescs = Sequence[Sequence[Sequence[int]]]  # chunk_descs[group][block] = (start_slot, length)
profile_logger = logging.getLogger("ems.profile")


def consecutive_prefix(flags: Sequence[bool]) -> int:
    """How many leading entries are true."""
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)


def _as_ems_exception(exc: Exception) -> EmsException:
    if isinstance(exc, EmsException):
        return exc
    return EmsException(EmsErrorCode.EMS_INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def _ems_errors(on_error: Optional[Callable[[], None]] = None) -> Iterator[None]:
    """Turn any `Exception` into an `EmsException` (EMS_INTERNAL_ERROR unless it already is one). `KeyboardInterrupt`,
    `SystemExit` and other `BaseException`s pass through unchanged: the caller's process must be able to stop.
    `on_error` (the error counter) runs first for every `Exception`."""
    try:
        yield
    except Exception as exc:
        if on_error is not None:
            on_error()
        converted = _as_ems_exception(exc)
        if converted is exc:
            raise
        raise converted from exc


class _Profile:
    """Stage timings of one request: added to the counters, and logged when ENABLE_CC_PROFILING=1."""

    enabled = os.environ.get("ENABLE_CC_PROFILING") == "1"

    def __init__(self, op: str, metrics: Optional[CcMetrics] = None) -> None:
        self.op = op
        self.metrics = metrics
        self.marks: list[tuple[str, float]] = [("start", time.perf_counter())]

    def mark(self, stage: str) -> None:
        self.marks.append((stage, time.perf_counter()))

    def report(self, result: CcResult, nbytes: int) -> None:
        if self.metrics is not None:
            self.metrics.record(self.op, result.success, result.total, nbytes, self.marks)
        if not self.enabled:
            return
        stages = ", ".join(
            f"{name} {1e3 * (t - self.marks[i][1]):.2f} ms" for i, (name, t) in enumerate(self.marks[1:])
        )
        profile_logger.info("%s %d/%d blocks, %d bytes: %s", self.op, result.success, result.total, nbytes, stages)


class ContextCaching:
    """The EMS Context Caching client of one process (get it from `Ems.get_cc()`)."""

    def __init__(self, cc_config: CcConfig, tenant: Optional[str], pool: PoolClient, settings: Settings) -> None:
        self._cc_config = cc_config
        self._tenant = tenant
        self._pool = pool
        self._settings = settings
        self._layout: Optional[RegisteredLayout] = None
        self._v1_namespace = b""
        self._v0_namespace = namespace(tenant, cc_config, None)
        self._raw_device = parse_device(settings.device) if settings.device else None
        self._staging = StagingPool(settings.staging_capacity)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=settings.max_inflight, thread_name_prefix="ems-cc"
        )
        self._inflight = threading.BoundedSemaphore(settings.max_inflight)
        self._closed = False
        self._metrics = CcMetrics(cc_config.rank_id)
        self._metrics.register()

    # ---------------------------------------------------------------- registration

    def register_kvcache(
        self, kvcache: List[List[torch.Tensor]], store_layer_group_desc: Optional[List[StoreLayerGroupDesc]] = None
    ) -> None:
        """Record the engine's paged KV cache: `kvcache[layer][0 or 1]` is that layer's K or V tensor,
        `[blocks, block_size, heads, head_size]`. Moves no data. Registering again replaces the layout."""
        layout = register_layout(kvcache, store_layer_group_desc)
        backend = self._backend_for(layout.device)
        self._layout = layout
        self._v1_namespace = namespace(self._tenant, self._cc_config, layout.signature)
        logger.info(
            "registered KV cache: %d layers in %d group(s) on %s, copy backend %s",
            layout.num_layers,
            len(layout.groups),
            layout.device,
            backend.describe(),
        )

    @property
    def layout(self) -> Optional[RegisteredLayout]:
        return self._layout

    @property
    def kernel_backend(self) -> str:
        """The copy backend serving the registered cache's device (or the V0 device)."""
        return str(self._backend_for(self._layout.device if self._layout else self._raw_device_now()).describe())

    # ---------------------------------------------------------------- helpers

    def _raw_device_now(self) -> torch.device:
        if self._raw_device is not None:
            return self._raw_device
        return default_raw_device(self._cc_config.device_id, self._layout.device if self._layout else None)

    def _backend_for(self, device: torch.device) -> CopyBackend:
        try:
            return get_backend(device, self._settings.kernel_backend)
        except RuntimeError as exc:  # e.g. triton forced where it cannot run: the setting is at fault
            raise EmsException(
                EmsErrorCode.EMS_INVALID_ARGUMENT,
                f"kernel_backend={self._settings.kernel_backend.value!r} cannot serve {device}: {exc}",
            ) from exc

    def _check_open(self) -> None:
        if self._closed:
            raise EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, "this ContextCaching was shut down")

    def _bind(self, op: Operation, args: tuple, kwargs: dict) -> tuple[Request, Plan, torch.device]:
        self._check_open()
        layout = self._layout
        request = bind_request(op, args, kwargs, layout)
        if isinstance(request, RawRequest):
            return request, plan_raw(request, self._v0_namespace), self._raw_device_now()
        if layout is None:  # bind_request already refuses this; kept for type narrowing
            raise EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, "V1 calls need register_kvcache() first")
        return request, plan_blocks(request, layout, self._v1_namespace), layout.device

    @staticmethod
    def _raise_if_unreachable(outcome: PoolOutcome, successes: int) -> None:
        if successes == 0 and outcome.unreachable:
            error = outcome.first_error()
            if error is not None:
                raise EmsException(error.status_code(), f"no pool node could be reached: {error.message()}")

    # ---------------------------------------------------------------- save

    def _begin_save(self, args: tuple, kwargs: dict) -> tuple[Callable[[], CcResult], Callable[[], None]]:
        """Check, plan and copy the blocks out of the engine's cache; return (the rest of the save as a job, the
        way to give its staging back should the job never run).

        When this returns, every byte the save needs is in host staging: the engine may overwrite the blocks.
        """
        profile = _Profile("save", self._metrics)
        request, plan, device = self._bind(Operation.SAVE, args, kwargs)
        backend = self._backend_for(device)
        profile.mark("plan")
        with _ems_errors():  # e.g. the allocator refusing the staging buffer: still an EmsException
            lease = self._staging.acquire(plan.staging_bytes, device)
        try:
            with _ems_errors(), side_stream(device):
                plan.gather(backend, lease.device)
                if lease.host is not lease.device:
                    lease.host[: plan.staging_bytes].copy_(lease.device[: plan.staging_bytes], non_blocking=True)
            profile.mark("gather")
        except BaseException:  # the lease goes back on every path, interrupts included
            self._staging.release(lease)
            raise

        def finish() -> CcResult:
            try:
                parts = plan.payload_parts(lease.host_view())
                headers = build_headers(plan.expected, [checksum(p) for p in parts])
                values = [[header, *p] for header, p in zip(headers, parts)]
                profile.mark("checksum")
                value_lens = plan.expected.payload_len + HEADER_SIZE
                outcome = self._pool.put(plan.route_keys, plan.keys, values, request.option, value_lens)
                profile.mark("put")
            finally:
                self._staging.release(lease)
            successes = consecutive_prefix(outcome.results)
            self._raise_if_unreachable(outcome, successes)
            result = CcResult(successes, plan.total)
            profile.report(result, plan.staging_bytes)
            return result

        return finish, lambda: self._staging.release(lease)

    @overload
    def save(
        self, option: CcKvOption, key_list: Sequence[V0Key], value_list: Sequence[Sequence[KvBufferWrapper]]
    ) -> CcResult: ...

    @overload
    def save(
        self, slot_mapping: IntList, hashes: HashList, offsets: IntList, option: Optional[CcKvOption] = None
    ) -> CcResult: ...

    @overload
    def save(self, *, hashes: HashList, chunk_descs: ChunkDescs, option: Optional[CcKvOption] = None) -> CcResult: ...

    def save(self, *args: Any, **kwargs: Any) -> CcResult:
        """Save blocks to the pool (V0 `save(option, key_list, value_list)`; V1 `save(slot_mapping, hashes,
        offsets, option=None)` or `save(hashes=..., chunk_descs=..., option=None)`). Blocks until stored."""
        finish, _ = self._begin_save(args, kwargs)
        with _ems_errors(self._metrics.record_error):
            return finish()

    @overload
    def async_save(
        self, option: CcKvOption, key_list: Sequence[V0Key], value_list: Sequence[Sequence[KvBufferWrapper]]
    ) -> CcFuture: ...

    @overload
    def async_save(
        self, slot_mapping: IntList, hashes: HashList, offsets: IntList, option: Optional[CcKvOption] = None
    ) -> CcFuture: ...

    @overload
    def async_save(self, *, hashes: HashList, chunk_descs: ChunkDescs, option: Optional[CcKvOption] = None) -> CcFuture: ...

    def async_save(self, *args: Any, **kwargs: Any) -> CcFuture:
        """Like `save`, but returns a `CcFuture` at once.

        The blocks have been copied out of the engine's cache when this returns, so the engine may reuse or
        overwrite them immediately; the transfer to the pool continues in the background. At most
        `max_inflight` async calls are pending; a further call waits for one to finish (back-pressure).
        Bad arguments raise here, before anything moves.
        """
        self._inflight.acquire()
        try:
            finish, abandon = self._begin_save(args, kwargs)
        except BaseException:
            self._inflight.release()
            raise
        try:
            return self._submit(finish)
        except BaseException:  # never submitted (e.g. shut down meanwhile): give back what the job held
            abandon()
            self._inflight.release()
            raise

    # ---------------------------------------------------------------- load

    def _load(self, request: Request, plan: Plan, device: torch.device) -> CcResult:
        profile = _Profile("load", self._metrics)
        outcome = self._pool.get(plan.route_keys, plan.keys, request.option, plan.expected)
        profile.mark("get")
        if outcome.verified:  # the pool checked every value it returned (replicas: to fall back on damage)
            hits = consecutive_prefix([value is not None for value in outcome.results])
        else:
            hits = valid_prefix(outcome.results, plan.expected)
        self._raise_if_unreachable(outcome, hits)
        profile.mark("verify")
        if hits:
            lease: StagingLease = self._staging.acquire(plan.prefix_staging_bytes(hits), device)
            try:
                # the first `hits` values were verified (by valid_prefix or the pool): none of them is None
                plan.fill_from_values(lease.host_array(), cast(List[Buffer], outcome.results), hits)
                profile.mark("fill")
                nbytes = plan.prefix_staging_bytes(hits)
                with side_stream(device):
                    if lease.host is not lease.device:
                        lease.device[:nbytes].copy_(lease.host[:nbytes], non_blocking=True)
                    plan.scatter_prefix(self._backend_for(device), lease.device, hits)
                profile.mark("scatter")
            finally:
                self._staging.release(lease)
        result = CcResult(hits, plan.total)
        profile.report(result, plan.prefix_staging_bytes(hits))
        return result

    @overload
    def load(
        self, option: CcKvOption, key_list: Sequence[V0Key], value_list: Sequence[Sequence[KvBufferWrapper]]
    ) -> CcResult: ...

    @overload
    def load(
        self, slot_mapping: IntList, hashes: HashList, offsets: IntList, option: Optional[CcKvOption] = None
    ) -> CcResult: ...

    @overload
    def load(self, *, hashes: HashList, chunk_descs: ChunkDescs, option: Optional[CcKvOption] = None) -> CcResult: ...

    def load(self, *args: Any, **kwargs: Any) -> CcResult:
        """Load blocks from the pool into the places the arguments name (the same three forms as `save`).

        `success` is the number of blocks, from the first, that were found and verified: exactly those are
        written; nothing after the first miss is touched."""
        request, plan, device = self._bind(Operation.LOAD, args, kwargs)
        with _ems_errors(self._metrics.record_error):
            return self._load(request, plan, device)

    @overload
    def async_load(
        self, option: CcKvOption, key_list: Sequence[V0Key], value_list: Sequence[Sequence[KvBufferWrapper]]
    ) -> CcFuture: ...

    @overload
    def async_load(
        self, slot_mapping: IntList, hashes: HashList, offsets: IntList, option: Optional[CcKvOption] = None
    ) -> CcFuture: ...

    @overload
    def async_load(self, *, hashes: HashList, chunk_descs: ChunkDescs, option: Optional[CcKvOption] = None) -> CcFuture: ...

    def async_load(self, *args: Any, **kwargs: Any) -> CcFuture:
        """Like `load`, but returns a `CcFuture` at once. The engine must not use the named slots or buffers until
        the future is done. Bad arguments raise here."""
        self._inflight.acquire()
        try:
            request, plan, device = self._bind(Operation.LOAD, args, kwargs)
            return self._submit(lambda: self._load(request, plan, device))
        except BaseException:
            self._inflight.release()
            raise

    # ---------------------------------------------------------------- futures

    def _submit(self, job: Callable[[], CcResult]) -> CcFuture:
        def run() -> CcResult:
            try:
                with _ems_errors(self._metrics.record_error):
                    return job()
            finally:
                self._inflight.release()

        return CcFuture(self._executor.submit(run))

    def is_ready(self, future: CcFuture) -> bool:
        """Whether an async call has finished; never blocks."""
        if not isinstance(future, CcFuture):
            raise EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, f"future must be a CcFuture, got {type(future).__name__}")
        return future.done()

    def get_result(self, future: CcFuture) -> CcResult:
        """The result of an async call, waiting for it; raises what the call raised."""
        if not isinstance(future, CcFuture):
            raise EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, f"future must be a CcFuture, got {type(future).__name__}")
        return future.result()

    # ---------------------------------------------------------------- exists

    def exists(
        self, hashes: Union[HashList, Sequence[V0Key]], option: Optional[CcKvOption] = None, **kwargs: Any
    ) -> CcResult:
        """How many of `hashes` (V1 block hashes, or V0 keys: PrimaryKey or str), from the first, the pool holds.

        A pool failure or timeout reports 0 hits (the engine then recomputes) instead of raising."""
        self._check_open()
        items, checked_option = bind_exists(hashes, option, kwargs)
        if isinstance(items[0], (PrimaryKey, str)):
            keys, route_keys = v0_keys(self._v0_namespace, items)
        else:
            if self._layout is None:
                raise EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, "exists(): V1 hashes need register_kvcache() first")
            keys, route_keys = v1_keys(self._v1_namespace, items)
        try:
            outcome = self._pool.exists(route_keys, keys, checked_option)
        except Exception as exc:  # the contract: a failing pool is a miss, not an exception
            logger.warning("exists: pool failure reported as 0 hits: %s", exc)
            return CcResult(0, len(keys))
        result = CcResult(0, len(keys)) if outcome.unreachable else CcResult(consecutive_prefix(outcome.results), len(keys))
        self._metrics.record_exists(result.success, result.total)
        return result

    # ---------------------------------------------------------------- lifecycle

    def metrics(self) -> dict[str, float]:
        """This process's counters since start (this package's addition); keys in `ems.cc_metrics`."""
        return self._metrics.snapshot()

    def close(self) -> None:
        """Wait for pending async calls, then release threads and staging buffers."""
        self._closed = True
        self._executor.shutdown(wait=True)
        self._staging.clear()
        self._metrics.unregister()


ContextCache_v1 = ContextCaching  # the EMS SDK's name of its V1 client: one type, two names

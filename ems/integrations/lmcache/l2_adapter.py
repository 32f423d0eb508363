"""`EmsL2Adapter`: the pool as an L2 adapter of LMCache's multi-process mode.

Contract (LMCache 0.5.6, `lmcache/v1/distributed/l2_adapters/base.L2AdapterInterface`; loaded by LMCache's own
plugin adapter loading from `--l2-adapter '{"type": "plugin", "module_path": "ems.integrations.lmcache",
"class_name": "EmsL2Adapter", "adapter_params": {...}}'`, which builds `cls(adapter_params, l1_memory_desc=...)`):

* Memory: the L1 arena LMCache describes (`L1MemoryDesc`: base address, size, allocation alignment) is registered
  once as a host region (`host_region.HostRegion`) of `align_bytes` slots; every memory object LMCache hands over
  (stores) or hands in (loads) lies in it, at a multiple of the alignment, and moves as the run of slots it occupies
  (its physical, aligned size), by the package's copy path, one SDK call per task. Without a descriptor (an adapter
  built without L1 memory) the adapter refuses to start.
* Keys: an `ObjectKey` (chunk hash bytes, model, KV rank, object group, cache salt) is a V1 hash by
  `host_region.chunk_hash` of all its fields, placed per key, in a namespace of the adapter's `model_id` (default:
  derived from `namespace`, "lmcache-mp") and the slot size.
* Tasks run on the adapter's threads; each kind signals its own event fd on completion. A store's result is
  `L2StoreResult(all stored, bytes stored)`. A lookup-and-lock is one `exists` per task with a lease (`lease_ms`):
  the bitmap has the consecutive hits from the first key; `submit_unlock` ends nothing early (the lease expires, a
  load's read ends it). A load's bitmap has the loaded keys from the first to the first miss. A failing pool gives
  failed stores and zero bits within `timeout_ms`, never an exception into LMCache's controllers.
* `adapter_params`: the pool keys of `connector_config.PLUGIN_KEYS`, `io_threads`, `max_object_bytes` (the largest object,
  default 64 MiB) and `namespace`; anything else or a bad value raises `ValueError` naming
  `adapter_params.<key>`.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.platform import create_event_notifier

from ems import CcKvOption
from ems.integrations.connector_config import PLUGIN_KEYS, derive_model_id
from ems.integrations.host_region import HostRegion, chunk_hash, close_client, open_client, plugin_config

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.internal_api import L1MemoryDesc
    from lmcache.v1.memory_management import MemoryObj

logger = logging.getLogger("ems.integrations.lmcache")

OWN_KEYS = ("io_threads", "max_object_bytes", "namespace")
DEFAULT_MAX_OBJECT_BYTES = 64 << 20


def object_hash(key: ObjectKey) -> int:
    """A V1 hash of every field of an `ObjectKey` ("@" cannot occur in its text fields)."""
    text = f"{key.model_name}@{key.kv_rank}@{key.object_group_id}@{key.cache_salt}@".encode()
    return chunk_hash(text + bytes(key.chunk_hash))


class EmsL2Adapter(L2AdapterInterface):
    """LMCache's multi-process L2 over the pool (see the module contract)."""

    def __init__(self, adapter_params: dict[str, Any] | None, l1_memory_desc: L1MemoryDesc | None = None) -> None:
        super().__init__()
        params = dict(adapter_params or {})
        where = "adapter_params"
        own = {k: params.pop(k) for k in OWN_KEYS if k in params}
        threads = own.get("io_threads", 2)
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
            raise ValueError(f"{where}.io_threads must be an int in 1..64, got {threads!r}")
        largest = own.get("max_object_bytes", DEFAULT_MAX_OBJECT_BYTES)
        if isinstance(largest, bool) or not isinstance(largest, int) or largest <= 0:
            raise ValueError(f"{where}.max_object_bytes must be an int > 0, got {largest!r}")
        namespace = own.get("namespace", "lmcache-mp")
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"{where}.namespace must be a non-empty string, got {namespace!r}")
        self.settings = plugin_config(where, params, PLUGIN_KEYS)
        if l1_memory_desc is None:
            raise ValueError("EmsL2Adapter needs LMCache's L1 memory descriptor (l1_memory_desc) to move objects in place")
        self.unit = int(l1_memory_desc.align_bytes)
        size = int(l1_memory_desc.stable_registration_size or l1_memory_desc.size)
        arena = torch.frombuffer((ctypes.c_uint8 * size).from_address(int(l1_memory_desc.ptr)), dtype=torch.uint8)
        self.option = CcKvOption(write_rcache=False, timeout=self.settings.timeout_ms)
        self.lookup_option = CcKvOption(timeout=self.settings.lookup_timeout_ms)
        model_id = self.settings.model_id or derive_model_id(namespace, {"adapter": "lmcache-l2", "unit": str(self.unit)})
        self._cc = open_client(self.settings, model_id)
        try:
            self.region = HostRegion(self._cc, arena, self.unit, max(1, -(-largest // self.unit)))
        except BaseException:
            close_client(self._cc)
            raise
        self._io = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ems-lmcache-l2")
        self._lock = threading.Lock()
        self._next = 0
        self._stores: dict[L2TaskId, L2StoreResult] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, Bitmap] = {}
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()

    # ------------------------------------------------------------- event fds

    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # ------------------------------------------------------------- tasks

    def _task(self, run: Callable[[], Any], results: dict[L2TaskId, Any], efd: Any, failed: Callable[[], Any]) -> L2TaskId:
        with self._lock:
            task_id = self._next
            self._next += 1

        def work() -> None:
            try:
                result = run()
            except Exception:
                logger.exception("L2 task %d failed", task_id)
                result = failed()
            with self._lock:
                results[task_id] = result
            efd.notify()

        self._io.submit(work)
        return task_id

    def _runs(self, objects: Sequence[MemoryObj]) -> tuple[list[int], list[int]]:
        """Each object's first slot and slot count in the L1 arena (raises for an object outside it)."""
        starts, lengths = [], []
        for obj in objects:
            offset = int(obj.data_ptr) - self.region.base
            slots = -(-int(obj.get_physical_size()) // self.unit)
            if offset < 0 or offset % self.unit or offset // self.unit + slots > self.region.slots:
                raise ValueError(f"memory object at offset {offset} is not an aligned run of the L1 arena")
            starts.append(offset // self.unit)
            lengths.append(slots)
        return starts, lengths

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        def run() -> L2StoreResult:
            starts, lengths = self._runs(objects)
            done = self.region.save([object_hash(k) for k in keys], starts, lengths, self.option).success
            if done:
                self._notify_keys_stored(list(keys[:done]), [int(o.get_size()) for o in objects[:done]])
            return L2StoreResult(done == len(keys), sum(int(o.get_size()) for o in objects[:done]))

        return self._task(run, self._stores, self._store_efd, lambda: L2StoreResult(False, 0))

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]) -> L2TaskId:
        def run() -> Bitmap:
            held = self.region.exists([object_hash(k) for k in keys], self.lookup_option, lease_ms=self.settings.lease_ms)
            return _prefix_bits(len(keys), held)

        return self._task(run, self._lookups, self._lookup_efd, lambda: Bitmap(len(keys)))

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        return  # a lease ends by itself (and at the load's read): nothing can fail here

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        def run() -> Bitmap:
            starts, lengths = self._runs(objects)
            done = self.region.load([object_hash(k) for k in keys], starts, lengths, self.option).success
            if done:
                self._notify_keys_accessed(list(keys[:done]))
            return _prefix_bits(len(keys), done)

        return self._task(run, self._loads, self._load_efd, lambda: Bitmap(len(keys)))

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loads.pop(task_id, None)

    def close(self) -> None:
        self._io.shutdown(wait=True)
        close_client(self._cc)
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()

    def report_status(self) -> dict:
        return {"is_healthy": True, "type": "EmsL2Adapter", "slot_bytes": self.unit}


def _prefix_bits(n: int, hits: int) -> Bitmap:
    bits = Bitmap(n)
    if hits:
        bits.set_range(0, hits)
    return bits

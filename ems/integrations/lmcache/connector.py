"""`EmsRemoteConnector`: the pool as an LMCache remote storage plugin.

Contract (LMCache 0.5.6, `lmcache/v1/storage_backend/connector/base_connector.RemoteConnector`; loaded by LMCache's
own plugin loading from `remote_storage_plugins: [NAME]` and `extra_config`
`remote_storage_plugin.NAME.module_path: ems.integrations.lmcache`, `...class_name: EmsRemoteConnector`):

* Construction: LMCache builds the class as `cls(loop=, local_cpu_backend=, config=)`, without metadata or its
  plugin name: the metadata is `local_cpu_backend.metadata` (as LMCache's fs connector takes it), the name is the one
  entry of `remote_storage_plugins` whose `module_path`/`class_name` name this class. Its settings are the other
  `remote_storage_plugin.NAME.<key>` entries: the pool keys of `connector_config.PLUGIN_KEYS` and `io_threads`; an unknown
  key or a bad value raises LMCache's `IrrecoverableException` naming `extra_config.remote_storage_plugin.NAME.<key>`
  (LMCache then creates no backend for the plugin and logs the message).
* Memory: LMCache's memory objects live in its local CPU backend's allocator buffer. That buffer is registered once
  as a host region (`host_region.HostRegion`) of `unit`-byte slots (the largest size that divides both the
  allocator's alignment, 4 KiB unless `local_cpu.pinned_align_bytes` says otherwise, and a full chunk), so a put
  gathers an object's bytes from where LMCache holds them, and a get allocates an object from the local CPU backend
  and fills it in place, one SDK call per call (batched forms: per batch), by the package's copy path. The slot size
  is part of the registered layout, so of the namespace: instances share values when their alignments agree. Objects
  that are not a full chunk (`save_unfull_chunk`), or lie outside the registered buffer, are not stored (a later get
  of their key misses).
* Keys: a `CacheEngineKey` is a V1 hash by `host_region.chunk_hash` of its text (`model@world_size@worker_id@hash@
  dtype`, so TP ranks never meet), in a namespace of the model name and the chunk's shape, dtype and format. Chunk
  keys carry no chain position: values are placed per key.
* Results: `exists`/`exists_sync` return a bool; `batched_contains` / `batched_async_contains` the count of
  consecutive hits (one pool request per batch); `get` an object or None; `batched_get` / `batched_get_non_blocking`
  the hit prefix (the rest None, resp. left out, their objects freed). A failing pool is a miss (`False`, 0, None)
  within `timeout_ms`; a put that the pool did not take raises, so LMCache counts it as a failed put (LMCache 0.5.6
  reads the outcome of its single form only: a batch the pool did not take is logged here as a warning, since LMCache
  drops a batched put's exception unseen). The blocking
  SDK calls run on the connector's own threads (`io_threads`), never on LMCache's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from ems import CcKvOption
from ems.integrations.connector_config import PLUGIN_KEYS, derive_model_id
from ems.integrations.host_region import HostRegion, chunk_hash, close_client, open_client, plugin_config

logger = logging.getLogger("ems.integrations.lmcache")

LOADER_KEYS = ("module_path", "class_name")  # LMCache's own, read by its loader
OWN_KEYS = ("io_threads",)
DEFAULT_IO_THREADS = 2
# LMCache's AddressManager.ALIGN_BYTES: every object starts at a multiple of it (`local_cpu.pinned_align_bytes` in
# extra_config sets another power of two: the chunk's size makes every chunk one slot, one copy a value)
ALLOCATOR_ALIGN = 4096
_T = TypeVar("_T")


def plugin_name_of(config: LMCacheEngineConfig | None, cls: type) -> str:
    """The `remote_storage_plugins` entry that names `cls` (LMCache does not pass it)."""
    extra = (config.extra_config if config is not None else None) or {}
    names = list((config.remote_storage_plugins if config is not None else None) or [])
    module = cls.__module__.rsplit(".", 1)[0]  # the package users name (`ems.integrations.lmcache`)
    for name in names:
        path = extra.get(f"remote_storage_plugin.{name}.module_path")
        if path in (module, cls.__module__) and extra.get(f"remote_storage_plugin.{name}.class_name") == cls.__name__:
            return str(name)
    raise IrrecoverableException(
        f"remote_storage_plugins {names}: none has extra_config remote_storage_plugin.<name>.module_path = {module!r} "
        f"and class_name = {cls.__name__!r}"
    )


class EmsRemoteConnector(RemoteConnector):
    """LMCache's remote storage plugin over the pool (see the module contract)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, local_cpu_backend: LocalCPUBackend, config: LMCacheEngineConfig | None
    ) -> None:
        metadata = local_cpu_backend.metadata
        super().__init__(local_cpu_backend.config, metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.name = plugin_name_of(config or local_cpu_backend.config, type(self))
        where = f"extra_config.remote_storage_plugin.{self.name}"
        extra = (config or local_cpu_backend.config).extra_config or {}
        prefix = f"remote_storage_plugin.{self.name}."
        settings = {k[len(prefix) :]: v for k, v in extra.items() if k.startswith(prefix) and k[len(prefix) :] not in LOADER_KEYS}
        threads = settings.pop("io_threads", DEFAULT_IO_THREADS)
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
            raise IrrecoverableException(f"{where}.io_threads must be an int in 1..64, got {threads!r}")
        try:
            self.settings = plugin_config(where, settings, PLUGIN_KEYS)
        except ValueError as exc:
            raise IrrecoverableException(str(exc)) from None
        self.option = CcKvOption(write_rcache=False, timeout=self.settings.timeout_ms)  # LMCache keeps its own CPU copy
        self.lookup_option = CcKvOption(timeout=self.settings.lookup_timeout_ms)
        self.chunk_bytes = int(self.full_chunk_size_bytes)
        align = ((config or local_cpu_backend.config).extra_config or {}).get("local_cpu.pinned_align_bytes") or ALLOCATOR_ALIGN
        self.unit = math.gcd(self.chunk_bytes, int(align))  # a whole chunk, where LMCache aligns objects to its size
        self.slots_per_chunk = self.chunk_bytes // self.unit
        parts = {
            "engine": "lmcache",
            "shapes": str([tuple(s) for s in self.meta_shapes]),
            "dtypes": str(self.meta_dtypes),
            "format": str(self.meta_fmt),
            "chunk_size": str(metadata.chunk_size),
        }
        model_id = self.settings.model_id or derive_model_id(str(metadata.model_name), parts)
        buffer = self._allocator_buffer()
        self._cc = open_client(self.settings, model_id, "MLA" if metadata.use_mla else "MHA")
        try:
            self.region = HostRegion(self._cc, buffer, self.unit, self.slots_per_chunk)
        except BaseException:
            close_client(self._cc)
            raise
        self._io = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"ems-lmcache-{self.name}")
        logger.info("LMCache plugin %r: %d-byte chunks over the pool (%s)", self.name, self.chunk_bytes, model_id)

    def _allocator_buffer(self) -> torch.Tensor:
        """The local CPU backend's allocator buffer as one uint8 tensor (read from an object it allocates)."""
        probe = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
        if probe is None:
            raise IrrecoverableException("LMCache's local CPU backend could not allocate one chunk (max_local_cpu_size)")
        try:
            storage = probe.raw_data.untyped_storage()
            return torch.empty(0, dtype=torch.uint8).set_(storage)
        finally:
            probe.ref_count_down()

    # ------------------------------------------------------------- objects ↔ slots

    def _slot(self, obj: MemoryObj) -> int | None:
        """The first slot of a full-chunk object in the registered buffer, else None."""
        offset = int(obj.data_ptr) - self.region.base
        if obj.get_size() != self.chunk_bytes or offset < 0 or offset % self.unit:
            return None
        start = offset // self.unit
        return start if start + self.slots_per_chunk <= self.region.slots else None

    def _put_all(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> None:
        hashes, starts = [], []
        for key, obj in zip(keys, objs):
            start = self._slot(obj)
            if start is None:
                logger.debug("not storing %s: not a full chunk in LMCache's local CPU buffer", key)
                continue
            hashes.append(chunk_hash(key.to_string()))
            starts.append(start)
        done = self.region.save(hashes, starts, self.slots_per_chunk, self.option).success
        if done < len(hashes):
            raise RuntimeError(f"the pool stored {done} of {len(hashes)} chunks")

    def _get_prefix(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj]:
        """Objects filled from the pool for `keys`, from the first to the first miss (the rest freed)."""
        objs: list[MemoryObj] = []
        try:
            # one allocation for the batch; where the local CPU backend is full, as many as it has (never its busy
            # wait for space: a get that cannot be placed is a miss)
            batch = self.local_cpu_backend.batched_allocate(
                self.meta_shapes, self.meta_dtypes, len(keys), self.meta_fmt, busy_loop=False
            )
            objs = list(batch or [])
            while not batch and len(objs) < len(keys):
                obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt, busy_loop=False)
                if obj is None:
                    break
                objs.append(obj)
            starts = [self._slot(o) for o in objs]
            usable = next((i for i, s in enumerate(starts) if s is None), len(objs))
            hashes = [chunk_hash(k.to_string()) for k in keys[:usable]]
            hit = self.region.load(
                hashes, [int(s) for s in starts[:usable] if s is not None], self.slots_per_chunk, self.option
            ).success
        except BaseException:
            for obj in objs:
                obj.ref_count_down()
            raise
        for obj in objs[hit:]:
            obj.ref_count_down()
        return objs[:hit]

    def _count(self, keys: Sequence[CacheEngineKey], lease: bool = False) -> int:
        hashes = [chunk_hash(k.to_string()) for k in keys]
        return self.region.exists(hashes, self.lookup_option, lease_ms=self.settings.lease_ms if lease else 0)

    async def _off_loop(self, call: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._io, call)

    # ------------------------------------------------------------- RemoteConnector

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._off_loop(lambda: self._count([key]) == 1)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._count([key]) == 1

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        objs = await self._off_loop(lambda: self._get_prefix([key]))
        return objs[0] if objs else None

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self._off_loop(lambda: self._put_all([key], [memory_obj]))

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        objs = await self._off_loop(lambda: self._get_prefix(keys))
        return [*objs, *([None] * (len(keys) - len(objs)))]

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        try:
            await self._off_loop(lambda: self._put_all(keys, memory_objs))
        except Exception as exc:
            logger.warning("LMCache plugin %r: a batched put of %d chunks failed: %s", self.name, len(keys), exc)
            raise

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return self._count(keys)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        return await self._off_loop(lambda: self._count(keys, lease=True))

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey]) -> list[MemoryObj]:
        return await self._off_loop(lambda: self._get_prefix(keys))

    async def list(self) -> list[str]:
        return []  # the pool does not enumerate a namespace's keys

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return False  # values leave the pool by eviction only

    async def close(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Wait for the connector's calls and close its pool client (also what `close` does)."""
        self._io.shutdown(wait=True)
        close_client(self._cc)

    def __repr__(self) -> str:
        return f"<EmsRemoteConnector {self.name}>"

"""`EmsHiCacheStorage`: SGLang's HiCache storage backend (`HiCacheStorage`) over this package's pool.

Contract. SGLang's `StorageBackendFactory` builds it for `--hicache-storage-backend dynamic` as
`EmsHiCacheStorage(storage_config, kwargs)`; the extra config is read and checked there (`config.HiCacheConfig`:
a bad key raises, naming it, and the server does not start) and the process's SDK client is initialised
(`Ems.init` with this rank's `namespace.storage_identity`; a pool that does not answer yet is asked again, at most
every `RETRY_INIT_S`, while every call misses). `register_mem_pool_host(host)` registers the host pool's memory with
`ContextCaching.register_kvcache` (`host_layout.host_planes`: views, no copy). Then:

* `batch_set_v1(keys, host_indices, extra_info)` / `batch_get_v1(...)`: one V1 `save` / `load` per call
  (`slot_mapping=host_indices`, `hashes` = the keys as ints, `offsets=[page_size] * n`): the package's copy path
  gathers every page's layers into the pool's values and scatters them back; `[True] * k + [False] * (n - k)` where
  `k` is the pool's consecutive successes.
* `get_stats()`: SGLang's `StorageMetrics` (pages and GB/s of each v1 call) with `enable_storage_metrics`, else None.
* `batch_exists(keys, extra_info)`: one `exists` per call, with `lease_ms` (the config's), so the pool keeps what it
  reported for the get that follows; the count of consecutive hits from the first key.
* the legacy calls (`get`, `batch_get`, `set`, `batch_set`, `exists`), used by SGLang when `interface_v1` is off:
  one V0 `save` / `load` per call of the flat page tensors SGLang hands over (`KvBufferWrapper` over each), under keys
  that name the host layout (a flat page's byte order is the layout's).

Keys: SGLang's page keys are strings (hex digests); `page_hash` maps each to an int deterministically (hex of at
most 64 digits: its value; anything else: a 256-bit BLAKE2b digest). `chain_prefix` (the locality placement) is
passed from `extra_info.prefix_keys` in one place, `_chain_kwargs` (SGLang sends them with
`hicache_storage_pass_prefix_keys`; a server without them places each page by its key: the two never meet).

Hybrid models (SGLang's v2, `ems.integrations.sglang.hybrid`): `register_mem_host_pool_v2(pool, name)` gives each
side pool (Mamba state, SWA, draft pools) a client of its own with the pool's name in its namespace
(`namespace.pool_model_id`), its memory registered without a copy (`host_layout.pool_view`); the KV pool, which
SGLang registers there too, stays the v1 calls'. `batch_set_v2` / `batch_get_v2(transfers)`: one V1 save / load per
transfer (a transfer naming the KV pool goes through the v1 path), `{name: [True] * k + [False] * (n - k)}`;
`batch_exists_v2(keys, transfers)`: the KV prefix (`batch_exists`), then one leased `exists` per side pool, folded by
each transfer's hit policy (`hybrid.fold_hits`): a prefix counts only where every pool can restore it. A pool this
backend cannot view (QSA indexers, DeepSeek V4's compressed pools) is logged at registration and misses, so a
prefix that needs it is not a hit. `close()` (SGLang's detach) closes the side pools' clients.

Failure semantics: no call raises into SGLang's threads and none returns None: a pool failure, a timeout (each
request's `timeout_ms`), an unregistered host pool or an SDK that is not up yet is a miss (`False`, `0`), logged at
most once per `LOG_EVERY_S`. One backend per process registers at a time: a backend whose registration another one
replaced in this process (SGLang's detach and attach) misses from then on instead of moving another pool's memory.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from ems import CcKvOption, ContextCaching, Ems, EmsConfig, EmsErrorCode, EmsException, KvBufferWrapper
from ems.integrations.sglang.config import HiCacheConfig
from ems.integrations.sglang.host_layout import UnsupportedLayout, host_planes
from ems.integrations.sglang.hybrid import KV_POOL, SidePool, fold_hits
from ems.integrations.sglang.namespace import pool_model_id, storage_identity

logger = logging.getLogger("ems.sglang")

RETRY_INIT_S = 2.0  # how often a backend whose pool did not answer at start asks again (every call misses meanwhile)
LOG_EVERY_S = 10.0  # a failing pool is logged at most this often per backend
MAX_V0_KEY = 127  # V0 keys are under 128 characters
_HEX = re.compile(r"[0-9a-fA-F]{1,64}")

_registration_lock = threading.Lock()
_registration = itertools.count(1)
_current_registration = 0  # the registration that owns this process's ContextCaching layout


def page_hash(key: str) -> int:
    """SGLang's page key as the int the SDK's V1 forms take (see the module contract)."""
    if _HEX.fullmatch(key):
        return int(key, 16)
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=32).digest(), "little")


class EmsHiCacheStorage(HiCacheStorage):
    """See the module contract."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.config = HiCacheConfig.from_extra(storage_config.extra_config)
        self.storage_config = storage_config
        pool = self.config.pool.resolve_pool()
        cc_config = storage_identity(storage_config, self.config.pool.model_id)
        settings = dict(self.config.pool.ems_settings)
        if pool.nodes:
            settings["pool_nodes"] = list(pool.nodes)
        self.ems_config = EmsConfig(access_id=pool.access_id, access_key=pool.access_key, cc_config_v1=cc_config, **settings)
        self.option = CcKvOption(timeout=self.config.timeout_ms)
        self.mem_pool_host: Any = None
        self.page_size = 0
        self._cc: ContextCaching | None = None
        self._registration = 0
        self._lock = threading.Lock()
        self._next_init = 0.0
        self._last_log = 0.0
        self._v0_prefix = "sglang"
        self._page_bytes = 0
        # SGLang's storage metrics (`--enable-storage-metrics`): pages and GB/s of each v1 get (prefetch) and set
        self._metrics_on = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._metrics_lock = threading.Lock()
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }
        self._side_pools: dict[str, SidePool] = {}  # v2: a hybrid model's side pools by name
        self._client()  # at start: a bad config raises here; an unreachable pool is asked again later

    # ---------------------------------------------------------------- set-up

    def _client(self) -> ContextCaching | None:
        """The SDK client: initialised now if it is not yet (at most every RETRY_INIT_S), else None."""
        if self._cc is not None:
            return self._cc
        with self._lock:
            if self._cc is None and time.monotonic() >= self._next_init:
                try:
                    Ems.init(self.ems_config)
                    self._cc = Ems.get_cc()
                except EmsException as exc:
                    if exc.status_code() != EmsErrorCode.EMS_RECOVERD_ERROR:
                        raise
                    self._next_init = time.monotonic() + RETRY_INIT_S
                    self._log("the pool does not answer yet; every call misses until it does: %s", exc.message())
                if self._cc is not None and self.mem_pool_host is not None:
                    self._register(self._cc)
        return self._cc

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Register the host pool's memory (views, no copy): `host_layout.host_planes`."""
        self.mem_pool_host = mem_pool_host
        self.page_size = int(mem_pool_host.page_size)
        self._v0_prefix = f"sglang-{mem_pool_host.layout}"
        planes = host_planes(mem_pool_host)  # an unsupported layout raises here: the attach fails, naming it
        self._planes = planes
        self._page_bytes = sum(t[0].numel() * t.element_size() for pair in planes for t in pair)
        cc = self._client()
        if cc is not None:
            self._register(cc)

    def _register(self, cc: ContextCaching) -> None:
        global _current_registration
        with _registration_lock:
            cc.register_kvcache(self._planes)
            self._registration = _current_registration = next(_registration)

    def _ready(self) -> ContextCaching | None:
        """The client, when this backend's host pool is the one registered in this process."""
        cc = self._client()
        if cc is None or self._registration == 0 or self._registration != _current_registration:
            return None
        return cc

    def _log(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            logger.warning("EmsHiCacheStorage: " + message, *args)

    def _chain_kwargs(self, extra_info: Any) -> dict[str, Any]:
        """The one place where SGLang's prefix keys become the SDK's `chain_prefix` (the hashes of the pages before
        the call's first key, from the chain's first page)."""
        prefix = getattr(extra_info, "prefix_keys", None)
        if prefix is None:  # (SGLang passes them with `hicache_storage_pass_prefix_keys`)
            return {}
        return {"chain_prefix": [page_hash(k) for k in prefix]}

    # ---------------------------------------------------------------- zero-copy v1

    def _v1(self, save: bool, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any) -> list[bool]:
        n = len(keys)
        if n == 0:
            return []
        try:
            cc = self._ready()
            if cc is None:
                return [False] * n
            slots = host_indices if host_indices.dtype == torch.int64 else host_indices.to(torch.int64)
            if slots.device.type != "cpu":
                slots = slots.cpu()
            if slots.numel() != n * self.page_size:
                raise ValueError(f"{slots.numel()} host indices for {n} pages of {self.page_size} tokens")
            hashes = [page_hash(k) for k in keys]
            call = cc.save if save else cc.load
            start = time.perf_counter()
            result = call(slots, hashes, [self.page_size] * n, self.option, **self._chain_kwargs(extra_info))
            done = int(result.success)
            if self._metrics_on:
                self._record("backup" if save else "prefetch", n, time.perf_counter() - start)
        except Exception as exc:  # a failure is a miss, never an exception in SGLang's threads
            self._log("%s of %d pages failed (counted as misses): %s", "set" if save else "get", n, exc)
            done = 0
        return [True] * done + [False] * (n - done)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        return self._v1(True, keys, host_indices, extra_info)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        return self._v1(False, keys, host_indices, extra_info)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of `keys`, from the first, the pool holds (and leases for `lease_ms`)."""
        if not keys:
            return 0
        try:
            if not self.config.interface_v1:
                return self._v0_exists(keys)
            cc = self._ready()
            if cc is None:
                return 0
            lease = {"lease_ms": self.config.lease_ms} if self.config.lease_ms > 0 else {}
            hashes = [page_hash(k) for k in keys]
            return int(cc.exists(hashes, self.option, **lease, **self._chain_kwargs(extra_info)).success)
        except Exception as exc:
            self._log("exists of %d pages failed (counted as misses): %s", len(keys), exc)
            return 0

    # ---------------------------------------------------------------- legacy (flat page tensors)

    def _v0_key(self, key: str) -> str:
        text = f"{self._v0_prefix}:{key}"
        if len(text) > MAX_V0_KEY:
            text = f"{self._v0_prefix}:#{hashlib.blake2b(key.encode('utf-8', 'surrogatepass'), digest_size=32).hexdigest()}"
        return text

    def _v0_exists(self, keys: Sequence[str]) -> int:
        cc = self._ready()
        if cc is None:
            return 0
        lease = {"lease_ms": self.config.lease_ms} if self.config.lease_ms > 0 else {}
        return int(cc.exists([self._v0_key(k) for k in keys], self.option, **lease).success)

    def _flat_target(self, target: Any) -> torch.Tensor:
        if isinstance(target, torch.Tensor):
            return target
        return self.mem_pool_host.get_dummy_flat_data_page()  # type: ignore[no-any-return]

    def _v0_move(self, save: bool, keys: Sequence[str], tensors: Sequence[torch.Tensor]) -> int:
        """One V0 save or load of contiguous CPU tensors; the count of consecutive successes (0 on failure)."""
        if not keys:
            return 0
        try:
            cc = self._ready()
            if cc is None:
                return 0
            for t in tensors:
                if not t.is_contiguous() or t.device.type != "cpu" or t.numel() == 0:
                    raise ValueError(
                        f"a page tensor must be a non-empty contiguous CPU tensor, got {tuple(t.shape)} on {t.device}"
                    )
            values = [[KvBufferWrapper(t.data_ptr(), t.numel() * t.element_size())] for t in tensors]
            call = cc.save if save else cc.load
            return int(call(self.option, [self._v0_key(k) for k in keys], values).success)
        except Exception as exc:
            self._log("%s of %d pages failed (counted as misses): %s", "set" if save else "get", len(keys), exc)
            return 0

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        result = self.batch_get([key], [target_location] if target_location is not None else None)
        return result[0] if isinstance(result, list) else None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[torch.Tensor | None]:
        try:
            targets = [self._flat_target(t) for t in (target_locations or [None] * len(keys))]
        except Exception as exc:
            self._log("get of %d pages failed (counted as misses): %s", len(keys), exc)
            return [None] * len(keys)
        done = self._v0_move(False, keys, targets)
        return [t if i < done else None for i, t in enumerate(targets)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        if values is None or len(values) != len(keys):
            return False
        flat = [v.reshape(-1) if isinstance(v, torch.Tensor) and v.is_contiguous() else v for v in values]
        if not all(isinstance(v, torch.Tensor) for v in flat):
            return False
        return self._v0_move(True, keys, [v if v.is_contiguous() else v.contiguous() for v in flat]) == len(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---------------------------------------------------------------- v2 (hybrid models' side pools)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A hybrid model's host pool (`hybrid.SidePool`: a client of its own, keys of its own). The KV pool (SGLang
        registers its anchor here too) is the v1 calls'; a pool that cannot be viewed is logged and misses."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == KV_POOL:
            return
        with self._lock:
            old = self._side_pools.pop(name, None)
        if old is not None:  # (SGLang registers a dynamic side pool again under its name)
            old.close()
        model_id = pool_model_id(self.storage_config, self.config.pool.model_id, name)
        try:
            side = SidePool.open(name, host_pool, self.config.pool, model_id)
        except UnsupportedLayout as exc:
            logger.warning("EmsHiCacheStorage: side pool %r is not stored (%s): its pages always miss", name, exc)
            return
        with self._lock:
            self._side_pools[name] = side

    def _side(self, name: Any) -> SidePool | None:
        return self._side_pools.get(str(name))

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """SGLang's longest prefix every pool can restore (`hybrid.fold_hits`): the KV prefix by `batch_exists`,
        then one `exists` per side pool, leased like the KV pages."""
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult

        try:
            kv_pages = self.batch_exists(keys, extra_info) if keys else 0
            hashes = [page_hash(k) for k in keys[:kv_pages]]
            lease = self.config.lease_ms

            def probe(transfer: Any, reverse: bool) -> int:
                side = self._side(transfer.name)
                if side is None:
                    return 0
                return side.count(hashes[::-1] if reverse else hashes, self.option, lease)

            hits = fold_hits(kv_pages, list(pool_transfers or ()), probe)
            pool_pages = {PoolName.KV: kv_pages} if kv_pages else {}
            pool_pages.update(hits.pool_pages)
            return PoolTransferResult(hits.final_pages, pool_pages, hits.restorable)
        except Exception as exc:  # a failure is a miss, never an exception in SGLang's threads
            self._log(
                "exists of %d pages over %d pools failed (counted as misses): %s", len(keys), len(pool_transfers or ()), exc
            )
            return PoolTransferResult(0, {}, [])

    def _v2(self, save: bool, transfers: Any, extra_info: Any) -> dict[Any, list[bool]]:
        results: dict[Any, list[bool]] = {}
        for transfer in transfers or ():
            keys = list(transfer.keys or ())
            n = len(keys)
            if str(transfer.name) == KV_POOL:  # the KV pool itself: the v1 calls
                results[transfer.name] = self._v1(save, keys, transfer.host_indices, extra_info) if n else []
                continue
            done = 0
            try:
                side = self._side(transfer.name)
                if n and side is not None and self._ready() is not None:
                    if transfer.host_indices is None:
                        raise ValueError(f"{transfer.name}: no host indices for {n} pages")
                    done = side.move(save, [page_hash(k) for k in keys], transfer.host_indices, self.option)
            except Exception as exc:  # a failure is a miss, never an exception in SGLang's threads
                self._log("%s of %d %s pages failed (counted as misses): %s", "set" if save else "get", n, transfer.name, exc)
                done = 0
            results[transfer.name] = [True] * done + [False] * (n - done)
        return results

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Each side pool's pages from the pool into its host pool: one load per transfer (`hybrid.SidePool.move`)."""
        return self._v2(False, transfers, extra_info)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Each side pool's pages from its host pool into the pool: one save per transfer."""
        return self._v2(True, transfers, extra_info)

    def close(self) -> None:
        """SGLang's detach: the side pools' clients are closed (the KV pool's is the process's, `Ems`)."""
        with self._lock:
            sides, self._side_pools = list(self._side_pools.values()), {}
        for side in sides:
            side.close()

    def clear(self) -> None:
        """SGLang's "clear the storage": the pool is shared with other servers, so nothing is deleted here."""

    def _record(self, kind: str, pages: int, seconds: float) -> None:
        with self._metrics_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(pages * self._page_bytes / max(seconds, 1e-9) / 1e9)

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics` of the v1 calls since the last call (None without `enable_storage_metrics`);
        the SDK's own counters are `ContextCaching.metrics()`."""
        if not self._metrics_on:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        with self._metrics_lock:
            for name, values in self._metrics.items():
                getattr(metrics, name).extend(values)
                values.clear()
        return metrics

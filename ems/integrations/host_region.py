"""Engine plug-ins' host memory moved through the public SDK: one registered region, its own client, keyed per chunk.

Contract (no engine imports; used by `ems.integrations.vllm_tier` and `ems.integrations.lmcache`):

* `plugin_config(where, extra, allowed)` reads a plug-in's keys with the connector's own parser
  (`connector_config.ConnectorConfig.from_extra`): a key outside `allowed` (the pool keys `PLUGIN_KEYS` plus the
  plug-in's own, which the caller removed first) or a bad value raises `ValueError` naming `where.<key>`, as engines
  report their own configuration errors.
* `open_client(config, model_id)` builds one `ContextCaching` (the SDK's client class) over its own pool connection,
  as `Ems.init` does but not process-wide: an engine process may hold several plug-in instances (and tests run two
  "engines" in one process), each with its own registered memory. A pool that does not answer yet is no error: every
  call then misses until it does.
* `HostRegion(cc, memory, unit, slots_per_value)` registers `memory` (a 1-D `uint8` CPU tensor: vLLM's primary tier,
  LMCache's allocator buffer) as a cache of `memory.numel() // unit` slots of `unit` bytes, in one layer group whose
  values hold up to `slots_per_value` slots, and moves values between the region and the pool with the V1
  slot_mapping form (`save`, `load`, `exists`): a value is a run of whole slots `(start, length)`, its slots built
  with numpy and copied by the package's copy path in one call per request (no Python loop per chunk's bytes).
  Each call is bounded by the client's timeout and reports the consecutive successes from the first (`CcResult`),
  never raises for a failing pool (`EmsException`s of the pool become 0 successes; bad arguments raise).
* `chunk_hash(key)` maps an engine's key to a V1 hash deterministically in every process: an `int` in the V1 range
  stays itself, bytes (or text) are a 256-bit blake2b digest. The engines these plug-ins serve give no chain
  position with their keys (vLLM's offloading keys, LMCache's chunk keys), so values are placed per key (no
  `chain_prefix`: the V1 form's per-block placement).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ems import CcKvOption, CcResult, ContextCaching, EmsException, StoreLayerGroupDesc
from ems.client.api import connect_pool
from ems.config import check_config
from ems.integrations import kv_layouts
from ems.integrations.connector_config import PLUGIN_KEYS, ConnectorConfig
from ems.settings import resolve_settings

logger = logging.getLogger("ems.integrations")

_V1_MAX = 2**256 - 1
_CONNECTOR_PREFIX = "kv_connector_extra_config"


def plugin_config(where: str, extra: Mapping[str, Any], allowed: Sequence[str] = PLUGIN_KEYS) -> ConnectorConfig:
    """The pool settings of a plug-in's configuration `extra` (see the module contract); errors name `where.<key>`."""
    unknown = sorted(set(extra) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(allowed)}")
    try:
        return ConnectorConfig.from_extra(dict(extra))
    except EmsException as exc:
        raise ValueError(exc.message().replace(_CONNECTOR_PREFIX, where)) from None


def open_client(config: ConnectorConfig, model_id: str, kvcache_type: str = "MHA") -> ContextCaching:
    """A `ContextCaching` of its own over the pool `config` names (the host's local node when it names none)."""
    pool_where = config.resolve_pool()
    ems_config = check_config(config.ems_config(model_id, kvcache_type, pool_where))
    settings = resolve_settings(ems_config)
    pool = connect_pool(ems_config, settings)
    cc_config = ems_config.context_caching_config
    if cc_config is None:  # (ems_config always carries one)
        pool.close()
        raise ValueError("no context caching config")
    try:
        cc = ContextCaching(cc_config, ems_config.access_id, pool, settings)
    except BaseException:
        pool.close()
        raise
    if not settings.embedded and not pool.healthy(settings.connect_timeout_ms / 1000.0):
        logger.warning("pool %s does not answer yet: every call misses until it does", pool.describe())
    return cc


def close_client(cc: ContextCaching) -> None:
    """Finish `cc`'s calls and close its pool connection (what `open_client` opened)."""
    cc.close()
    cc._pool.close()


def chunk_hash(key: object) -> int:
    """A V1 hash of an engine key (see the module contract)."""
    if isinstance(key, int) and not isinstance(key, bool) and 0 <= key <= _V1_MAX:
        return key
    if isinstance(key, str):
        key = key.encode("utf-8")
    if isinstance(key, (bytes, bytearray, memoryview)):
        return int.from_bytes(hashlib.blake2b(bytes(key), digest_size=32).digest(), "little")
    raise TypeError(f"cannot key a chunk by {type(key).__name__}")


class HostRegion:
    """A registered host memory region moved value by value through one client (see the module contract)."""

    def __init__(self, cc: ContextCaching, memory: torch.Tensor, unit: int, slots_per_value: int = 1) -> None:
        if memory.dtype != torch.uint8 or memory.dim() != 1 or memory.device.type != "cpu":
            raise ValueError(f"memory must be a 1-D uint8 CPU tensor, got {memory.dtype} {tuple(memory.shape)}")
        if unit <= 0 or unit % 2 or memory.numel() < unit:
            raise ValueError(f"unit must be an even number of bytes within the region, got {unit}")
        self.cc = cc
        self.unit = unit
        self.slots = memory.numel() // unit
        self.base = int(memory.data_ptr())
        self.memory = memory
        planes = kv_layouts.block_planes(memory[: self.slots * unit].view(self.slots, unit), self.slots)
        cc.register_kvcache([list(planes)], [StoreLayerGroupDesc(store_block_size=slots_per_value, layer_ids=[0])])

    @staticmethod
    def _slots(starts: Sequence[int], lengths: Sequence[int] | int) -> tuple[np.ndarray, np.ndarray]:
        """(slot_mapping, offsets) of values that are runs `starts[i] .. + lengths[i]`: the slot_mapping form, whose
        plan is the fast one (measured: the chunk_descs form of the same runs costs ~5x more per call)."""
        first = np.asarray(starts, dtype=np.int64)
        runs = np.full(len(first), lengths, dtype=np.int64) if isinstance(lengths, int) else np.asarray(lengths, np.int64)
        if isinstance(lengths, int) and lengths == 1:
            return first, runs
        ends = np.cumsum(runs)
        within = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - runs, runs)
        return np.repeat(first, runs) + within, runs

    def save(
        self,
        hashes: Sequence[int],
        starts: Sequence[int],
        lengths: Sequence[int] | int,
        option: CcKvOption,
    ) -> CcResult:
        """Store value `i` = slots `starts[i] .. + lengths[i]` under `hashes[i]`; the consecutive successes."""
        return self._move(self.cc.save, "save", hashes, starts, lengths, option)

    def load(
        self,
        hashes: Sequence[int],
        starts: Sequence[int],
        lengths: Sequence[int] | int,
        option: CcKvOption,
    ) -> CcResult:
        """Fill slots `starts[i] .. + lengths[i]` with the value of `hashes[i]`, from the first to the first miss."""
        return self._move(self.cc.load, "load", hashes, starts, lengths, option)

    def _move(
        self,
        call: Callable[..., CcResult],
        what: str,
        hashes: Sequence[int],
        starts: Sequence[int],
        lengths: Sequence[int] | int,
        option: CcKvOption,
    ) -> CcResult:
        """One save or load (`call`, the public API's) of whole runs; a pool failure is no success (logged), bad
        input raises."""
        if not hashes:
            return CcResult(0, 0)
        try:
            slots, runs = self._slots(starts, lengths)
            return call(slots.tolist(), list(hashes), runs.tolist(), option)
        except EmsException as exc:
            if exc.status_code().name == "EMS_INVALID_ARGUMENT":
                raise
            logger.warning("%s of %d values failed: %s", what, len(hashes), exc.message())
            return CcResult(0, len(hashes))

    def exists(self, hashes: Sequence[int], option: CcKvOption, lease_ms: int = 0) -> int:
        """How many of `hashes`, from the first, the pool holds (leased for `lease_ms` for the load that follows)."""
        if not hashes:
            return 0
        kwargs: dict[str, Any] = {"lease_ms": lease_ms} if lease_ms else {}
        return int(self.cc.exists(list(hashes), option, **kwargs).success)

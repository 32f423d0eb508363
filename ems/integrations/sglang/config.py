"""The keys of SGLang's `--hicache-storage-backend-extra-config` that `EmsHiCacheStorage` reads, checked.

Contract (no SGLang imports): `HiCacheConfig.from_extra(extra)` accepts SGLang's own keys (`backend_name`,
`module_path`, `class_name`, `interface_v1`, read by SGLang's `StorageBackendFactory` and cache controller, and the
controller's other keys in `SGLANG_KEYS`: read there, ignored here) and the pool keys below, which are the vLLM
connector's (`ems.integrations.connector_config.ConnectorConfig.from_extra` parses them: one parser for every engine);
anything else, or a bad value, raises `EmsException(EMS_INVALID_ARGUMENT)` whose message names the key as
`hicache_storage_backend_extra_config.<key>`.

| key | default | meaning |
|---|---|---|
| pool_nodes, local_pool, local_pool_dir, local_pool_capacity | as the vLLM connector | where the pool is |
| access_id, access_key | none | tenant credentials (`EMS_ACCESS_KEY` may hold the key) |
| model_id | derived (`namespace.storage_identity`) | the key namespace: servers that share pages must agree |
| timeout_ms | 5000 | `CcKvOption.timeout` of every exists, get and set |
| lease_ms | 10000 | how long the pool keeps the pages an exists reported, for the get that follows (0: no lease) |
| every other `EmsConfig` pool setting (pool_capacity, pool_replicas, ...) | as `EmsConfig` | docs/reference/configuration.md |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ems.errors import EmsException, invalid_argument
from ems.integrations.connector_config import PLUGIN_KEYS, ConnectorConfig

WHERE = "hicache_storage_backend_extra_config"
# SGLang's own keys: the dynamic loader's, and those its cache controller and storage manager read from the same dict
SGLANG_KEYS = (
    "backend_name",
    "module_path",
    "class_name",
    "interface_v1",
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
)


@dataclass(frozen=True)
class HiCacheConfig:
    """What `EmsHiCacheStorage` reads from its extra config (see the module contract)."""

    pool: ConnectorConfig  # the pool keys, parsed by the connectors' parser
    interface_v1: bool  # SGLang calls the zero-copy batch_get_v1 / batch_set_v1

    @property
    def timeout_ms(self) -> int:
        return self.pool.timeout_ms

    @property
    def lease_ms(self) -> int:
        return self.pool.lease_ms

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> HiCacheConfig:
        if extra is not None and not isinstance(extra, Mapping):
            raise invalid_argument(f"{WHERE} must be a JSON object, got {type(extra).__name__}")
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(SGLANG_KEYS) - set(PLUGIN_KEYS))
        if unknown:
            raise invalid_argument(f"{WHERE}: unknown keys {unknown}; known: {sorted(PLUGIN_KEYS + SGLANG_KEYS)}")
        interface_v1 = extra.get("interface_v1", False)
        if not isinstance(interface_v1, (bool, int)) or interface_v1 not in (0, 1):
            raise invalid_argument(f"{WHERE}.interface_v1 must be 0/1 or false/true, got {interface_v1!r}")
        try:
            pool = ConnectorConfig.from_extra({k: v for k, v in extra.items() if k in PLUGIN_KEYS})
        except EmsException as exc:  # the parser names vLLM's dict; the key it names is the same here
            raise invalid_argument(exc.message().replace("kv_connector_extra_config", WHERE)) from None
        return cls(pool=pool, interface_v1=bool(interface_v1))

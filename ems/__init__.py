"""EMS Context Caching SDK: save and load LLM KV-cache blocks between accelerators and a memory pool.

    from ems import Ems, EmsConfig, CcConfig
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="llama2-13b")))
    cc = Ems.get_cc()
    cc.register_kvcache(kvcache)          # [layers][K, V] of [blocks, block_size, heads, head_size]
    cc.save(slot_mapping, hashes, offsets)
    cc.load(slot_mapping, hashes, offsets)

The EMS SDK's names and module paths work too (one type under two names or paths): `ContextCache_v1` is
`ContextCaching`, `KVCacheType` is `KvCacheType`, and `ems.cc_v1.cc_config` holds `CcConfig_v1` and `KVCacheType`.
"""

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Where each public name lives. Imported on first use (PEP 562), so that `python -m ems.pool` and other
# torch-free parts (store, transport, config) start without importing torch.
_EXPORTS = {
    "CcConfig": "ems.config",
    "CcConfig_v1": "ems.config",
    "CcFuture": "ems.types",
    "CcKvOption": "ems.types",
    "CcResult": "ems.types",
    "ContextCache_v1": "ems.client.context_caching",
    "ContextCaching": "ems.client.context_caching",
    "Ems": "ems.client.api",
    "EmsConfig": "ems.config",
    "EmsErrorCode": "ems.errors",
    "EmsException": "ems.errors",
    "KvBufferWrapper": "ems.types",
    "KVCacheType": "ems.config",
    "KvCacheType": "ems.config",
    "PrimaryKey": "ems.types",
    "StoreLayerGroupDesc": "ems.types",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from ems.client.api import Ems
    from ems.client.context_caching import ContextCache_v1, ContextCaching
    from ems.config import CcConfig, CcConfig_v1, EmsConfig, KVCacheType, KvCacheType
    from ems.errors import EmsErrorCode, EmsException
    from ems.types import CcFuture, CcKvOption, CcResult, KvBufferWrapper, PrimaryKey, StoreLayerGroupDesc


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ems' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

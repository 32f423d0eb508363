"""EMS Context Caching SDK: save and load LLM KV-cache blocks between accelerators and a memory pool.

    from ems import Ems, EmsConfig, CcConfig
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="llama2-13b")))
    cc = Ems.get_cc()
    cc.register_kvcache(kvcache)          # [layers][K, V] of [blocks, block_size, heads, head_size]
    cc.save(slot_mapping, hashes, offsets)
    cc.load(slot_mapping, hashes, offsets)
"""

from ems.api import Ems
from ems.config import CcConfig, CcConfig_v1, EmsConfig, KvCacheType
from ems.context_caching import ContextCaching
from ems.errors import EmsErrorCode, EmsException
from ems.types import CcFuture, CcKvOption, CcResult, KvBufferWrapper, PrimaryKey, StoreLayerGroupDesc

__version__ = "0.1.0"

__all__ = [
    "CcConfig",
    "CcConfig_v1",
    "CcFuture",
    "CcKvOption",
    "CcResult",
    "ContextCaching",
    "Ems",
    "EmsConfig",
    "EmsErrorCode",
    "EmsException",
    "KvBufferWrapper",
    "KvCacheType",
    "PrimaryKey",
    "StoreLayerGroupDesc",
]

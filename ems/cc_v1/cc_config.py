"""The EMS SDK's `ems.cc_v1.cc_config` module path: `CcConfig_v1` and `KVCacheType` (members GQA, MHA, MLA, MQA).

Thin re-exports of `ems.config` (one type, two paths; torch-free).
"""

from ems.config import CcConfig_v1, KVCacheType, KvCacheType

__all__ = ["CcConfig_v1", "KVCacheType", "KvCacheType"]

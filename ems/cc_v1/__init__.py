"""The EMS SDK's `ems.cc_v1` package path, for engines that import from it.

Thin re-exports, never copies: every name here is this package's own type (`ems.cc_v1.CcConfig_v1 is
ems.CcConfig_v1`). `ContextCache_v1` (which needs torch) is imported on first use, like `ems`'s own names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ems.cc_v1.cc_config import CcConfig_v1, KVCacheType, KvCacheType

__all__ = ["CcConfig_v1", "ContextCache_v1", "KVCacheType", "KvCacheType"]

if TYPE_CHECKING:
    from ems.client.context_caching import ContextCache_v1


def __getattr__(name: str) -> Any:
    if name == "ContextCache_v1":
        from ems.client.context_caching import ContextCache_v1

        return ContextCache_v1
    raise AttributeError(f"module 'ems.cc_v1' has no attribute {name!r}")

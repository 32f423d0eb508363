"""SGLang HiCache storage backend over this package's pool (docs/guides/sglang.md).

`EmsHiCacheStorage` (`ems.integrations.sglang.backend`, which imports SGLang) is what SGLang's
`StorageBackendFactory` loads from `--hicache-storage-backend dynamic` with `"module_path": "ems.integrations.sglang",
"class_name": "EmsHiCacheStorage"`; it is imported on first access, so `ems.integrations.sglang.config`,
`.namespace` and `.host_layout` import without SGLang.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EmsHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "EmsHiCacheStorage":
        from ems.integrations.sglang.backend import EmsHiCacheStorage

        return EmsHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

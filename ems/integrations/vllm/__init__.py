"""vLLM integration: `EmsConnector`, a `KVConnectorBase_V1` (`kv_connector_module_path: "ems.integrations.vllm"`).

Importing `EmsConnector`, `EmsConnectorMetadata` or `EmsConnectorStats` from here imports vllm (install
`ems-kvcache[vllm]`); `import ems` never does, and neither do the connector's halves (`scheduler`, `worker`,
`lookups`, `metadata`), which their tests run without vllm. See docs/guides/vllm.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ems.integrations.vllm.connector import EmsConnector, EmsConnectorStats
    from ems.integrations.vllm.metadata import EmsConnectorMetadata

__all__ = ["EmsConnector", "EmsConnectorMetadata", "EmsConnectorStats"]


def __getattr__(name: str) -> Any:
    """The connector's names, imported (with vllm) when first asked for: vLLM's loader asks for `EmsConnector`."""
    if name in __all__:
        from ems.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""vLLM integration: `EmsConnector`, a `KVConnectorBase_V1` (`kv_connector_module_path: "ems.integrations.vllm"`).

Importing this package imports vllm (install `ems-kvcache[vllm]`); `import ems` never does. See docs/vllm.md.
"""

from ems.integrations.vllm.connector import (
    EmsConnector,
    EmsConnectorMetadata,
    EmsConnectorStats,
)

__all__ = ["EmsConnector", "EmsConnectorMetadata", "EmsConnectorStats"]

"""The pool as an LMCache remote storage plugin: `EmsRemoteConnector` (`connector.py`; docs/guides/lmcache.md).

LMCache's plugin loading imports this module and takes the class its configuration names:
`remote_storage_plugins: ["ems"]`, `extra_config: {"remote_storage_plugin.ems.module_path": "ems.integrations.lmcache",
"remote_storage_plugin.ems.class_name": "EmsRemoteConnector", "remote_storage_plugin.ems.pool_nodes": [...]}`.
Its multi-process mode loads `EmsL2Adapter` (`l2_adapter.py`) from `--l2-adapter '{"type": "plugin", "module_path":
"ems.integrations.lmcache", "class_name": "EmsL2Adapter", "adapter_params": {...}}'`.
"""

from ems.integrations.lmcache.connector import EmsRemoteConnector
from ems.integrations.lmcache.l2_adapter import EmsL2Adapter

__all__ = ["EmsL2Adapter", "EmsRemoteConnector"]

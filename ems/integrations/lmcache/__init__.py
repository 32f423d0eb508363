"""The pool as an LMCache remote storage plugin: `EmsRemoteConnector` (`connector.py`; docs/lmcache.md).

LMCache's plugin loading imports this module and takes the class its configuration names:
`remote_storage_plugins: ["ems"]`, `extra_config: {"remote_storage_plugin.ems.module_path": "ems.integrations.lmcache",
"remote_storage_plugin.ems.class_name": "EmsRemoteConnector", "remote_storage_plugin.ems.pool_nodes": [...]}`.
"""

from ems.integrations.lmcache.connector import EmsRemoteConnector

__all__ = ["EmsRemoteConnector"]

"""`connect(address, ...)`: the `NodeClient` for one configured remote pool node (what the package init calls).

Contract: tries to connect and authenticate within `connect_timeout_ms`, then
* returns the connected `UcxNode` on success;
* raises `TransportError(EMS_IO_ERROR)` at once when the node refuses the credentials (wrong or missing
  access_id/access_key: a configuration error that waiting will not fix; the message says so);
* returns the not-yet-connected node when the node is unreachable or silent: it connects lazily and by itself on
  a later call (after a 0.5 s back-off), so an engine can start while some nodes are down. Its `ping` answers False
  until then, which is what the caller's health check sees.
A malformed address raises `TransportError(EMS_IO_ERROR)`.
"""

from __future__ import annotations

from ems.transport.base import Failure, NodeClient, TransportError
from ems.transport.shm.client import ShmMode
from ems.transport.ucx.client import UcxNode


def connect(
    address: str,
    *,
    access_id: str | None = None,
    access_key: str | None = None,
    connect_timeout_ms: int = 3000,
    shm: ShmMode = ShmMode.AUTO,
) -> NodeClient:
    node = UcxNode(address, access_id=access_id, access_key=access_key, connect_timeout_ms=connect_timeout_ms, shm=shm)
    try:
        node.connect_now(connect_timeout_ms / 1000.0)
    except TransportError:
        if node.last_failure == Failure.REFUSED:
            node.close()
            raise
    return node

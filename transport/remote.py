"""`connect(address, ...)`: the `NodeClient` for one configured remote pool node (what the package init calls).

Contract: returns a connected, authenticated `UcxNode`, or raises `TransportError` within about
`connect_timeout_ms`: EMS_IO_ERROR when the node is unreachable or refuses the credentials (the message says
which), EMS_IO_TIMEOUT when it accepts the connection but does not answer. The returned client reconnects by itself
after later failures (see `transport.ucx`). A caller that prefers to start while a node is down can build
`UcxNode(...)` directly: it connects lazily on its first call.
"""

from __future__ import annotations

from typing import Optional

from ems.transport.base import NodeClient
from ems.transport.ucx import UcxNode


def connect(
    address: str, *, access_id: Optional[str] = None, access_key: Optional[str] = None, connect_timeout_ms: int = 3000
) -> NodeClient:
    node = UcxNode(address, access_id=access_id, access_key=access_key, connect_timeout_ms=connect_timeout_ms)
    try:
        node.connect_now(connect_timeout_ms / 1000.0 + 0.5)
    except BaseException:
        node.close()
        raise
    return node

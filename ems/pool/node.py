"""The pool node assembled: the node's handlers (`ems.pool.handlers`) over its store and limits, served by the wire
layer's session part (`transport.ucx.server.PoolServer`) through the handler protocol (`transport.handler`).

Contract:
* `assemble(store, access_keys, limits, metrics, shm, lookups)` builds the handlers (with their shared-memory service,
  `transport.shm.server`, off unless `shm` enables it; the server's lookup channels, `transport.tcp`, on unless
  `lookups` turns them off), registers the shared-memory and lookup channels' figures and the handlers'
  namespace book (`ems.pool.namespaces`) with `metrics`, and returns the `PoolServer` serving them; limits default
  to `NodeLimits.for_capacity` of the store. Nothing is
  started: `PoolServer.start` listens and starts the handlers, `PoolServer.stop` stops both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ems.pool.budget import NodeLimits
from ems.pool.handlers import NodeHandlers
from ems.pool.node_store import NodeStore

if TYPE_CHECKING:
    from ems.pool.metrics import NodeMetrics
    from ems.transport.shm import ShmSettings
    from ems.transport.tcp.wire import LookupSettings
    from ems.transport.ucx.server import PoolServer


def assemble(
    store: NodeStore,
    access_keys: dict[str, str] | None = None,
    limits: NodeLimits | None = None,
    metrics: NodeMetrics | None = None,
    shm: ShmSettings | None = None,
    lookups: LookupSettings | None = None,
) -> PoolServer:
    """The node's server over `store`; see the module docstring."""
    from ems.transport.ucx.server import PoolServer

    limits = limits or NodeLimits.for_capacity(store.capacity_bytes)
    handlers = NodeHandlers(store, limits, metrics, shm)
    if metrics is not None:
        metrics.watch_shm(handlers.shm.stats)
        metrics.watch_namespaces(handlers.namespaces)
    server = PoolServer(handlers, limits, access_keys, metrics, lookups)
    if metrics is not None:
        metrics.watch_lookups(server.lookups.stats)
    return server

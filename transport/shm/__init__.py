"""`ems.transport.shm`: same-host shared memory beside a node's connection of another medium (UCX).

Layout:
* `wire`: the protocol and the security model (the region, SHM_OPEN and its hand-over, the SHM_PUT / SHM_GET metas,
  the progress word), what both sides keep;
* the client's side: `client` (`ShmClient`: the calls, the region's allocator) and `opening` (SHM_OPEN, the
  descriptor's hand-over);
* the node's side: `server` (`ShmService`), `regions` (the ledger of regions), `handover` (the Unix socket) and
  `host` (what it asks of the node);
* a region's request channel: both ends are `transport.stream`'s (the client's) and `transport.stream_node`'s.

Shared memory imports no other medium: a client is handed what it needs of its node client (`transport.base.NodeLink`).
The names the node (`ems.pool`) takes from here are those of `wire` below.
"""

from ems.transport.shm.wire import RangedRequest, ShmSettings, metric_name

__all__ = ["RangedRequest", "ShmSettings", "metric_name"]

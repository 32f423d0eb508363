"""Opening a remote pool: a fixed node list, or the live set that etcd membership reports (`pool_etcd`); the opener
of `PoolClient`, beside the other backends, over `ems.cluster`'s membership.

Contract (`open_remote_pool`):
* Without `pool_etcd`: a `PoolClient` over `pool_nodes`, fixed for the process's life.
* With `pool_etcd`: the pool is `pool_nodes` (always members) plus every node registered under `pool_cluster`; a
  `MembershipWatcher` keeps the set current, so nodes can join, drain and leave while engines run. etcd is read
  once at start; if it cannot be reached then and there are no `pool_nodes`, `EmsException(EMS_RECOVERD_ERROR)`
  (recoverable: `Ems.init` may be called again). With
  `pool_nodes` the engine starts on them and picks up etcd's members once it answers. When etcd goes away later,
  the engine keeps the last set it saw and goes on serving.
* `pool_replicas` (k owners per block) and `pool_hedge` are handed to the `PoolClient`.
* Connections: `connect` opens a client for each of `pool_nodes`; `Ems.init` hands one that connects at start when
  there are at most `EAGER_CONNECT_NODES` of them (a refused handshake fails the init at once), else one that
  connects lazily, each node on its first call. `join` opens the nodes etcd reports, always lazily in `Ems.init`: a
  pool of a thousand members is not a thousand connections at start, nor one made under the membership's lock as
  each node joins. The client keeps a bounded set of connections warm (`ems.backends.fanout.WarmNodes`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ems.backends.pool_client import PoolClient
from ems.cluster.etcd import EtcdError
from ems.cluster.membership import MembershipWatcher, NodeInfo
from ems.errors import EmsErrorCode, EmsException
from ems.settings import Settings
from ems.transport.base import NodeClient

log = logging.getLogger("ems")

#: a fixed node list larger than this is connected lazily: an engine connects to the nodes its calls use (and keeps
#: a bounded set warm, `ems.backends.fanout.WarmNodes`), not to every node at start
EAGER_CONNECT_NODES = 8


def open_remote_pool(
    settings: Settings, connect: Callable[[str], NodeClient], join: Callable[[str], NodeClient] | None = None
) -> PoolClient:
    """See the module docstring (`join`: how etcd's members are opened; `connect` when not given)."""
    static = list(settings.pool_nodes)
    nodes = [connect(address) for address in static]
    if settings.pool_etcd is None:
        return PoolClient(
            nodes, read_cache_capacity=settings.read_cache_capacity, replicas=settings.pool_replicas, hedge=settings.pool_hedge
        )
    pool = PoolClient(
        nodes,
        read_cache_capacity=settings.read_cache_capacity,
        replicas=settings.pool_replicas,
        connect=join or connect,
        hedge=settings.pool_hedge,
    )

    def on_change(members: dict[str, NodeInfo]) -> None:
        pool.set_members(sorted(set(static) | set(members)), {a: i.incarnation for a, i in members.items()})

    watcher = MembershipWatcher(settings.pool_etcd, settings.pool_cluster, on_change)
    try:
        watcher.start()
    except EtcdError as error:
        if not static:
            pool.close()
            raise EmsException(
                EmsErrorCode.EMS_RECOVERD_ERROR,
                f"pool_etcd: cannot read the members of {settings.pool_cluster!r} yet (call Ems.init again later): {error}",
            ) from None
        log.warning("pool_etcd unreachable; starting on pool_nodes and watching for etcd: %s", error)
        watcher.start_background()
    pool.on_close(watcher.close)
    return pool

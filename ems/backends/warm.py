"""The nodes a client keeps connected (`WarmNodes`): with a large pool an engine uses few of its nodes per call, and
keeps only a bounded set of connections warm.

Contract:
* `used(node)` is called for each request a call sends a node (`ems.backends.fanout.FanOut.start`): the node becomes
  the most recently used.
* Once more than `limit` nodes have been used, the least recently used ones that have been idle for `idle_s` are
  closed (`NodeClient.close`: their connections released; a later call reconnects by itself, `transport.ucx`), until
  `limit` remain or none is idle that long: a node with a call in flight (used within `idle_s`, longer than any
  call's timeout) is never closed under it.
* Only remote nodes count (a node in this process has no connection to keep).
"""

from __future__ import annotations

import collections
import threading
import time

from ems.transport.base import NodeClient, NodeLocation

WARM_NODES = 64  # connections a client keeps warm
IDLE_S = 60.0  # a node unused this long may be closed (longer than a call's timeout)


class WarmNodes:
    """See the module docstring. Thread-safe."""

    def __init__(self, limit: int = WARM_NODES, idle_s: float = IDLE_S) -> None:
        if limit < 1 or idle_s < 0:
            raise ValueError(f"limit must be >= 1 and idle_s >= 0, got {limit}, {idle_s}")
        self.limit, self.idle_s = limit, idle_s
        self._used: collections.OrderedDict[int, tuple[NodeClient, float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def used(self, node: NodeClient) -> None:
        if node.location is not NodeLocation.REMOTE:
            return
        now = time.monotonic()
        to_close = []
        with self._lock:
            self._used[id(node)] = (node, now)
            self._used.move_to_end(id(node))
            while len(self._used) > self.limit:
                key, (oldest, last) = next(iter(self._used.items()))
                if now - last < self.idle_s:
                    break
                del self._used[key]
                to_close.append(oldest)
        for old in to_close:
            try:
                old.close()
            except Exception:  # closing one must not fail the call that used another
                pass

    def __len__(self) -> int:
        return len(self._used)

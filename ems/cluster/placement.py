"""`Members`: the set of pool nodes a `PoolClient` places keys on, which membership may change while calls run.

Contract:
* `view` is an immutable snapshot (`View`: the nodes, in the order they joined, and their rendezvous seeds;
  placement does not depend on the order). A call takes
  one snapshot and uses it throughout, so a change never mixes two placements inside one call.
* `set(addresses)` makes exactly those nodes the live set: a new address gets a client from `connect` (a remote
  node connects lazily if it is not up yet), an address that returns reuses its old client. A node that left is
  not closed at once: calls already running on it finish (a draining node still answers them); it is closed
  `RETIRE_S` seconds later, at the next change, or at `close()`.
* `set(addresses, incarnations)`: an address whose incarnation (`NodeInfo.incarnation`) changed is a node that
  came back (restarted, possibly empty): it keeps its client (which reconnects by itself) but counts as joined.
* `fallback()`: how many nodes joined (or came back) in the last `REBALANCE_S` seconds: while repair moves values
  to their new owners, a read also asks that many nodes after a key's owners (`ems.backends.reads`).
* `on_change(callback)`: `callback(added, removed)` after each change (addresses; a node that came back is in both),
  e.g. to forget what was measured of a node.
* Without `connect` (a fixed node list) the set cannot change.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ems.cluster.rendezvous import node_seeds
from ems.transport.base import NodeClient

log = logging.getLogger("ems")

RETIRE_S = 30.0
REBALANCE_S = 120.0  # how long after a join reads also ask the nodes after a key's owners


@dataclasses.dataclass(frozen=True)
class View:
    nodes: tuple[NodeClient, ...]
    seeds: np.ndarray

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(n.address for n in self.nodes)


def _view(nodes: Sequence[NodeClient]) -> View:
    return View(tuple(nodes), node_seeds([n.address for n in nodes]))


class Members:
    """The live node set; see the module docstring. Thread-safe."""

    def __init__(self, nodes: Sequence[NodeClient], connect: Callable[[str], NodeClient] | None = None) -> None:
        self._connect = connect
        self._lock = threading.Lock()
        self._live: dict[str, NodeClient] = {n.address: n for n in nodes}
        self._incarnations: dict[str, object] = {}
        self._retired: dict[str, tuple[NodeClient, float]] = {}
        self._joins: list[float] = []  # when nodes joined or came back (monotonic), within REBALANCE_S
        self._listeners: list[Callable[[list[str], list[str]], None]] = []
        self.view = _view(list(self._live.values()))

    def on_change(self, callback: Callable[[list[str], list[str]], None]) -> None:
        self._listeners.append(callback)

    def set(self, addresses: Sequence[str], incarnations: Mapping[str, object] | None = None) -> None:
        if self._connect is None:
            raise ValueError("this pool has a fixed node list")
        wanted = set(addresses)
        incarnations = dict(incarnations or {})
        with self._lock:
            back = sorted(
                a
                for a in wanted & set(self._live)
                if a in incarnations and a in self._incarnations and incarnations[a] != self._incarnations[a]
            )
            self._incarnations.update({a: i for a, i in incarnations.items() if a in wanted})
            if wanted == set(self._live) and not back:
                return
            added = sorted(wanted - set(self._live))
            removed = sorted(set(self._live) - wanted)
            for address in added:
                old = self._retired.pop(address, None)
                self._live[address] = old[0] if old else self._connect(address)
            now = time.monotonic()
            for address in removed:
                self._retired[address] = (self._live.pop(address), now)
                self._incarnations.pop(address, None)
            self.view = _view(list(self._live.values()))
            self._joins = [t for t in self._joins if now - t < REBALANCE_S] + [now] * (len(added) + len(back))
            expired = [a for a, (_, since) in self._retired.items() if now - since > RETIRE_S]
            to_close = [self._retired.pop(a)[0] for a in expired]
        log.info("pool members: +%s -%s (back: %s), now %d node(s)", added, removed, back, len(self.view.nodes))
        for callback in self._listeners:
            callback(added + back, removed + back)
        _close_all(to_close)

    def fallback(self) -> int:
        """Nodes that joined or came back in the last REBALANCE_S seconds."""
        joins = self._joins  # (replaced, never changed in place: no lock needed)
        if not joins:
            return 0
        now = time.monotonic()
        return sum(1 for t in joins if now - t < REBALANCE_S)

    def close(self) -> None:
        with self._lock:
            nodes = list(self._live.values()) + [n for n, _ in self._retired.values()]
            self._live.clear()
            self._retired.clear()
            self.view = _view([])
        _close_all(nodes)


def _close_all(nodes: Sequence[NodeClient]) -> None:
    for node in nodes:
        try:
            node.close()
        except Exception:  # closing must release every node even if one fails
            pass

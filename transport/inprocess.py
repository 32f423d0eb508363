"""The in-process transport: a store living in this process served as a pool node (an `ems.store.kv_store.KvStore`,
reached through the `LocalStore` protocol so that the transport does not import the store): the nodes of clusters
built in one process (tests). The embedded pool does not go through it: it is a backend of its own
(`ems.backends.embedded.EmbeddedPool`)."""

from __future__ import annotations

from collections.abc import Sequence

from ems.buffers import Buffer
from ems.records import Deadline
from ems.transport.base import LocalStore, NodeClient, NodeLocation
from ems.transport.exists_holds import Hold


class InProcessNode(NodeClient):
    """A `NodeClient` over a store in this process: no copies beyond the store's own, no threads."""

    address = "embedded"  # (a store in this process)
    location = NodeLocation.IN_PROCESS

    def __init__(self, store: LocalStore) -> None:
        self.store = store

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[Buffer]], deadline: Deadline | float) -> list[bool]:
        return self.store.put_many(keys, values)

    def get(self, keys: Sequence[bytes], deadline: Deadline | float) -> list[Buffer | None]:
        return list(self.store.get_many(keys))

    def exists(self, keys: Sequence[bytes], deadline: Deadline | float, hold: Hold | None = None) -> list[bool]:
        return self.store.contains_many(keys) if hold is None else self.store.hold_many(keys, hold)

    def ping(self, deadline: Deadline | float) -> bool:
        return True

    def close(self) -> None:
        self.store.close()  # its background threads stop; the values stay readable

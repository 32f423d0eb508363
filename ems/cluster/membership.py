"""Pool membership on etcd: nodes register themselves, engines watch who is in the pool.

Layout: node `HOST:PORT` of cluster `NAME` is the key `/ems/pool/NAME/nodes/HOST:PORT`, its value JSON
`{"address": "HOST:PORT", "metrics": "HOST:PORT" or null, "incarnation": a random id of the node process}`,
attached to a lease the node keeps alive. etcd holds
only who is in the pool; data never goes through it (clients place keys by rendezvous hashing over the live set).

Contract:
* `Registration` (node side): `start()` grants a lease of `ttl_s` seconds and puts the key (raises `EtcdError` if
  etcd cannot be reached); a thread refreshes the lease every `ttl_s / 3` seconds and, if etcd lost it (etcd was
  down, or this node cut off, longer than the TTL), registers again with a new lease. `on_reconnect()` (optional)
  is called each time etcd answers again after it could not be reached (e.g. to renew the node's own watch).
  `deregister()` deletes the key and revokes the lease (best effort), so watchers see the node leave at once
  instead of after the TTL. A node that dies without deregistering disappears when its lease expires.
* `MembershipWatcher` (engine side): `start()` reads the current members (raises `EtcdError` if etcd cannot be
  reached), then a thread watches the prefix and calls `on_change(members)` after every change, with the whole new
  set. If the watch breaks (etcd stopped, network lost) the watcher keeps the last set it saw, retries every
  `retry_s` seconds, and on reconnecting reads the whole set again (so changes made meanwhile are not lost).
  A watch quiet for `idle_s` seconds is re-established the same way (one range read), so a connection lost without
  a reset cannot freeze the view. `resync()` does the same at once, for a caller that knows the stream may be stale
  (a node whose lease refresh found etcd again after a partition: the events sent meanwhile wait in TCP's
  retransmission back-off, tens of seconds after a long cut). `connected` says whether the watch is live now.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable

from ems.cluster.etcd import EtcdClient, EtcdError, WatchEvent, WatchHandle, WatchIdle

log = logging.getLogger("ems.membership")


def cluster_prefix(cluster: str) -> bytes:
    return f"/ems/pool/{cluster}/nodes/".encode()


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    address: str
    metrics: str | None = None
    # a random id of the node process: a node restarted on the same address (empty, unless its disk kept values)
    # registers another, so watchers see it come back even when its old entry had not expired yet
    incarnation: str | None = None

    def encode(self) -> bytes:
        return json.dumps({"address": self.address, "metrics": self.metrics, "incarnation": self.incarnation}).encode()

    @staticmethod
    def decode(raw: bytes) -> NodeInfo | None:
        try:
            data = json.loads(raw)
            incarnation = data.get("incarnation")
            return NodeInfo(str(data["address"]), data.get("metrics") or None, None if incarnation is None else str(incarnation))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def read_members(client: EtcdClient, cluster: str) -> tuple[dict[str, NodeInfo], int]:
    """The registered nodes of `cluster` by address, and the revision they were read at."""
    kvs, revision = client.get_prefix(cluster_prefix(cluster))
    members: dict[str, NodeInfo] = {}
    for kv in kvs:
        info = NodeInfo.decode(kv.value)
        if info is not None:
            members[info.address] = info
        else:
            log.warning("ignoring an unreadable membership entry %r", kv.key)
    return members, revision


class Registration:
    """One node's entry in the pool; see the module docstring."""

    def __init__(
        self, url: str, cluster: str, info: NodeInfo, ttl_s: int = 5, on_reconnect: Callable[[], None] | None = None
    ) -> None:
        if ttl_s < 2:
            raise ValueError(f"the lease TTL must be >= 2 s, got {ttl_s}")
        self.client = EtcdClient(url, timeout_s=max(1.0, ttl_s / 3))
        self.key = cluster_prefix(cluster) + info.address.encode()
        self.info = info
        self.ttl_s = ttl_s
        self.on_reconnect = on_reconnect
        self.lease = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _register(self) -> None:
        lease = self.client.grant(self.ttl_s)
        self.client.put(self.key, self.info.encode(), lease)
        self.lease = lease

    def start(self) -> None:
        self._register()
        self._thread = threading.Thread(target=self._keep_alive, name="ems-pool-lease", daemon=True)
        self._thread.start()

    def _keep_alive(self) -> None:
        unreachable = False
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self.client.keepalive(self.lease) <= 0:
                    log.warning("etcd lost this node's lease; registering again")
                    self._register()
                if unreachable:
                    log.info("etcd reachable again")
                    if self.on_reconnect is not None:
                        try:
                            self.on_reconnect()
                        except Exception:  # a failing listener must not stop the lease's refresh
                            log.exception("on_reconnect failed")
                unreachable = False
            except EtcdError as error:
                if not unreachable:
                    log.warning("cannot refresh the membership lease (still serving): %s", error)
                unreachable = True

    def deregister(self) -> None:
        """Leave the pool now (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        try:
            self.client.delete(self.key)
            if self.lease:
                self.client.revoke(self.lease)
        except EtcdError as error:
            log.warning("could not deregister from etcd (the lease will expire): %s", error)
        self.lease = 0


class MembershipWatcher:
    """An engine's view of who is in the pool; see the module docstring."""

    def __init__(
        self,
        url: str,
        cluster: str,
        on_change: Callable[[dict[str, NodeInfo]], None],
        retry_s: float = 0.5,
        timeout_s: float = 2.0,
        idle_s: float = 60.0,
    ) -> None:
        self.client = EtcdClient(url, timeout_s=timeout_s)
        self.cluster = cluster
        self.prefix = cluster_prefix(cluster)
        self.on_change = on_change
        self.retry_s = retry_s
        self.idle_s = idle_s
        self.members: dict[str, NodeInfo] = {}
        self.connected = False
        self.renewals = 0  # quiet watches renewed
        self.disconnects = 0  # watches lost (etcd unreachable)
        self._revision = 0
        self._handle = WatchHandle()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> dict[str, NodeInfo]:
        """Read the members, hand them to `on_change` (in this thread), then watch; raises `EtcdError`."""
        members, self._revision = read_members(self.client, self.cluster)
        self._publish(members, force=True)
        self._start_thread(resync=False)
        return dict(self.members)

    def start_background(self) -> None:
        """Watch without a first read here: the thread reads the members once etcd answers."""
        self._start_thread(resync=True)

    def _start_thread(self, resync: bool) -> None:
        self._thread = threading.Thread(target=self._run, args=(resync,), name="ems-membership", daemon=True)
        self._thread.start()

    def _publish(self, members: dict[str, NodeInfo], force: bool = False) -> None:
        if members == self.members and not force:
            return
        self.members = members
        try:
            self.on_change(dict(members))
        except Exception:  # a failing listener must not stop the watch
            log.exception("membership listener failed")

    def _apply(self, events: list[WatchEvent]) -> None:
        members = dict(self.members)
        for event in events:
            address = event.key[len(self.prefix) :].decode(errors="replace")
            if event.deleted:
                members.pop(address, None)
            else:
                info = NodeInfo.decode(event.value)
                if info is not None:
                    members[info.address] = info
            self._revision = max(self._revision, event.revision)
        self._publish(members)

    def _on_created(self) -> None:
        if not self.connected:
            log.info("watching pool membership on %s", self.client.url)
        self.connected = True

    def _run(self, resync: bool) -> None:
        while not self._stopped.is_set():
            try:
                if resync:
                    members, self._revision = read_members(self.client, self.cluster)
                    self._publish(members)
                    resync = False
                self.client.watch_prefix(
                    self.prefix, self._revision + 1, self._apply, self._handle, self._on_created, self.idle_s
                )
            except WatchIdle:
                resync = True  # quiet for idle_s: read the set again and watch anew (still connected)
                self.renewals += 1
            except EtcdError as error:
                if self.connected or not resync:
                    log.warning("pool membership: etcd unreachable, keeping the last %d node(s): %s", len(self.members), error)
                    self.disconnects += 1
                self.connected = False
                resync = True
                self._stopped.wait(self.retry_s)
            except Exception:  # never let the watch thread die: keep the last set and retry
                log.exception("pool membership watch failed")
                self.connected = False
                resync = True
                self._stopped.wait(self.retry_s)

    def resync(self) -> None:
        """Read the whole set again now and watch anew (the running watch ends; a watch not yet made is fresh)."""
        self._handle.renew()

    def close(self) -> None:
        self._stopped.set()
        self._handle.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.02) -> bool:
    """Poll `predicate` until true or `timeout_s` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True

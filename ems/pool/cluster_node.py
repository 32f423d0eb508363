"""A pool node's part in a cluster: its `--metrics` endpoint, its `--etcd` registration and repair, and the drain on
stop.

Contract (`NodeExtras`, used by `ems.pool.__main__`):
* Built before the server starts: creates `metrics` (`ems.pool.metrics.NodeMetrics`) when `--metrics` is given,
  else None (the server then counts nothing).
* `start(address)`: serves `/metrics` and `/healthz` on `--metrics`, then registers `--advertise` (default
  `address`) with its metrics address and a fresh incarnation id in etcd under `--cluster`. Raises when either
  fails (the node exits 1). With `--etcd` and `--repair-rate` > 0 it then watches the cluster's membership and
  repairs (`ems.pool.repair.Repairer`: `--replicas`, `--repair-rate`, `--repair-interval`), its progress in the
  metrics. When its lease refresh finds etcd again after failing (the node was cut off, or etcd was down), the
  membership watch is renewed at once (`MembershipWatcher.resync`), so a healed node's repair does not wait for a
  stale watch stream to catch up.
* `drain()` (on SIGTERM/SIGINT, while the server still serves): deregisters, turns `/healthz` to 503, and waits
  `--drain` seconds for engines to see the leave and finish the calls they had sent. Without `--etcd` it returns
  at once (engines with a static node list are not told). `close()` stops the metrics endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ems.cluster.membership import MembershipWatcher, Registration
    from ems.pool.metrics import MetricsServer, NodeMetrics
    from ems.pool.node_store import NodeStore
    from ems.pool.repair import Repairer
    from ems.transport.base import NodeClient

log = logging.getLogger("ems.pool")


def _host_port(flag: str) -> Callable[[str], tuple[str, int]]:
    def parse(value: str) -> tuple[str, int]:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise argparse.ArgumentTypeError(f"{flag} must be HOST:PORT, got {value!r}")
        return host.strip("[]"), int(port)

    return parse


def _etcd_url(value: str) -> str:
    from ems.cluster.etcd import parse_url

    try:
        parse_url(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


def _cluster(value: str) -> str:
    import re

    if not re.fullmatch(r"[0-9a-z._-]{1,512}", value):
        raise argparse.ArgumentTypeError(f"--cluster must be 1-512 characters of [0-9a-z._-], got {value!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics",
        type=_host_port("--metrics"),
        default=None,
        help="HOST:PORT to serve Prometheus /metrics and /healthz on (port 0: pick one)",
    )
    parser.add_argument("--etcd", type=_etcd_url, default=None, help="register in etcd at http://HOST:PORT")
    parser.add_argument("--cluster", type=_cluster, default="default", help="the cluster's name in etcd")
    parser.add_argument(
        "--advertise",
        type=_host_port("--advertise"),
        default=None,
        help="HOST:PORT clients reach this node at (default: the --listen host, bound port)",
    )
    parser.add_argument("--lease-ttl", type=int, default=5, help="seconds etcd keeps a silent node registered")
    parser.add_argument("--drain", type=float, default=1.0, help="seconds to keep serving after deregistering")
    parser.add_argument(
        "--replicas", type=int, default=1, help="copies of each value the cluster keeps (the engines' pool_replicas)"
    )
    parser.add_argument(
        "--repair-rate",
        default="64MiB",
        help="bytes per second this node may spend copying values to their owners after membership changes (0: off)",
    )
    parser.add_argument("--repair-interval", type=float, default=60.0, help="seconds between repair passes without changes")


class NodeExtras:
    """Metrics endpoint, etcd registration and drain of one node; see the module docstring."""

    def __init__(self, store: NodeStore, args: argparse.Namespace, keys: Mapping[str, str] | None = None) -> None:
        self.args = args
        self.store = store
        self.keys = dict(keys or {})
        self.repair: Repairer | None = None
        self._watcher: MembershipWatcher | None = None
        self.metrics: NodeMetrics | None = None
        if args.metrics is not None:
            from ems.pool.metrics import NodeMetrics

            self.metrics = NodeMetrics(store)
        self._server: MetricsServer | None = None
        self._registration: Registration | None = None
        self.draining = False

    def start(self, address: str) -> None:
        metrics_address: str | None = None
        if self.metrics is not None:
            from ems.pool.metrics import MetricsServer

            host, port = self.args.metrics
            self._server = MetricsServer(host, port, self.metrics, lambda: not self.draining)
            metrics_address = self._server.address
            log.info("metrics on http://%s/metrics", metrics_address)
        if self.args.etcd is not None:
            from ems.cluster.membership import NodeInfo, Registration

            advertise = f"{self.args.advertise[0]}:{self.args.advertise[1]}" if self.args.advertise else address
            info = NodeInfo(advertise, metrics_address, secrets.token_hex(8))
            self._registration = Registration(
                self.args.etcd, self.args.cluster, info, ttl_s=self.args.lease_ttl, on_reconnect=self._etcd_back
            )
            self._registration.start()
            log.info("registered as %s in cluster %r at %s", advertise, self.args.cluster, self.args.etcd)
            if self.args.repair_rate > 0:
                self._start_repair(advertise)

    def _start_repair(self, advertise: str) -> None:
        from ems.cluster.membership import MembershipWatcher
        from ems.pool.repair import Repairer
        from ems.pool.repair_plan import RepairSettings

        settings = RepairSettings(self.args.replicas, self.args.repair_rate, self.args.repair_interval)
        self.repair = Repairer(self.store, advertise, settings, self._connect_peer, self.keys)
        if self.metrics is not None:
            self.metrics.watch_repair(self.repair.progress)
        self.repair.start()
        self._watcher = MembershipWatcher(
            self.args.etcd,
            self.args.cluster,
            lambda members: self.repair.on_members({a: i.incarnation for a, i in members.items()}) if self.repair else None,
        )
        self._watcher.start_background()
        log.info("repairing to %d replica(s) at up to %d bytes/s", settings.replicas, settings.rate)

    def _etcd_back(self) -> None:
        """etcd answers this node again (it was cut off): the membership it watched meanwhile may be a stale stream
        whose events wait in TCP's retransmission back-off; read the set again now, so repair starts at once."""
        watcher = self._watcher
        if watcher is not None:
            log.info("etcd reachable again: reading the pool's membership anew")
            watcher.resync()

    def _connect_peer(self, address: str, tenant: str) -> NodeClient:
        """A connection to another node as `tenant` (its key from this node's keys; anonymous without keys)."""
        from ems.transport.shm.client import ShmMode
        from ems.transport.ucx.client import UcxNode

        return UcxNode(address, access_id=tenant, access_key=self.keys.get(tenant), connect_timeout_ms=3000, shm=ShmMode.OFF)

    async def drain(self) -> None:
        self.draining = True
        if self.repair is not None:  # a leaving node copies nothing more
            await asyncio.get_running_loop().run_in_executor(None, self.repair.close)
        if self._registration is None:
            return
        await asyncio.get_running_loop().run_in_executor(None, self._registration.deregister)
        log.info("deregistered; serving %.1f s more while engines move off", self.args.drain)
        await asyncio.sleep(self.args.drain)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        if self.repair is not None:
            self.repair.close()
            self.repair = None
        if self._registration is not None:
            self._registration.deregister()  # idempotent: also on the error paths
            self._registration = None
        if self._server is not None:
            self._server.close()
            self._server = None

"""A pool node's part in a cluster: its `--metrics` endpoint and its `--etcd` registration, and the drain on stop.

Contract (`NodeExtras`, used by `ems.pool.__main__`):
* Built before the server starts: creates `metrics` (`ems.pool.metrics.NodeMetrics`) when `--metrics` is given,
  else None (the server then counts nothing).
* `start(address)`: serves `/metrics` and `/healthz` on `--metrics`, then registers `--advertise` (default
  `address`) with its metrics address in etcd under `--cluster`. Raises when either fails (the node exits 1).
* `drain()` (on SIGTERM/SIGINT, while the server still serves): deregisters, turns `/healthz` to 503, and waits
  `--drain` seconds for engines to see the leave and finish the calls they had sent. Without `--etcd` it returns
  at once (engines with a static node list are not told). `close()` stops the metrics endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ems.cluster.membership import Registration
    from ems.pool.handlers import NodeStore
    from ems.pool.metrics import MetricsServer, NodeMetrics

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


class NodeExtras:
    """Metrics endpoint, etcd registration and drain of one node; see the module docstring."""

    def __init__(self, store: NodeStore, args: argparse.Namespace) -> None:
        self.args = args
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
            self._registration = Registration(
                self.args.etcd, self.args.cluster, NodeInfo(advertise, metrics_address), ttl_s=self.args.lease_ttl
            )
            self._registration.start()
            log.info("registered as %s in cluster %r at %s", advertise, self.args.cluster, self.args.etcd)

    async def drain(self) -> None:
        self.draining = True
        if self._registration is None:
            return
        await asyncio.get_running_loop().run_in_executor(None, self._registration.deregister)
        log.info("deregistered; serving %.1f s more while engines move off", self.args.drain)
        await asyncio.sleep(self.args.drain)

    def close(self) -> None:
        if self._registration is not None:
            self._registration.deregister()  # idempotent: also on the error paths
            self._registration = None
        if self._server is not None:
            self._server.close()
            self._server = None

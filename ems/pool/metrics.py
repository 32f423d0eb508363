"""A pool node's Prometheus metrics, and the HTTP endpoint that serves them (`ems-pool --metrics HOST:PORT`).

Contract:
* `NodeMetrics` owns its own `CollectorRegistry` (never the process-wide default): per-request counters and a
  latency histogram updated by the server once per request (never per value), plus a collector that reads the
  store's own statistics when scraped. Exposition is `prometheus_client`'s.
* Metric names (all prefixed `ems_pool_`): `requests_total{op,status}`, `request_bytes_total{op}` (PUT: received,
  GET: sent), `request_seconds{op}` (histogram), `auth_failures_total`, `checksum_failures_total` (PUT values
  refused as damaged), `connections` (open now), `connections_opened_total`, `unread_discarded_total` and
  `unread_discarded_bytes_total` (messages on tags nobody would receive, discarded unread), `stray_closes_total`
  (connections closed for such messages), and from the store: `held_bytes`,
  `values`, `capacity_bytes`, `evictions_total`, `get_hits_total`, `get_misses_total`, `puts_total`,
  `rejected_puts_total` (hits and misses over all tiers).
* Per tier (label `tier`: `dram`, and `disk` on a node with `--disk`): `tier_up`, `tier_bytes`,
  `tier_capacity_bytes`, `tier_values`, `tier_hits_total`, `tier_evictions_total`; and for the disk
  `tier_reads_total`, `tier_read_bytes_total`, `tier_read_seconds_total`, `tier_writes_total`,
  `tier_write_bytes_total`, `tier_write_seconds_total` (seconds over count: the mean latency of a record read or
  written), `tier_errors_total{kind}` (`integrity`: damaged records dropped, `io`: read/write errors,
  `dropped_write`: evictions not written), `disk_queued_bytes`, `disk_queued_values`, `disk_restored_values`,
  `disk_restore_seconds`.
* Repair (a node registered in etcd, `ems.pool.repair`; `watch_repair`): `repair_running` (1 while a pass runs),
  `repair_pending_keys` (keys of the pass under way not checked yet), `repair_passes_total`,
  `repair_abandoned_total` (passes a membership change stopped), `repair_checked_keys_total`,
  `repair_copied_values_total`, `repair_copied_bytes_total`, `repair_failed_copies_total`,
  `repair_last_pass_seconds`, `repair_incomplete` (1 when the last finished pass could not reach a peer: another
  follows within seconds), read from the repairer when scraped.
* Same-host shared memory (`transport.shm.server`, registered by the node assembly `ems.pool.node` with `watch_shm`):
  `shm.regions` (regions counted against `--shm-total`: offered, handed over, or ended and not yet freed),
  `shm_handed_regions`,
  `shm_bytes` (their bytes: what `--shm-total` bounds), `shm_resident_bytes` (the pages their memfds hold, whoever
  faulted them in: the host's shared memory on the node's account), `shm_total_bytes`, and
  `shm_refusals_total{reason}` (regions and hand-overs refused, by `ShmRefusal`).
* Per namespace (`watch_namespaces`, `ems.pool.namespaces.NamespaceBook`): `namespace_lookups_total`,
  `namespace_hits_total`, `namespace_bytes_total`, labels `tenant` and `namespace`, at most the book's `label_cap`
  pairs with labels of their own (later ones under `other`).
* `MetricsServer` serves `GET /metrics` (text exposition), `GET /healthz` (200 `ok` while serving, 503
  `draining` once the node is leaving) and `GET /namespaces` (JSON: `NamespaceBook.report`, what `ems-pool status
  --namespaces` reads; 404 on a node that watches none) from a daemon thread; anything else is 404.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from ems.buffers import Buffer
from ems.store.value_format import is_well_formed

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


if TYPE_CHECKING:
    from ems.pool.namespaces import NamespaceBook
    from ems.pool.node_store import NodeStore
    from ems.transport.shm.regions import ShmStats
    from ems.transport.tcp.wire import LookupStats


class _StoreCollector(Collector):
    def __init__(self, store: NodeStore) -> None:
        self.store = store

    def collect(self) -> Iterator:
        stats: Any = self.store.stats()
        yield from _tier_families(self.store, stats)
        yield GaugeMetricFamily("ems_pool_held_bytes", "Bytes of values held (keys included)", value=stats.used_bytes)
        yield GaugeMetricFamily("ems_pool_values", "Values held", value=stats.entries)
        yield GaugeMetricFamily("ems_pool_capacity_bytes", "Bytes this node may hold", value=stats.capacity_bytes)
        yield CounterMetricFamily("ems_pool_evictions", "Values evicted to make room", value=stats.evictions)
        yield CounterMetricFamily("ems_pool_get_hits", "Keys found by GET", value=stats.hits)
        yield CounterMetricFamily("ems_pool_get_misses", "Keys not found by GET", value=stats.misses)
        yield CounterMetricFamily("ems_pool_puts", "Values stored", value=stats.puts)
        yield CounterMetricFamily(
            "ems_pool_rejected_puts", "Values refused (damaged, or larger than the capacity)", value=stats.rejected_puts
        )


class _ShmCollector(Collector):
    def __init__(self, stats: Callable[[], ShmStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator:
        stats = self.stats()
        yield GaugeMetricFamily("ems_pool_shm_regions", "Shared-memory regions counted against the total", value=stats.regions)
        yield GaugeMetricFamily("ems_pool_shm_handed_regions", "Regions handed over to their clients", value=stats.handed)
        yield GaugeMetricFamily("ems_pool_shm_bytes", "Bytes of the regions counted (bounded by --shm-total)", value=stats.bytes)
        yield GaugeMetricFamily(
            "ems_pool_shm_resident_bytes", "Pages the regions' memfds hold, whoever faulted them in", value=stats.resident_bytes
        )
        yield GaugeMetricFamily("ems_pool_shm_total_bytes", "--shm-total", value=stats.total_bytes)
        refusals = CounterMetricFamily("ems_pool_shm_refusals", "Regions and hand-overs refused, by reason", labels=["reason"])
        for reason, count in sorted(stats.refusals.items()):
            refusals.add_metric([reason], count)
        yield refusals


class _LookupCollector(Collector):
    def __init__(self, stats: Callable[[], LookupStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator:
        stats = self.stats()
        yield GaugeMetricFamily(
            "ems_pool_lookup_channels", "Lookup channels open (one per connection at most)", value=stats.channels
        )
        yield GaugeMetricFamily(
            "ems_pool_lookup_pending", "Lookup listener peers that have not presented a token yet", value=stats.pending
        )
        refusals = CounterMetricFamily("ems_pool_lookup_refusals", "Lookup listener peers closed, by reason", labels=["reason"])
        for reason, count in sorted(stats.refusals.items()):
            refusals.add_metric([reason], count)
        yield refusals


def _tier_families(store: Any, stats: Any) -> Iterator:
    """The per-tier families (see the module docstring): DRAM from the store's own figures, the disk from its tier."""
    tier_stats = getattr(store, "tier_stats", None)
    tiers = tier_stats() if tier_stats is not None else None
    dram = tiers.dram if tiers is not None else stats
    disk = tiers.disk if tiers is not None else None

    def family(kind: type, name: str, doc: str, dram_value: float | None, disk_value: float | None) -> Any:
        metric = kind(name, doc, labels=["tier"])
        if dram_value is not None:
            metric.add_metric(["dram"], dram_value)
        if disk is not None and disk_value is not None:
            metric.add_metric(["disk"], disk_value)
        return metric

    g, c = GaugeMetricFamily, CounterMetricFamily
    up = None if disk is None else float(disk.state.value == "up")
    yield family(g, "ems_pool_tier_up", "1 while the tier serves, 0 once it failed", 1.0, up)
    yield family(g, "ems_pool_tier_bytes", "Bytes held by the tier", dram.used_bytes, disk and disk.used_bytes)
    yield family(g, "ems_pool_tier_capacity_bytes", "Bytes the tier may hold", dram.capacity_bytes, disk and disk.capacity_bytes)
    yield family(g, "ems_pool_tier_values", "Values held by the tier", dram.entries, disk and disk.values)
    yield family(c, "ems_pool_tier_hits", "Lookups the tier answered", dram.hits, disk and disk.hits)
    yield family(c, "ems_pool_tier_evictions", "Values evicted from the tier", dram.evictions, disk and disk.evictions)
    if disk is None:
        return
    for name, doc, value in (
        ("reads", "Records read", disk.reads),
        ("read_bytes", "Bytes of records read", disk.read_bytes),
        ("read_seconds", "Seconds spent reading records", disk.read_seconds),
        ("writes", "Records written", disk.writes),
        ("write_bytes", "Bytes of records written", disk.write_bytes),
        ("write_seconds", "Seconds spent writing records", disk.write_seconds),
    ):
        yield family(c, f"ems_pool_tier_{name}", doc, None, value)
    errors = CounterMetricFamily("ems_pool_tier_errors", "Tier errors by kind", labels=["tier", "kind"])
    errors.add_metric(["disk", "integrity"], disk.integrity_errors)
    errors.add_metric(["disk", "io"], disk.io_errors)
    errors.add_metric(["disk", "dropped_write"], disk.dropped_writes)
    yield errors
    yield GaugeMetricFamily("ems_pool_disk_queued_bytes", "Evicted bytes waiting to be written", value=disk.queued_bytes)
    yield GaugeMetricFamily("ems_pool_disk_queued_values", "Evicted values waiting to be written", value=disk.queued_values)
    yield GaugeMetricFamily("ems_pool_disk_restored_values", "Values found on the disk at start", value=disk.restored_values)
    yield GaugeMetricFamily("ems_pool_disk_restore_seconds", "Seconds to rebuild the index at start", value=disk.restore_seconds)


class _RepairCollector(Collector):
    def __init__(self, progress: Callable[[], Any]) -> None:
        self.progress = progress

    def collect(self) -> Iterator:
        p = self.progress()
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield g("ems_pool_repair_running", "1 while a repair pass runs", value=float(p.running))
        yield g("ems_pool_repair_pending_keys", "Keys of the pass under way not checked yet", value=p.pending_keys)
        yield c("ems_pool_repair_passes", "Repair passes finished", value=p.passes)
        yield c("ems_pool_repair_abandoned", "Repair passes stopped by a membership change", value=p.abandoned)
        yield c("ems_pool_repair_checked_keys", "Keys repair checked", value=p.checked_keys)
        yield c("ems_pool_repair_copied_values", "Values repair copied to their owners", value=p.copied_values)
        yield c("ems_pool_repair_copied_bytes", "Bytes repair copied to their owners", value=p.copied_bytes)
        yield c("ems_pool_repair_failed_copies", "Copies refused or not acknowledged", value=p.failed_copies)
        yield g("ems_pool_repair_last_pass_seconds", "Duration of the last finished pass", value=p.last_pass_seconds)
        yield g(
            "ems_pool_repair_incomplete", "1 when the last pass left checks or copies undone (retried)", value=float(p.incomplete)
        )


class NodeMetrics:
    """Counters of one pool node; see the module docstring."""

    def __init__(self, store: NodeStore) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ems_pool_requests", "Requests served", ["op", "status"], registry=r)
        self.request_bytes = Counter("ems_pool_request_bytes", "Value bytes received or sent", ["op"], registry=r)
        self.latency = Histogram(
            "ems_pool_request_seconds", "Time to serve one request", ["op"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.auth_failures = Counter("ems_pool_auth_failures", "Clients refused at the handshake", registry=r)
        self.checksum_failures = Counter("ems_pool_checksum_failures", "PUT values refused as damaged", registry=r)
        self.connections = Gauge("ems_pool_connections", "Client connections open now", registry=r)
        self.connections_opened = Counter("ems_pool_connections_opened", "Client connections accepted", registry=r)
        self.unread_discarded = Counter(
            "ems_pool_unread_discarded", "Messages discarded unread (sent on tags nobody would receive)", registry=r
        )
        self.unread_discarded_bytes = Counter(
            "ems_pool_unread_discarded_bytes", "Bytes of the messages discarded unread", registry=r
        )
        self.stray_closes = Counter(
            "ems_pool_stray_closes", "Connections closed for messages on tags they had no request for", registry=r
        )
        self.registry.register(_StoreCollector(store))
        self.namespaces: NamespaceBook | None = None

    def watch_namespaces(self, book: NamespaceBook) -> None:
        """Serve the per-namespace counters (capped labels) and `/namespaces` from `book`."""
        self.namespaces = book
        self.registry.register(book.collector())

    def watch_repair(self, progress: Callable[[], Any]) -> None:
        """Report the node's repair (`progress()` gives an `ems.pool.repair_plan.RepairProgress`) when scraped."""
        self.registry.register(_RepairCollector(progress))

    def watch_shm(self, stats: Callable[[], ShmStats]) -> None:
        """Serve the same-host shared-memory figures, read from `stats()` when scraped."""
        self.registry.register(_ShmCollector(stats))

    def watch_lookups(self, stats: Callable[[], LookupStats]) -> None:
        """Serve the lookup channels' figures (`transport.tcp`), read from `stats()` when scraped."""
        self.registry.register(_LookupCollector(stats))

    def request(self, op: str, ok: bool, seconds: float, nbytes: int = 0) -> None:
        """Count one request (called once per request)."""
        self.requests.labels(op, "ok" if ok else "error").inc()
        self.latency.labels(op).observe(seconds)
        if nbytes:
            self.request_bytes.labels(op).inc(nbytes)

    def count_damaged(self, values: Sequence[Buffer], stored: Sequence[bool]) -> None:
        """Count the refused PUT values that are damaged (called only when a PUT had refusals: rare)."""
        damaged = sum(1 for v, ok in zip(values, stored) if not ok and not is_well_formed(v))
        if damaged:
            self.checksum_failures.inc(damaged)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """`/metrics` and `/healthz` over HTTP; see the module docstring."""

    def __init__(self, host: str, port: int, metrics: NodeMetrics, healthy: Callable[[], bool]) -> None:
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(200, owner.metrics.exposition(), CONTENT_TYPE_LATEST)
                elif path == "/namespaces" and owner.metrics.namespaces is not None:
                    body = json.dumps(owner.metrics.namespaces.report(), sort_keys=True).encode()
                    self._reply(200, body, "application/json")
                elif path == "/healthz":
                    ok = owner.healthy()
                    self._reply(200 if ok else 503, b"ok\n" if ok else b"draining\n", "text/plain")
                else:
                    self._reply(404, b"not found\n", "text/plain")

            def _reply(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.metrics = metrics
        self.healthy = healthy
        self._httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.address = f"{host}:{self._httpd.server_address[1]}"
        self._thread: threading.Thread | None = threading.Thread(
            target=self._httpd.serve_forever, name="ems-pool-metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=5)
            self._thread = None

"""`ems-pool status`: one line per pool node, from the nodes' own metrics.

    ems-pool status --etcd http://HOST:2379 [--cluster NAME] [--interval 1.0] [--timeout 2.0]
    ems-pool status --nodes METRICS_HOST:PORT[,METRICS_HOST:PORT...]
    ems-pool status (--etcd ... | --nodes ...) --namespaces

Contract:
* The node list comes from etcd membership (each node registers its `--metrics` address there) or from `--nodes`
  (their metrics endpoints). Each node's `/metrics` is read twice, `--interval` seconds apart, and parsed with
  `prometheus_client`'s parser.
* Prints a header and one line per node, sorted by address: `NODE STATE HELD/CAPACITY VALUES HIT-RATE REQ/S
  REPAIR COPIED`.
  STATE is `up`, `down` (its metrics did not answer) or `no-metrics` (registered without `--metrics`). HIT-RATE is
  GET hits / (hits + misses) since the node started (`-` before its first GET); REQ/S is requests served per second
  over the interval. REPAIR is the node's repair (`ems.pool.repair`): `idle` (done), `N-left` (a pass is under
  way, N keys still to check), `retry` (the last pass could not reach a peer; another follows within seconds) or
  `-` (the node does not repair); COPIED the values it has copied to their owners since it
  started. A node with a disk tier (`--disk`) gets one more line per tier under its own (NODE `  dram`,
  `  disk`): the tier's state (`up`, or `failed` for a disk that turned the node DRAM-only), held/capacity, values,
  and the share of the node's GET lookups that tier answered. Then a total line.
* `--namespaces` prints instead, per tenant, every key namespace the nodes hold values for, count lookups for, or
  keep a namespace record of (`ems.store.ns_records`), from each node's `/namespaces` (`ems.pool.namespaces`), summed
  over the nodes: `NAMESPACE MODEL VALUES LOOKUPS HIT-RATE READ`, then the record's parts on an indented line and,
  for a namespace whose model has another namespace in the tenant, which parts differ from the closest one
  (`differs from NS: part (this vs that), ...`). A namespace with no record says `parts: unknown` (an engine that
  never published one, or its record was evicted).
* Exit status: 0 when every node is up, 1 when any is down or none is registered, 2 on bad options.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import sys
import time
import urllib.request
from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families

from ems.store.ns_records import NamespaceRecord, differences


@dataclasses.dataclass
class Sample:
    """What one scrape says about a node."""

    held_bytes: float = 0.0
    capacity_bytes: float = 0.0
    values: float = 0.0
    hits: float = 0.0
    misses: float = 0.0
    requests: float = 0.0
    repair_running: float | None = None  # None: the node does not repair
    repair_pending: float = 0.0
    repair_copied: float = 0.0
    repair_incomplete: float = 0.0
    tiers: dict[str, TierSample] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class TierSample:
    """One tier of a node (`ems_pool_tier_*{tier=...}`)."""

    up: float = 1.0
    held_bytes: float = 0.0
    capacity_bytes: float = 0.0
    values: float = 0.0
    hits: float = 0.0


_TIER_FIELDS = {
    "ems_pool_tier_up": "up",
    "ems_pool_tier_bytes": "held_bytes",
    "ems_pool_tier_capacity_bytes": "capacity_bytes",
    "ems_pool_tier_values": "values",
    "ems_pool_tier_hits_total": "hits",
}


@dataclasses.dataclass
class NodeStatus:
    address: str
    metrics: str | None
    state: str
    sample: Sample | None = None
    requests_per_s: float = 0.0

    @property
    def hit_rate(self) -> float | None:
        if self.sample is None or self.sample.hits + self.sample.misses == 0:
            return None
        return self.sample.hits / (self.sample.hits + self.sample.misses)


def parse_metrics(text: str) -> Sample:
    """The figures status needs from one `/metrics` exposition."""
    sample = Sample()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "ems_pool_held_bytes":
                sample.held_bytes = s.value
            elif s.name == "ems_pool_capacity_bytes":
                sample.capacity_bytes = s.value
            elif s.name == "ems_pool_values":
                sample.values = s.value
            elif s.name == "ems_pool_get_hits_total":
                sample.hits = s.value
            elif s.name == "ems_pool_get_misses_total":
                sample.misses = s.value
            elif s.name == "ems_pool_requests_total":
                sample.requests += s.value
            elif s.name == "ems_pool_repair_running":
                sample.repair_running = s.value
            elif s.name == "ems_pool_repair_pending_keys":
                sample.repair_pending = s.value
            elif s.name == "ems_pool_repair_copied_values_total":
                sample.repair_copied = s.value
            elif s.name == "ems_pool_repair_incomplete":
                sample.repair_incomplete = s.value
            elif s.name in _TIER_FIELDS and "tier" in s.labels:
                tier = sample.tiers.setdefault(s.labels["tier"], TierSample())
                setattr(tier, _TIER_FIELDS[s.name], s.value)
    return sample


def scrape(metrics_address: str, timeout_s: float) -> Sample | None:
    """One node's sample, or None when its endpoint does not answer."""
    try:
        with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=timeout_s) as response:
            return parse_metrics(response.read().decode("utf-8"))
    except (OSError, ValueError):
        return None


def collect(nodes: dict[str, str | None], interval_s: float, timeout_s: float) -> list[NodeStatus]:
    """Scrape every node (address → metrics address) twice, `interval_s` apart, all nodes in parallel."""
    addresses = sorted(nodes)
    targets = {a: m for a, m in nodes.items() if m}
    with_metrics = sorted(targets)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(32, len(with_metrics)))) as pool:
        first = dict(zip(with_metrics, pool.map(lambda a: scrape(targets[a], timeout_s), with_metrics)))
        t0 = time.monotonic()
        if interval_s > 0:
            time.sleep(interval_s)
        second = dict(zip(with_metrics, pool.map(lambda a: scrape(targets[a], timeout_s), with_metrics)))
        elapsed = max(time.monotonic() - t0, 1e-9)
    out = []
    for address in addresses:
        if not nodes[address]:
            out.append(NodeStatus(address, None, "no-metrics"))
            continue
        a, b = first.get(address), second.get(address)
        if b is None:
            out.append(NodeStatus(address, nodes[address], "down"))
            continue
        rate = (b.requests - a.requests) / elapsed if a is not None and interval_s > 0 else 0.0
        out.append(NodeStatus(address, nodes[address], "up", b, max(rate, 0.0)))
    return out


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}TiB"


def _repair(s: Sample) -> str:
    if s.repair_running is None:
        return "-"
    if s.repair_running:
        return f"{s.repair_pending:.0f}-left"
    return "retry" if s.repair_incomplete else "idle"


def render(statuses: Sequence[NodeStatus]) -> str:
    rows = [("NODE", "STATE", "HELD/CAPACITY", "VALUES", "HIT-RATE", "REQ/S", "REPAIR", "COPIED")]
    held = capacity = values = rps = copied = 0.0
    for st in statuses:
        if st.sample is None:
            rows.append((st.address, st.state, "-", "-", "-", "-", "-", "-"))
            continue
        s = st.sample
        held, capacity, values, rps = held + s.held_bytes, capacity + s.capacity_bytes, values + s.values, rps + st.requests_per_s
        hit = "-" if st.hit_rate is None else f"{100 * st.hit_rate:.1f}%"
        copied += s.repair_copied
        rows.append(
            (
                st.address,
                st.state,
                f"{_size(s.held_bytes)}/{_size(s.capacity_bytes)}",
                f"{s.values:.0f}",
                hit,
                f"{st.requests_per_s:.1f}",
                _repair(s),
                "-" if s.repair_running is None else f"{s.repair_copied:.0f}",
            )
        )
        if "disk" in s.tiers:
            lookups = s.hits + s.misses
            for name in sorted(s.tiers, key=lambda t: (t != "dram", t)):
                t = s.tiers[name]
                share = "-" if lookups == 0 else f"{100 * t.hits / lookups:.1f}%"
                rows.append(
                    (
                        f"  {name}",
                        "up" if t.up else "failed",
                        f"{_size(t.held_bytes)}/{_size(t.capacity_bytes)}",
                        f"{t.values:.0f}",
                        share,
                        "",
                        "",
                        "",
                    )
                )
    up = sum(st.state == "up" for st in statuses)
    rows.append(
        (
            f"total: {up}/{len(statuses)} up",
            "",
            f"{_size(held)}/{_size(capacity)}",
            f"{values:.0f}",
            "",
            f"{rps:.1f}",
            "",
            f"{copied:.0f}",
        )
    )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# ---- --namespaces ----


@dataclasses.dataclass
class NamespaceRow:
    """One namespace of one tenant, summed over the nodes."""

    tenant: str
    namespace: str  # hex
    values: int = 0
    lookups: int = 0
    hits: int = 0
    nbytes: int = 0
    record: NamespaceRecord | None = None

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None


def scrape_namespaces(metrics_address: str, timeout_s: float) -> dict | None:
    """One node's `/namespaces` report, or None when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{metrics_address}/namespaces", timeout=timeout_s) as response:
            report = json.loads(response.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def merge_namespaces(reports: Sequence[dict]) -> list[NamespaceRow]:
    """Every node's report summed per (tenant, namespace), sorted."""
    rows: dict[tuple[str, str], NamespaceRow] = {}
    for report in reports:
        for tenant, spaces in (report.get("tenants") or {}).items():
            for ns, entry in spaces.items():
                row = rows.setdefault((tenant, ns), NamespaceRow(tenant, ns))
                row.values += int(entry.get("values", 0))
                row.lookups += int(entry.get("lookups", 0))
                row.hits += int(entry.get("hits", 0))
                row.nbytes += int(entry.get("bytes", 0))
                record = entry.get("record")
                if row.record is None and isinstance(record, dict):
                    row.record = NamespaceRecord(
                        str(record.get("model", "?")), bytes.fromhex(ns), dict(record.get("parts") or {})
                    )
    return [rows[k] for k in sorted(rows)]


def _closest(row: NamespaceRow, rows: Sequence[NamespaceRow]) -> tuple[NamespaceRow, list] | None:
    """The other namespace of the same model and tenant that differs from `row` in the fewest parts (ranks of one
    engine, which differ in `tp_rank` only, are siblings, not differences)."""
    if row.record is None:
        return None
    best: tuple[int, str, NamespaceRow, list] | None = None
    for other in rows:
        if other is row or other.tenant != row.tenant or other.record is None or other.record.model != row.record.model:
            continue
        diff = differences(row.record, other.record)
        if not diff or {d[0] for d in diff} == {"tp_rank"}:
            continue
        if best is None or (len(diff), other.namespace) < (best[0], best[1]):
            best = (len(diff), other.namespace, other, diff)
    return None if best is None else (best[2], best[3])


def _short(text: str | None) -> str:
    if text is None:
        return "absent"
    return text if len(text) <= 40 else text[:37] + "..."


def render_namespaces(rows: Sequence[NamespaceRow]) -> str:
    """The `--namespaces` listing (see the module contract)."""
    if not rows:
        return "no namespaces: the nodes hold no values and counted no lookups"
    out: list[str] = []
    for tenant in sorted({r.tenant for r in rows}):
        mine = [r for r in rows if r.tenant == tenant]
        out.append(f"tenant {tenant or '(anonymous)'}: {len(mine)} namespace(s)")
        table = [("NAMESPACE", "MODEL", "VALUES", "LOOKUPS", "HIT-RATE", "READ")]
        details: list[list[str]] = []
        for r in mine:
            hit = "-" if r.hit_rate is None else f"{100 * r.hit_rate:.1f}%"
            model = r.record.model if r.record is not None else "?"
            table.append((r.namespace[:16], _short(model), str(r.values), str(r.lookups), hit, _size(r.nbytes)))
            lines = []
            if r.record is None:
                lines.append("parts: unknown (no record: not published, or evicted)")
            else:
                lines.append("parts: " + "  ".join(f"{k}={_short(v)}" for k, v in sorted(r.record.parts.items())))
                closest = _closest(r, mine)
                if closest is not None:
                    other, diff = closest
                    said = ", ".join(f"{name} ({_short(a)} vs {_short(b)})" for name, a, b in diff)
                    lines.append(f"differs from {other.namespace[:16]}: {said}")
            details.append(lines)
        widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
        out.append("  " + "  ".join(c.ljust(w) for c, w in zip(table[0], widths)).rstrip())
        for t, lines in zip(table[1:], details):
            out.append("  " + "  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip())
            out.extend(f"      {line}" for line in lines)
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ems-pool status", description="One line per pool node, from its metrics.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--etcd", help="etcd endpoint http://HOST:PORT the nodes register in")
    source.add_argument("--nodes", help="comma-separated METRICS_HOST:PORT of each node")
    parser.add_argument("--cluster", default="default", help="the cluster's name in etcd")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between the two scrapes (req/s)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for etcd and for each node")
    parser.add_argument(
        "--namespaces",
        action="store_true",
        help="list, per tenant, the key namespaces the nodes hold: parts, values, hit rates, what differs",
    )
    args = parser.parse_args(argv)
    if args.interval < 0 or args.timeout <= 0:
        parser.error("--interval must be >= 0 and --timeout > 0")
    if args.etcd:
        from ems.cluster.etcd import EtcdClient, EtcdError
        from ems.cluster.membership import read_members

        try:
            members, _ = read_members(EtcdClient(args.etcd, timeout_s=args.timeout), args.cluster)
        except (EtcdError, ValueError) as error:
            print(f"ems-pool status: {error}", file=sys.stderr)
            return 1
        nodes = {address: info.metrics for address, info in members.items()}
    else:
        nodes = {n.strip(): n.strip() for n in args.nodes.split(",") if n.strip()}
    if not nodes:
        print(f"ems-pool status: no nodes registered in cluster {args.cluster!r}", file=sys.stderr)
        return 1
    if args.namespaces:
        targets = sorted(m for m in nodes.values() if m)
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(32, len(targets)))) as pool:
            reports = list(pool.map(lambda m: scrape_namespaces(m, args.timeout), targets))
        print(render_namespaces(merge_namespaces([r for r in reports if r is not None])), flush=True)
        missing = len(nodes) - sum(r is not None for r in reports)
        if missing:
            print(f"ems-pool status: {missing} of {len(nodes)} node(s) did not answer /namespaces", file=sys.stderr)
        return 0 if not missing else 1
    statuses = collect(nodes, args.interval, args.timeout)
    print(render(statuses), flush=True)
    return 0 if all(st.state == "up" for st in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())

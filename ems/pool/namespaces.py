"""A pool node's book of its tenants' key namespaces: record bounds, lookups per namespace, and what it holds.

Contract:
* Record bounds (`refused(keys, lens)`, called by a PUT before anything is stored, on the tenant-prefixed keys): a
  value under a record key (`ems.store.ns_records`) larger than `MAX_RECORD_BYTES`, or a new record key of a tenant
  that already has `max_records` records on this node, is refused (the PUT answers False for it; other keys are
  stored). A request with no record key costs one scan of its joined keys (`bytes.__contains__`), no Python per key.
  Records that left the store (evicted) stop counting: the tenant's set is pruned before a refusal.
* Lookups per namespace (`count(keys, sizes)`: a GET's keys and each found value's bytes, None for a miss;
  `count_flags(keys, flags)`: an EXISTS's): a namespace is the tenant prefix and the 16-byte digest that every key of
  this package starts with (`ems.datapath.keys`; a key too short to hold one is not counted). A request's keys come
  from one call, so one namespace: it is attributed as a whole when its first and last keys share it (one
  comparison; a request whose first and last keys share a namespace is counted there whole), else key by key. At
  most `max_tracked` (tenant, namespace) pairs are kept; the rest are added up under tenant `other`.
* Metrics (`collector()`, registered by `ems.pool.metrics.NodeMetrics.watch_namespaces`):
  `ems_pool_namespace_lookups_total`, `_hits_total`, `_bytes_total` (value bytes sent), labels `tenant` and
  `namespace` (its first 16 hex digits). At most `label_cap` pairs get labels of their own, the first ones seen (so a
  series never moves); later ones are added up under `tenant="other", namespace="other"`.
* `report()`: what `ems-pool status --namespaces` reads (`/namespaces` of the metrics endpoint, operator-facing like
  `/metrics`; engines never see it): per tenant, per namespace, the values held in DRAM, the lookups, hits and bytes
  counted, and the record that describes it (`ems.store.ns_records.NamespaceRecord.to_json`) where this node holds
  one. It walks the store's keys once (on the HTTP thread, only when asked).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ems.buffers import Buffer
from ems.store.ns_records import MAX_RECORD_BYTES, MAX_RECORDS_PER_TENANT, RECORD_MARK, decode_record

NAMESPACE_BYTES = 16
LABEL_CAP = 32
MAX_TRACKED = 4096
OTHER = "other"


class BookStore(Protocol):
    """What the book reads of the node's store (`ems.store.kv_store.KvStore` has it)."""

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...

    def keys(self) -> list[bytes]: ...

    def peek_many(self, keys: Sequence[bytes]) -> list[Buffer | None]: ...


def _tenant_end(key: bytes) -> int:
    """Where the tenant prefix (`ems.pool.node_store.tenant_prefix`: u16 length + id) of a stored key ends."""
    return 2 + int.from_bytes(key[:2], "little")


def namespace_of(key: bytes) -> bytes | None:
    """A stored key's tenant prefix and namespace digest, or None for a key too short to be this package's (a
    namespace and at least a form byte after the tenant prefix: `ems.datapath.keys`)."""
    end = _tenant_end(key) + NAMESPACE_BYTES
    return key[:end] if len(key) > end else None


def _split(ns_key: bytes) -> tuple[str, str]:
    """(tenant, namespace hex) of `namespace_of`'s bytes."""
    end = _tenant_end(ns_key)
    return ns_key[2:end].decode("ascii", "replace"), ns_key[end:].hex()


@dataclass
class Counts:
    lookups: int = 0
    hits: int = 0
    nbytes: int = 0


class NamespaceBook:
    """See the module contract."""

    def __init__(
        self,
        store: BookStore,
        max_records: int = MAX_RECORDS_PER_TENANT,
        label_cap: int = LABEL_CAP,
        max_tracked: int = MAX_TRACKED,
    ) -> None:
        self.store = store
        self.max_records = max_records
        self.label_cap = label_cap
        self.max_tracked = max_tracked
        self._lock = threading.Lock()
        self._records: dict[bytes, set[bytes]] = {}  # tenant prefix -> record keys (tenant-prefixed)
        self._counts: dict[bytes, Counts] = {}  # namespace_of(key) -> counts; b"" is "other"
        self._labelled: dict[bytes, tuple[str, str]] = {}  # the pairs with labels of their own

    # ---- record bounds ----

    def refused(self, keys: Sequence[bytes], lens: Sequence[int] | np.ndarray) -> set[int]:
        """The indices of `keys` (tenant-prefixed) a PUT must refuse: oversize records, records past the count."""
        if not keys or RECORD_MARK not in b"".join(keys):
            return set()
        out: set[int] = set()
        admitted: set[bytes] = set()  # by this request: not in the store yet, so never pruned
        with self._lock:
            for i, (key, n) in enumerate(zip(keys, lens)):
                end = _tenant_end(key)
                if key[end : end + len(RECORD_MARK)] != RECORD_MARK:
                    continue
                if int(n) > MAX_RECORD_BYTES:
                    out.add(i)
                    continue
                tenant = key[:end]
                held = self._records.setdefault(tenant, set())
                if key in held:
                    continue
                if len(held) >= self.max_records:
                    listed = [k for k in held if k not in admitted]
                    held.difference_update(k for k, there in zip(listed, self.store.contains_many(listed)) if not there)
                if len(held) >= self.max_records:
                    out.add(i)
                    continue
                held.add(key)
                admitted.add(key)
        return out

    # ---- lookups ----

    def count(self, keys: Sequence[bytes], sizes: Sequence[int | None]) -> None:
        """Count a GET: `sizes[i]` the bytes of key i's value, None for a miss."""
        if not keys:
            return
        first = namespace_of(keys[0])
        if first is not None and keys[-1].startswith(first) and len(keys[-1]) > len(first):
            found = [s for s in sizes if s is not None]
            self._add(first, len(keys), len(found), sum(found))
            return
        for key, size in zip(keys, sizes):
            self._add(namespace_of(key), 1, int(size is not None), size or 0)

    def count_flags(self, keys: Sequence[bytes], flags: Sequence[bool]) -> None:
        """Count an EXISTS: `flags[i]` whether key i is held."""
        if not keys:
            return
        first = namespace_of(keys[0])
        if first is not None and keys[-1].startswith(first) and len(keys[-1]) > len(first):
            self._add(first, len(keys), sum(flags), 0)
            return
        for key, flag in zip(keys, flags):
            self._add(namespace_of(key), 1, int(flag), 0)

    def _add(self, ns_key: bytes | None, lookups: int, hits: int, nbytes: int) -> None:
        if ns_key is None or ns_key.endswith(RECORD_MARK[:NAMESPACE_BYTES]):
            return  # not this package's key, or a record: not a namespace's lookups
        with self._lock:
            counts = self._counts.get(ns_key)
            if counts is None:
                if len(self._counts) >= self.max_tracked:
                    ns_key = b""
                counts = self._counts.setdefault(ns_key, Counts())
                if ns_key and len(self._labelled) < self.label_cap:
                    tenant, ns_hex = _split(ns_key)
                    self._labelled[ns_key] = (tenant, ns_hex[:16])
            counts.lookups += lookups
            counts.hits += hits
            counts.nbytes += nbytes

    def counts(self) -> dict[tuple[str, str], Counts]:
        """(tenant, namespace hex) -> counts so far (`(other, other)`: past `max_tracked`)."""
        with self._lock:
            return {(_split(k) if k else (OTHER, OTHER)): Counts(c.lookups, c.hits, c.nbytes) for k, c in self._counts.items()}

    def collector(self) -> Any:
        """The metrics' collector (`prometheus_client`, the metrics extra: imported only here)."""
        return _collector(self)

    def labelled(self) -> list[tuple[tuple[str, str], Counts]]:
        """The metric series: each labelled pair's counts, then `(other, other)` for the rest (when any)."""
        out: list[tuple[tuple[str, str], Counts]] = []
        rest = Counts()
        with self._lock:
            for key, c in self._counts.items():
                label = self._labelled.get(key)
                if label is None:
                    rest.lookups, rest.hits, rest.nbytes = rest.lookups + c.lookups, rest.hits + c.hits, rest.nbytes + c.nbytes
                else:
                    out.append((label, Counts(c.lookups, c.hits, c.nbytes)))
        if rest.lookups:
            out.append(((OTHER, OTHER), rest))
        return out

    # ---- the operator's report ----

    def report(self) -> dict[str, Any]:
        """Per tenant, per namespace: values held, lookups, hits, bytes, the record (see the module contract)."""
        stored = self.store.keys()
        held: Counter[bytes | None] = Counter(namespace_of(k) for k in stored)
        record_keys = [k for k in stored if k[_tenant_end(k) : _tenant_end(k) + len(RECORD_MARK)] == RECORD_MARK]
        tenants: dict[str, dict[str, dict[str, Any]]] = {}

        def entry(tenant: str, ns_hex: str) -> dict[str, Any]:
            return tenants.setdefault(tenant, {}).setdefault(
                ns_hex, {"values": 0, "lookups": 0, "hits": 0, "bytes": 0, "record": None}
            )

        for ns_key, n in held.items():
            if ns_key is None or ns_key.endswith(RECORD_MARK[:NAMESPACE_BYTES]):
                continue
            entry(*_split(ns_key))["values"] = n
        for (tenant, ns_hex), c in self.counts().items():
            e = entry(tenant, ns_hex)
            e["lookups"], e["hits"], e["bytes"] = c.lookups, c.hits, c.nbytes
        for key, value in zip(record_keys, self.store.peek_many(record_keys)):
            record = decode_record(value)
            if record is not None:
                entry(key[2 : _tenant_end(key)].decode("ascii", "replace"), record.namespace_hex)["record"] = record.to_json()
        return {"tenants": tenants}


def _collector(book: NamespaceBook) -> Any:
    from prometheus_client.core import CounterMetricFamily
    from prometheus_client.registry import Collector

    class NamespaceCollector(Collector):
        def collect(self) -> Iterator:
            labels = ["tenant", "namespace"]
            lookups = CounterMetricFamily(
                "ems_pool_namespace_lookups", "Keys looked up (GET, EXISTS), by namespace", labels=labels
            )
            hits = CounterMetricFamily("ems_pool_namespace_hits", "Keys found, by namespace", labels=labels)
            nbytes = CounterMetricFamily("ems_pool_namespace_bytes", "Value bytes sent by GET, by namespace", labels=labels)
            for (tenant, ns), c in book.labelled():
                lookups.add_metric([tenant, ns], c.lookups)
                hits.add_metric([tenant, ns], c.hits)
                nbytes.add_metric([tenant, ns], c.nbytes)
            yield lookups
            yield hits
            yield nbytes

    return NamespaceCollector()

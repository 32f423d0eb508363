"""A node's namespace book (`ems.pool.namespaces`) over a real store: metric labels capped (the first namespaces
seen keep theirs, the rest add up under `other`), tracked namespaces bounded, records that left the store no longer
count against their tenant, and the report reads values and records back per tenant."""

from __future__ import annotations

import pytest
from pool_testlib import make_values

from ems.pool.namespaces import NamespaceBook
from ems.pool.node_store import tenant_prefix
from ems.store.kv_store import KvStore
from ems.store.ns_records import RECORD_NAMESPACE, encode_record, make_record, record_key

prometheus = pytest.importorskip("prometheus_client")


def _key(tenant: str, ns: int, i: int) -> bytes:
    return tenant_prefix(tenant) + bytes([ns]) * 16 + b"\x01" + i.to_bytes(4, "little")


def _samples(book: NamespaceBook) -> dict[tuple[str, str, str], float]:
    registry = prometheus.CollectorRegistry()
    registry.register(book.collector())
    from prometheus_client.parser import text_string_to_metric_families

    text = prometheus.generate_latest(registry).decode()
    return {
        (s.name, s.labels["tenant"], s.labels["namespace"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.endswith("_total")
    }


def test_metric_labels_are_capped_and_the_rest_add_up_under_other():
    book = NamespaceBook(KvStore(1 << 20), label_cap=3)
    for ns in range(6):  # six namespaces: three get labels, three go to "other"
        book.count([_key("t", ns, 0), _key("t", ns, 1)], [100, None])
        book.count_flags([_key("t", ns, 2)], [True])
    samples = _samples(book)
    lookups = {k: v for k, v in samples.items() if k[0] == "ems_pool_namespace_lookups_total"}
    assert len(lookups) == 4  # 3 labelled + other
    assert lookups[("ems_pool_namespace_lookups_total", "t", (bytes([0]) * 16).hex()[:16])] == 3
    assert lookups[("ems_pool_namespace_lookups_total", "other", "other")] == 9
    assert samples[("ems_pool_namespace_hits_total", "other", "other")] == 6
    assert samples[("ems_pool_namespace_bytes_total", "other", "other")] == 300
    book.count([_key("t", 9, 0)], [None])  # a later namespace never takes a label: the series do not move
    assert len([k for k in _samples(book) if k[0] == "ems_pool_namespace_lookups_total"]) == 4


def test_tracked_namespaces_are_bounded_and_mixed_requests_are_counted_key_by_key():
    book = NamespaceBook(KvStore(1 << 20), max_tracked=4)
    for ns in range(10):
        book.count([_key("t", ns, 0)], [10])
    counts = book.counts()
    assert len(counts) == 5 and counts[("other", "other")].lookups == 6
    book.count([_key("u", 1, 0), _key("v", 1, 0)], [5, None])  # two tenants in one request
    counts = book.counts()
    assert counts[("other", "other")].lookups == 8  # (past the bound)
    fresh = NamespaceBook(KvStore(1 << 20))
    fresh.count([_key("u", 1, 0), _key("u", 1, 1), _key("v", 2, 0)], [5, 7, None])  # first and last differ
    c = fresh.counts()
    assert (c[("u", (b"\x01" * 16).hex())].lookups, c[("u", (b"\x01" * 16).hex())].hits) == (2, 2)
    assert (c[("v", (b"\x02" * 16).hex())].lookups, c[("v", (b"\x02" * 16).hex())].nbytes) == (1, 0)


def test_records_that_left_the_store_stop_counting_and_the_report_lists_what_is_held():
    store = KvStore(4 << 20)
    book = NamespaceBook(store, max_records=2)
    value = encode_record(make_record("m", b"\x05" * 16, {"tp_size": "2"}))
    keys = [tenant_prefix("t") + record_key("t", "m", slot) for slot in range(3)]
    assert book.refused(keys[:2], [len(value)] * 2) == set()
    assert store.put_many(keys[:2], [[value]] * 2) == [True, True]
    assert book.refused(keys[2:], [len(value)]) == {0}  # the tenant's two are held
    store.delete(keys[0])  # (evicted)
    assert book.refused(keys[2:], [len(value)]) == set()
    assert book.refused([tenant_prefix("other") + keys[0][len(tenant_prefix("t")) :]], [len(value)]) == set()
    assert book.refused([_key("t", 1, 0)], [10**9]) == set()  # not a record: never the book's to refuse

    store.put_many(keys[2:], [[value]])
    values = make_values(3, 64)
    store.put_many([_key("t", 5, i) for i in range(3)], values)
    book.count([_key("t", 5, 0)], [128])
    report = book.report()["tenants"]["t"]
    entry = report[(b"\x05" * 16).hex()]
    assert entry["values"] == 3 and entry["lookups"] == 1 and entry["bytes"] == 128
    assert entry["record"]["parts"] == {"tp_size": "2"} and entry["record"]["model"] == "m"
    assert RECORD_NAMESPACE.hex() not in report and len(report) == 1  # records are not a namespace of their own

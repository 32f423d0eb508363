"""Namespace records (`ems.store.ns_records`) on a node with access keys: a tenant's records are values under its own
keys, so another tenant, even one speaking raw frames, never reads them; and a node keeps records bounded: an
oversize record or one past the tenant's count is refused (False), the rest of the PUT stored."""

from __future__ import annotations

import pytest
from pool_testlib import KEY_A, KEY_B, PoolProcess
from raw_ucx import RawSession

from ems.pool.node_store import tenant_prefix
from ems.store.ns_records import (
    MAX_RECORD_BYTES,
    MAX_RECORDS_PER_TENANT,
    SLOTS,
    decode_record,
    encode_record,
    make_record,
    record_key,
    record_keys,
)
from ems.store.value_format import HEADER_SIZE, MAGIC, VERSION, ValueKind, header_struct, part_checksum
from ems.transport.shm.client import ShmMode

pytestmark = pytest.mark.slow
TENANTS = {"alpha": KEY_A, "beta": KEY_B}
NS = b"\x07" * 16


@pytest.fixture(scope="module")
def keyed_node():
    node = PoolProcess("64MiB", TENANTS)
    yield node
    node.cleanup()


def _record(model: str, parts: dict | None = None) -> bytes:
    return encode_record(make_record(model, NS, parts or {"tp_size": "1"}))


def _oversize() -> bytes:
    """A well-formed value of the record kind, one byte over the bound."""
    payload = b"{" + b"x" * (MAX_RECORD_BYTES - HEADER_SIZE)
    header = header_struct.pack(MAGIC, VERSION, int(ValueKind.NS_RECORD), 0, 0, len(payload), part_checksum(payload))
    return header + payload


def test_another_tenant_never_reads_a_tenants_records_even_with_raw_frames(keyed_node, node_clients):
    alpha = node_clients(keyed_node.address, access_id="alpha", access_key=KEY_A)
    key = record_key("alpha", "secret-model", 0)
    value = _record("secret-model", {"tp_size": "8", "hf_overrides": "{'rope_theta': 5000}"})
    assert alpha.put([key], [[value]], 5.0) == [True]
    assert decode_record(alpha.get([key], 5.0)[0]).parts["tp_size"] == "8"  # the key form is the one engines read

    with RawSession(keyed_node.port) as raw:
        raw.login("beta", KEY_B)
        # alpha's slot keys as alpha's engines name them, as beta's would, and spelt with alpha's tenant prefix
        asked = record_keys("alpha", "secret-model") + record_keys("beta", "secret-model")
        asked += [tenant_prefix("alpha") + k for k in record_keys("alpha", "secret-model")[:4]]
        assert raw.get(asked) == [None] * len(asked)
    beta = node_clients(keyed_node.address, access_id="beta", access_key=KEY_B)
    assert beta.exists([key], 5.0) == [False]
    assert beta.put([key], [[_record("beta-model")]], 5.0) == [True]  # beta's own value under the same bytes
    assert decode_record(alpha.get([key], 5.0)[0]).model == "secret-model"  # alpha's untouched


@pytest.mark.parametrize("shm", [ShmMode.AUTO, ShmMode.OFF])  # a same-host PUT through shared memory, and over UCX
def test_an_oversize_record_is_refused_and_the_rest_of_the_put_stored(keyed_node, node_clients, shm):
    alpha = node_clients(keyed_node.address, access_id="alpha", access_key=KEY_A, shm=shm)
    big = _oversize()
    assert len(big) == MAX_RECORD_BYTES + 1
    model = f"big-{shm.value}"
    keys = [record_key("alpha", model, 1), f"plain-{shm.value}".encode(), record_key("alpha", model, 2)]
    assert alpha.put(keys, [[big], [big], [_record(model)]], 5.0) == [False, True, True]
    assert alpha.get(keys[:1], 5.0) == [None]


@pytest.mark.parametrize("shm", [ShmMode.AUTO, ShmMode.OFF])
def test_records_past_a_tenants_count_are_refused_and_other_tenants_are_not_affected(node_clients, shm):
    node = PoolProcess("64MiB", TENANTS)  # a fresh node: the count is per node
    try:
        alpha = node_clients(node.address, access_id="alpha", access_key=KEY_A, shm=shm)
        beta = node_clients(node.address, access_id="beta", access_key=KEY_B, shm=shm)
        keys = [record_key("alpha", f"m{i // SLOTS}", i % SLOTS) for i in range(MAX_RECORDS_PER_TENANT + 10)]
        value = _record("m")
        stored = alpha.put(keys, [[value]] * len(keys), 5.0)
        assert stored == [True] * MAX_RECORDS_PER_TENANT + [False] * 10
        assert alpha.put(keys[:3], [[value]] * 3, 5.0) == [True] * 3  # records it holds may be rewritten
        assert alpha.put([record_key("alpha", "late", 0)], [[value]], 5.0) == [False]
        assert alpha.put([b"an-ordinary-key"], [[value]], 5.0) == [True]
        assert beta.put([record_key("beta", "m", 0)], [[value]], 5.0) == [True]
    finally:
        node.cleanup()

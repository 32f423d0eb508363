"""A lookup is a promise, against a real pool node: an EXISTS that asks for a lease keeps the keys it reports from
eviction until they are read or the lease's time has passed, within half the node's capacity; a pin keeps a key
through any flood."""

from __future__ import annotations

import time

import pytest
from pool_testlib import joined, make_values

from ems.transport import metas, protocol
from ems.transport.exists_holds import Hold, decode_exists_meta, encode_exists_meta

pytestmark = pytest.mark.slow

VALUE = 64 << 10  # payload bytes of each value: a 4 MiB node holds about 60


def flood(client, tag: str, nbytes: int) -> None:
    """Write `nbytes` of fresh values (evicting whatever the node lets go)."""
    n = max(1, nbytes // VALUE)
    for start in range(0, n, 8):
        count = min(8, n - start)
        keys = [f"{tag}-{start + i}".encode() for i in range(count)]
        client.put(keys, make_values(count, VALUE, seed=start), 10.0)


def test_leased_keys_outlive_eviction_until_they_are_read(pool_nodes, node_clients):
    node = pool_nodes("4MiB")
    reader, writer = node_clients(node.address), node_clients(node.address)
    leased = [f"leased-{i}".encode() for i in range(6)]
    plain = [f"plain-{i}".encode() for i in range(6)]
    values = make_values(12, VALUE, seed=1)
    assert all(writer.put(leased + plain, values, 10.0))
    assert reader.exists(leased, 5.0, Hold.lease(30_000)) == [True] * 6
    flood(writer, "a", 12 << 20)  # three times the node
    assert reader.exists(plain, 5.0) == [False] * 6  # the unleased values went
    got = reader.get(leased, 5.0)  # the load the lookup promised: every value, and it ends the leases
    assert [bytes(v) for v in got] == [joined(v) for v in values[:6]]
    flood(writer, "b", 12 << 20)
    assert reader.exists(leased, 5.0) == [False] * 6  # read once: evictable again


def test_a_lease_ends_with_its_time(pool_nodes, node_clients):
    node = pool_nodes("4MiB")
    client = node_clients(node.address)
    keys = [f"k{i}".encode() for i in range(4)]
    assert all(client.put(keys, make_values(4, VALUE), 10.0))
    assert client.exists(keys, 5.0, Hold.lease(200)) == [True] * 4
    time.sleep(0.5)
    flood(client, "f", 12 << 20)
    assert client.exists(keys, 5.0) == [False] * 4


def test_leases_stay_within_half_the_capacity(pool_nodes, node_clients):
    """A lookup that asks for more than the node will keep is told the prefix it keeps: never a promise it could
    not hold."""
    node = pool_nodes("4MiB")
    client = node_clients(node.address)
    keys = [f"k{i:02d}".encode() for i in range(48)]  # 3 MiB
    for start in range(0, 48, 8):
        assert all(client.put(keys[start : start + 8], make_values(8, VALUE, seed=start), 10.0))
    held = client.exists(keys, 5.0)
    kept = client.exists(keys, 5.0, Hold.lease(30_000))
    m = sum(kept)
    assert kept == [True] * m + [False] * (len(keys) - m)  # granted in key order, until the budget is used up
    assert 20 <= m <= 32 and sum(held) > m  # half of 4 MiB is 32 values of 64 KiB (with their overhead, fewer)
    flood(client, "f", 12 << 20)
    assert client.exists(keys[:m], 5.0) == [True] * m


def test_a_pinned_record_survives_any_flood(pool_nodes, node_clients):
    node = pool_nodes("4MiB")
    client = node_clients(node.address)
    record = make_values(1, 16, seed=9)
    assert client.put([b"epoch"], record, 5.0) == [True]
    assert client.exists([b"epoch", b"absent"], 5.0, Hold.pin()) == [True, False]
    flood(client, "f", 16 << 20)
    assert [bytes(v) for v in client.get([b"epoch"], 5.0)] == [joined(record[0])]
    flood(client, "g", 16 << 20)  # a read does not end a pin
    assert client.exists([b"epoch"], 5.0) == [True]


def test_exists_meta_with_a_hold():
    keys_meta = metas.encode_keys_meta([b"k1", b"k2"])
    lease = Hold.lease(1500)
    assert decode_exists_meta(lease.flags, encode_exists_meta(keys_meta, lease)) == (lease, keys_meta)
    assert decode_exists_meta(Hold.pin().flags, encode_exists_meta(keys_meta, Hold.pin())) == (Hold.pin(), keys_meta)
    assert decode_exists_meta(0, keys_meta) == (None, keys_meta)
    with pytest.raises(protocol.ProtocolError):
        decode_exists_meta(int(protocol.Flags.LEASE | protocol.Flags.PIN), keys_meta)
    with pytest.raises(protocol.ProtocolError):
        decode_exists_meta(int(protocol.Flags.LEASE), b"\x00\x00")  # shorter than its lease
    with pytest.raises(protocol.ProtocolError):
        decode_exists_meta(int(protocol.Flags.LEASE), (10**6).to_bytes(4, "little") + keys_meta)  # past the limit
    for bad in (0, -1, 60_001, True, 1.5):
        with pytest.raises(ValueError):
            Hold.lease(bad)  # type: ignore[arg-type]

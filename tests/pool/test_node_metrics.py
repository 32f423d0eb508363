"""A node's `--metrics` endpoint: parsed with prometheus_client's parser, every counter moves with what it counts."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest
from cluster_testlib import free_port
from pool_testlib import KEY_A, KEY_B, PoolProcess, make_values, scrape_metrics

from ems.transport.base import TransportError
from ems.transport.ucx.remote import connect

parser = pytest.importorskip("prometheus_client.parser")


def test_counters_follow_requests_refusals_and_connections():
    metrics = f"127.0.0.1:{free_port()}"
    node = PoolProcess("4MiB", keys={"alpha": KEY_A}, args=["--metrics", metrics])
    client = None
    try:
        with urllib.request.urlopen(f"http://{metrics}/healthz", timeout=5) as r:
            assert r.status == 200 and r.read() == b"ok\n"
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://{metrics}/other", timeout=5)
        m0 = scrape_metrics(metrics)
        assert m0[("ems_pool_capacity_bytes", ())] == 4 << 20
        assert m0[("ems_pool_values", ())] == 0 and m0[("ems_pool_connections", ())] == 0

        with pytest.raises(TransportError):
            connect(node.address, access_id="alpha", access_key=KEY_B, connect_timeout_ms=2000)
        client = connect(node.address, access_id="alpha", access_key=KEY_A, connect_timeout_ms=2000)
        values = make_values(6, 100_000)
        damaged = [values[5][0], values[5][1][:-1] + bytes([values[5][1][-1] ^ 0xFF])]
        keys = [f"k{i}".encode() for i in range(6)]
        assert client.put(keys, values[:5] + [damaged], 5.0) == [True] * 5 + [False]
        assert [v is not None for v in client.get(keys + [b"none"], 5.0)] == [True] * 5 + [False, False]
        assert client.exists(keys[:2], 5.0) == [True, True]
        big = make_values(12, 500_000)  # 6 MB into 4 MiB: evictions
        assert all(client.put([f"b{i}".encode() for i in range(12)], big, 5.0))

        # a request is counted once its reply is sent, and the refused connection is closed a moment after its
        # refusal: the last of either may still be finishing on the node
        deadline = time.monotonic() + 10
        while True:
            m = scrape_metrics(metrics)
            settled = (
                m.get(("ems_pool_requests_total", (("op", "put"), ("status", "ok")))) == 2
                and m.get(("ems_pool_connections", ())) == 1
            )
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert m[("ems_pool_auth_failures_total", ())] == 1
        assert m[("ems_pool_checksum_failures_total", ())] == 1
        assert m[("ems_pool_rejected_puts_total", ())] == 1
        assert m[("ems_pool_requests_total", (("op", "put"), ("status", "ok")))] == 2
        assert m[("ems_pool_requests_total", (("op", "get"), ("status", "ok")))] == 1
        assert m[("ems_pool_requests_total", (("op", "exists"), ("status", "ok")))] == 1
        assert m[("ems_pool_get_hits_total", ())] == 5 and m[("ems_pool_get_misses_total", ())] == 2
        assert m[("ems_pool_request_bytes_total", (("op", "put"),))] >= 5 * 100_000 + 12 * 500_000
        assert m[("ems_pool_request_bytes_total", (("op", "get"),))] >= 5 * 100_000
        assert m[("ems_pool_request_seconds_count", (("op", "put"),))] == 2
        assert m[("ems_pool_evictions_total", ())] > 0
        assert 0 < m[("ems_pool_held_bytes", ())] <= 4 << 20
        assert m[("ems_pool_connections", ())] == 1  # the refused one is closed
        assert m[("ems_pool_connections_opened_total", ())] == 2
    finally:
        if client is not None:
            client.close()
        node.cleanup()


def test_metrics_port_taken_exits_1():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(RuntimeError, match="did not start"):
            PoolProcess("4MiB", args=["--metrics", f"127.0.0.1:{s.getsockname()[1]}"])

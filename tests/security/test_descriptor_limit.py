"""Issue 16, item 5: junk TCP connections on a node's listening port neither lock it out at its descriptor limit
nor break the real clients that connect right after them (`transport.ucx.sockets`, `ucx.config`: UCX_LOG_FILE)."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from pool_testlib import joined, make_values, wait_until

from ems.transport.ucx.client import UcxNode

pytestmark = pytest.mark.slow
JUNK = np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes()


def _junk_burst(port: int, count: int) -> None:
    """`count` raw TCP connections that each send ~3 KB of junk instead of a UCX handshake, then close."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(JUNK)
            sockets.append(s)
        time.sleep(0.2)
    finally:
        for s in sockets:
            s.close()


def _fresh_ping(address: str) -> bool:
    client = UcxNode(address, connect_timeout_ms=2000)
    try:
        return client.ping(2.0)
    finally:
        client.close()


def test_a_node_at_its_descriptor_limit_recovers_by_itself(pool_nodes):
    node = pool_nodes("8MiB", nofile=256)
    assert wait_until(lambda: _fresh_ping(node.address), 10.0, 0.2)
    _junk_burst(node.port, 300)  # more than the node has descriptors: the rest wait in the listen backlog
    t0 = time.monotonic()
    assert wait_until(lambda: _fresh_ping(node.address), 20.0, 0.2), node.fd_count()
    assert time.monotonic() - t0 < 20.0  # before: still locked out after 90 s
    assert wait_until(lambda: node.close_wait_sockets() == 0, 15.0, 0.5), node.close_wait_sockets()
    assert node.proc.poll() is None


def test_real_clients_right_after_a_junk_burst_are_served(pool_nodes):
    node = pool_nodes("64MiB", args=("--max-connections-per-peer", "1000"))  # a new client per try, quickly
    values = make_values(2, 200_000, seed=3)
    failures: list = []
    for burst in range(2):
        _junk_burst(node.port, 30)
        stop = time.monotonic() + 5.0  # while the junk sockets are found and released, and their numbers reused
        i = 0
        while time.monotonic() < stop:
            client = UcxNode(node.address, connect_timeout_ms=2000)
            try:
                keys = [f"b{burst}-{i}-{j}".encode() for j in range(2)]
                assert client.put(keys, values, 3.0) == [True, True]
                got = client.get(keys, 3.0)
                assert [bytes(g) for g in got] == [joined(v) for v in values]
            except Exception as error:  # a failed client is the defect: collect, do not stop
                failures.append((burst, i, repr(error)))
            finally:
                client.close()
            i += 1
    notes = [line for line in node.log_text().splitlines() if " WARNING " in line or " INFO " in line]
    assert not failures, (failures[:5], notes[-12:])
    assert "closed" in node.log_text()

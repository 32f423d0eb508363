"""Pool-node processes on loopback: command line, eviction, a SIGSTOPped node, restarts, authentication and tenant
isolation. Routing over several nodes and a node killed mid-run are tested across hosts, where every byte crosses
a wire: `tests/pool/test_hosts_cluster.py`."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from ems_testlib import keyed
from pool_testlib import KEY_A, KEY_B, READY_PREFIX, joined, make_values, read_line, tcp_sockets, wait_until

from ems.backends.pool_client import PoolClient
from ems.errors import EmsErrorCode
from ems.pool.options import parse_keys
from ems.transport.base import TransportError
from ems.transport.ucx.remote import connect
from ems.types import CcKvOption

pytestmark = pytest.mark.slow
MARGIN_S = 0.5


# ---- command line ----


def test_ready_line_and_clean_sigterm(pool_nodes, node_clients):
    node = pool_nodes()
    assert node.port > 0
    assert node_clients(node.address).ping(2.0)
    assert node.terminate() == 0
    assert "Traceback" not in node.log_text()


def test_a_node_never_loads_torch(pool_nodes, node_clients, tmp_path):
    """A pool node serves without torch (nor triton): it used to load it through the store's copy helpers, 250+ MiB
    of resident memory at rest for a node of 8 MiB. Checked in the running node's own mappings, after a save and a
    load through both paths (UCX and same-host shared memory), on a node with a disk tier."""
    from ems.transport.shm.client import ShmMode

    node = pool_nodes("8MiB", args=("--disk", str(tmp_path), "--disk-capacity", "64MiB"))
    values = make_values(3, 300_000)
    for shm in (ShmMode.OFF, ShmMode.AUTO):
        client = node_clients(node.address, shm=shm)
        keys = [f"{shm.value}-{i}".encode() for i in range(3)]
        assert client.put(keys, values, 5.0) == [True] * 3
        outs = [np.empty(len(joined(v)), np.uint8) for v in values]
        assert client.get_into(keys, outs, 5.0) == [True] * 3
    with open(f"/proc/{node.proc.pid}/maps", encoding="ascii", errors="replace") as maps:
        loaded = {line.split()[-1].rsplit("/", 1)[-1] for line in maps if "/" in line}
    assert not {name for name in loaded if name.startswith(("libtorch", "libc10", "libtriton"))}, sorted(loaded)


def test_sigint_stops_cleanly(pool_nodes):
    node = pool_nodes()
    node.proc.send_signal(signal.SIGINT)
    assert node.proc.wait(10) == 0


@pytest.mark.parametrize(
    "args", [["--capacity", "lots"], ["--listen", "nohost"], ["--capacity", "0"], ["--keys-file", "/nonexistent"]]
)
def test_bad_options_exit_2(args):
    proc = subprocess.run([sys.executable, "-m", "ems.pool", *args], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and READY_PREFIX not in proc.stdout, (proc.stdout, proc.stderr)


def test_help_names_the_status_command(capsys):
    from ems.pool.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "ems-pool status (--etcd URL [--cluster NAME] | --nodes METRICS_HOST:PORT,...)" in out, out


def test_keys_file_and_env(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    path.write_text(f"# tenants\nalpha:{KEY_A}\n\nbeta:{KEY_B}\n")
    assert parse_keys(path.read_text().splitlines(), "f") == {"alpha": KEY_A, "beta": KEY_B}
    with pytest.raises(ValueError, match="entry 1"):
        parse_keys(["alpha:short"], "f")
    with pytest.raises(ValueError):
        parse_keys(["t\u00e9nant:" + KEY_A], "f")  # ids are printable ASCII
    with pytest.raises(ValueError):
        parse_keys([":" + KEY_A], "f")
    # ids as deployments write them: '@', upper case, even ':' (the key never holds one)
    assert parse_keys(["cc_kvstore@_@ns:001:" + KEY_A, "Upper:" + KEY_B], "f") == {"cc_kvstore@_@ns:001": KEY_A, "Upper": KEY_B}


def test_keys_file_node_authenticates(tmp_path, node_clients):
    path = tmp_path / "keys"
    path.write_text(f"alpha:{KEY_A}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ems.pool", "--listen", "127.0.0.1:0", "--keys-file", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = read_line(proc, 30)
        assert line.startswith(READY_PREFIX)
        address = line.split()[-1]
        assert node_clients(address, access_id="alpha", access_key=KEY_A).ping(2.0)
        assert not node_clients(address).ping(2.0)
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


# ---- storage ----


def test_eviction_under_pressure(pool_nodes, node_clients):
    node = node_clients(pool_nodes(capacity="8MiB").address)
    values = make_values(24, 512 * 1024)
    keys = [f"e{i}".encode() for i in range(24)]
    for i in range(0, 24, 4):  # 12 MiB into 8 MiB, in batches
        assert all(node.put(keys[i : i + 4], values[i : i + 4], 5.0))
    held = node.exists(keys, 5.0)
    assert not held[0] and all(held[-8:])  # the oldest went, the newest stay
    assert 10 <= sum(held) < 16
    got = node.get(keys[-4:], 5.0)
    assert [bytes(g) for g in got] == [joined(v) for v in values[-4:]]
    # a value larger than the whole node is refused, not an out-of-memory
    assert node.put([b"huge"], make_values(1, 9 << 20), 10.0) == [False]


# ---- three nodes ----


def _three(pool_nodes, **kw):
    nodes = [pool_nodes() for _ in range(3)]
    clients = [connect(n.address, connect_timeout_ms=2000) for n in nodes]
    return nodes, PoolClient(clients)


def test_sigstopped_node_costs_only_the_timeout(pool_nodes):
    nodes, pool = _three(pool_nodes)
    try:
        keys = [f"s{i}".encode() for i in range(30)]
        values = make_values(30, 10_000)
        assert all(pool.put(keyed(keys, CcKvOption(timeout=3000)), values).results)
        nodes[2].pause()
        for timeout_ms in (300, 800):
            option = CcKvOption(timeout=timeout_ms)
            for call in (
                lambda: pool.get(keyed(keys, option)),
                lambda: pool.exists(keyed(keys, option)),
                lambda: pool.put(keyed(keys, option), values),
            ):
                t0 = time.monotonic()
                out = call()
                elapsed = time.monotonic() - t0
                assert elapsed < timeout_ms / 1000 + MARGIN_S, elapsed
                assert len(out.errors) == 1
                assert sum(bool(r) for r in out.results) > 0  # the other nodes answered
            time.sleep(0.6)  # past the reconnect back-off, so the next round really waits on the hung node
        # the client thread is not stuck: one direct call also returns within its timeout
        direct = pool.nodes[2]
        t0 = time.monotonic()
        with pytest.raises(TransportError) as info:
            direct.get(keys, 0.4)
        assert time.monotonic() - t0 < 0.4 + MARGIN_S
        assert info.value.status_code() == EmsErrorCode.EMS_IO_TIMEOUT
        nodes[2].resume()
        assert wait_until(lambda: direct.ping(1.0), 10.0)
    finally:
        pool.close()


def test_restarted_node_client_reconnects(pool_nodes, node_clients):
    node = pool_nodes()
    client = node_clients(node.address)
    values = make_values(2, 5000)
    assert all(client.put([b"a", b"b"], values, 5.0))
    node.restart()  # same port, empty store
    with pytest.raises(TransportError):
        client.get([b"a"], 2.0)  # the old connection is gone
    assert wait_until(lambda: client.ping(1.0), 10.0)
    assert client.get([b"a"], 2.0) == [None]  # a restarted node is empty: a miss, never a wrong block
    assert all(client.put([b"a"], values[:1], 5.0))


def test_backoff_does_not_hammer(pool_nodes, node_clients):
    node = pool_nodes()
    client = node_clients(node.address)
    assert client.ping(2.0)
    node.kill()
    with pytest.raises(TransportError):
        client.get([b"x"], 1.0)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="next reconnect attempt"):
        client.get([b"x"], 1.0)
    assert time.monotonic() - t0 < 0.1


# ---- access ----


def test_wrong_or_missing_key_is_refused(pool_nodes, node_clients):
    node = pool_nodes(keys={"alpha": KEY_A})
    for kwargs in ({}, {"access_id": "alpha", "access_key": KEY_B}, {"access_id": "other", "access_key": KEY_A}):
        with pytest.raises(TransportError) as info:
            connect(node.address, connect_timeout_ms=2000, **kwargs)
        assert info.value.status_code() == EmsErrorCode.EMS_IO_ERROR
        assert "authentication failed" in info.value.message()
    good = connect(node.address, access_id="alpha", access_key=KEY_A, connect_timeout_ms=2000)
    try:
        assert good.ping(1.0)
    finally:
        good.close()
    assert KEY_A not in node.log_text()


def test_tenants_are_isolated(pool_nodes, node_clients):
    node = pool_nodes(keys={"alpha": KEY_A, "beta": KEY_B})
    a = node_clients(node.address, access_id="alpha", access_key=KEY_A)
    b = node_clients(node.address, access_id="beta", access_key=KEY_B)
    va, vb = make_values(1, 3000, seed=1), make_values(1, 3000, seed=2)
    assert a.put([b"same-key"], va, 5.0) == [True]
    assert b.exists([b"same-key"], 5.0) == [False]
    assert b.get([b"same-key"], 5.0) == [None]
    assert b.put([b"same-key"], vb, 5.0) == [True]  # b's own key, not an overwrite of a's
    assert bytes(a.get([b"same-key"], 5.0)[0]) == joined(va[0])
    assert bytes(b.get([b"same-key"], 5.0)[0]) == joined(vb[0])


def test_anonymous_node_accepts_anyone(shared_node, node_clients):
    assert node_clients(shared_node.address).ping(2.0)
    assert node_clients(shared_node.address, access_id="alpha", access_key=KEY_A).ping(2.0)


# ---- --listen binds where it says (issue 7) ----


def _listening_addresses(pid: int) -> set[str]:
    """Local addresses of the TCP sockets `pid` listens on (IPv4, as dotted quads)."""
    import socket
    import struct

    out = set()
    for fields in tcp_sockets(pid, "0A"):
        addr = fields[1].split(":")[0]
        out.add(socket.inet_ntoa(struct.pack("<I", int(addr, 16))) if len(addr) == 8 else addr)
    return out


def test_listen_on_loopback_binds_only_loopback(pool_nodes, node_clients):
    node = pool_nodes()  # --listen 127.0.0.1:0
    assert node_clients(node.address).ping(2.0)
    addresses = _listening_addresses(node.proc.pid)
    assert addresses == {"127.0.0.1"}, addresses
    values = make_values(2, 3 << 20, seed=9)
    client = node_clients(node.address)
    assert client.put([b"l0", b"l1"], values, 5.0) == [True, True]
    assert [bytes(v) for v in client.get([b"l0", b"l1"], 5.0)] == [joined(v) for v in values]


def test_listen_on_an_address_of_no_interface_refuses_to_start():
    proc = subprocess.run(
        [sys.executable, "-m", "ems.pool", "--listen", "192.0.2.123:0", "--capacity", "8MiB"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and READY_PREFIX not in proc.stdout, (proc.stdout, proc.stderr[-2000:])
    assert "cannot listen on 192.0.2.123:0" in proc.stderr

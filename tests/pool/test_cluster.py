"""A pool on etcd membership, with real processes on 127.0.0.1: etcd, pool nodes registered through it, engines.

One scenario (processes are slow to start, so the steps share them): two engines (replicas=2 and replicas=1) save;
a node joins and new saves reach it; a node is killed (replicas=2: every earlier block still loads byte-exact;
replicas=1: its blocks miss, nothing wrong is served); a node drains on SIGTERM under traffic (no call fails);
etcd is stopped (engines keep serving) and restarted (engines see a join again). Node metrics are parsed with
prometheus_client's parser and move with the traffic; `ems-pool status` lists the nodes.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from cluster_testlib import ClusterNode, Engine

pytestmark = pytest.mark.slow
prometheus_parser = pytest.importorskip("prometheus_client.parser")


def _samples(text: str) -> dict[tuple, float]:
    """{(name, sorted labels): value} of one exposition, parsed by prometheus_client."""
    out = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ems.pool", "status", *args], capture_output=True, text=True, timeout=60, check=False
    )


def _healthz(node: ClusterNode) -> int:
    try:
        with urllib.request.urlopen(f"http://{node.metrics_address}/healthz", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_grow_kill_drain_and_etcd_restart(etcd):
    cluster = "scenario"
    nodes = [ClusterNode(etcd.url, cluster) for _ in range(3)]
    engines: list[Engine] = []
    try:
        e2 = Engine(etcd=etcd.url, cluster=cluster, replicas=2, hash_base=0)
        e1 = Engine(etcd=etcd.url, cluster=cluster, replicas=1, hash_base=1_000_000)
        engines += [e2, e1]
        live = {n.address for n in nodes}
        for e in engines:
            e.wait_members(live)

        # saves land on the three nodes; metrics move with them
        before = _samples(nodes[0].scrape())
        first = list(range(32))
        assert e2.call(op="save", blocks=first)["saved"] == [1] * 32
        assert e1.call(op="save", blocks=first)["saved"] == [1] * 32
        assert e2.call(op="load", blocks=first)["result"] == ["hit"] * 32
        after = _samples(nodes[0].scrape())
        assert _value(after, "ems_pool_requests_total", op="put", status="ok") > _value(
            before, "ems_pool_requests_total", op="put", status="ok"
        )
        assert _value(after, "ems_pool_values") > 0 and _value(after, "ems_pool_held_bytes") > 0
        assert _value(after, "ems_pool_capacity_bytes") == 128 << 20
        assert _value(after, "ems_pool_request_bytes_total", op="put") > 0
        assert _value(after, "ems_pool_get_hits_total") > _value(before, "ems_pool_get_hits_total")
        assert _value(after, "ems_pool_request_seconds_count", op="get") > 0
        assert _value(after, "ems_pool_connections") >= 2  # both engines
        assert _value(after, "ems_pool_auth_failures_total") == 0
        m = e2.call(op="metrics")
        assert m["save_blocks_ok"] == 32 and m["load_blocks_ok"] == 32 and m["save_gbps"] > 0

        # the operator's view: every node up, with its values
        status = _status("--etcd", etcd.url, "--cluster", cluster, "--interval", "0.2")
        assert status.returncode == 0, status.stderr
        lines = status.stdout.strip().splitlines()
        assert lines[0].split() == ["NODE", "STATE", "HELD/CAPACITY", "VALUES", "HIT-RATE", "REQ/S", "REPAIR", "COPIED"]
        rows = {line.split()[0]: line.split() for line in lines[1:-1]}
        assert set(rows) == live and all(r[1] == "up" for r in rows.values())
        assert sum(int(r[3]) for r in rows.values()) == 2 * 32 + 32  # replicas=2 and replicas=1 copies
        assert lines[-1].startswith("total: 3/3 up")

        # a node joins: engines see it without restarting, and new saves use it
        joiner = ClusterNode(etcd.url, cluster)
        nodes.append(joiner)
        live.add(joiner.address)
        for e in engines:
            e.wait_members(live)
        second = list(range(32, 64))
        assert e1.call(op="save", blocks=second)["saved"] == [1] * 32
        assert _value(_samples(joiner.scrape()), "ems_pool_puts_total") > 0

        # a node is killed (not yet expired from etcd): replicas=2 still loads every earlier block byte-exact
        victim = nodes[0]
        victim.kill()
        assert e2.call(op="load", blocks=first)["result"] == ["hit"] * 32
        r1 = e1.call(op="load", blocks=first + second)["result"]
        assert set(r1) <= {"hit", "miss"}, r1  # nothing wrong is served, no call raises
        assert r1.count("miss") > 0 and r1.count("hit") > 0
        live.discard(victim.address)
        for e in engines:
            e.wait_members(live, timeout_s=10)  # its lease (2 s) expired
        assert e2.call(op="load", blocks=first)["result"] == ["hit"] * 32
        down = _status("--nodes", f"{victim.metrics_address},{nodes[1].metrics_address}", "--interval", "0")
        assert down.returncode == 1 and " down " in down.stdout and " up " in down.stdout

        # a node drains on SIGTERM while an engine saves and loads: no call fails because of it
        e2.send(op="traffic", seconds=3.0, blocks=list(range(12)))
        time.sleep(1.0)
        drained = nodes[1]
        drained.proc.terminate()
        assert _wait(lambda: _healthz(drained) == 503, 5)  # deregistered, still serving for --drain seconds
        assert drained.proc.wait(20) == 0
        traffic = e2.reply(60)
        assert traffic["calls"] > 0 and traffic["errors"] == 0 and traffic["wrong"] == 0, traffic
        live.discard(drained.address)
        e2.wait_members(live)

        # etcd stops: engines keep the last membership and keep serving
        etcd.stop()
        assert _wait(lambda: not e2.call(op="members")["connected"], 10)
        assert set(e2.call(op="members")["members"]) == live
        assert e2.call(op="save", blocks=[0, 1, 2])["saved"] == [1, 1, 1]
        assert e2.call(op="load", blocks=[0, 1, 2])["result"] == ["hit"] * 3
        assert e1.call(op="load", blocks=second)["result"].count("wrong") == 0

        # etcd is back: registrations survive, and engines see changes again
        etcd.start()
        late = ClusterNode(etcd.url, cluster)
        nodes.append(late)
        live.add(late.address)
        for e in engines:
            e.wait_members(live, timeout_s=15)
        assert e2.call(op="members")["connected"]
        assert e2.call(op="save", blocks=list(range(8)))["saved"] == [1] * 8
        assert e2.call(op="load", blocks=list(range(8)))["result"] == ["hit"] * 8
    finally:
        for e in engines:
            e.close()
        for n in nodes:
            n.cleanup()
        if etcd.proc is None or etcd.proc.poll() is not None:
            etcd.start()  # leave the module's etcd running for later tests


def test_node_exits_1_when_etcd_is_unreachable_and_status_reports_it(etcd):
    from cluster_testlib import free_port
    from pool_testlib import PoolProcess

    with pytest.raises(RuntimeError, match="did not start"):
        PoolProcess("16MiB", args=["--etcd", f"http://127.0.0.1:{free_port()}", "--lease-ttl", "2"]).cleanup()
    status = _status("--etcd", f"http://127.0.0.1:{free_port()}", "--timeout", "0.5")
    assert status.returncode == 1 and "unreachable" in status.stderr
    empty = _status("--etcd", etcd.url, "--cluster", "nobody-here")
    assert empty.returncode == 1 and "no nodes registered" in empty.stderr


def test_engine_init_fails_clearly_without_etcd(clean_ems):
    from cluster_testlib import free_port

    from ems import CcConfig, Ems, EmsConfig, EmsErrorCode, EmsException

    with pytest.raises(EmsException) as info:
        Ems.init(
            EmsConfig(
                cc_config=CcConfig(rank_id=0, device_id=0, model_id="m"),
                pool_etcd=f"http://127.0.0.1:{free_port()}",
                connect_timeout_ms=500,
            )
        )
    assert info.value.status_code() == EmsErrorCode.EMS_RECOVERD_ERROR and "pool_etcd" in info.value.message()

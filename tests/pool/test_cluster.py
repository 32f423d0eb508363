"""A pool on etcd membership, with real processes on 127.0.0.1: what happens without a reachable etcd (a node exits 1,
`ems-pool status` says so, `Ems.init` fails recoverably). The cluster scenario itself (joins, a node killed and
drained, etcd stopped and back, metrics and status) runs on hosts made of network namespaces, where every byte
crosses a wire: `tests/pool/test_hosts_cluster.py`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ems.pool", "status", *args], capture_output=True, text=True, timeout=60, check=False
    )


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


def test_an_engine_on_etcd_connects_to_the_members_its_calls_use(etcd, clean_ems):
    """Members etcd reports are opened lazily (`ems.backends.remote_pool`): an engine that sees 4 nodes is connected
    to none but the ones its start-up health check pinged (`NodeRouter.healthy`: HEALTH_FIRST, when they answer),
    and its namespace record (published at registration) lives on one node, whatever the pool's size
    (`ems.datapath.keys.route_key_of`), so registering connects to that one at most (and, while the members count
    as having joined lately, the node a read falls back to)."""
    import re
    import time

    from cluster_testlib import ClusterNode
    from ems_testlib import make_cache

    from ems import CcConfig, Ems, EmsConfig
    from ems.backends.node_router import HEALTH_FIRST

    nodes = [ClusterNode(etcd.url, "lazy", capacity="32MiB") for _ in range(4)]

    def connections() -> list[int]:
        return [int(float(re.search(r"^ems_pool_connections (\S+)$", n.scrape(), re.M).group(1))) for n in nodes]

    try:
        Ems.init(
            EmsConfig(
                cc_config=CcConfig(rank_id=0, device_id=0, model_id="lazy"),
                pool_etcd=etcd.url,
                pool_cluster="lazy",
                pool_replicas=1,
            )
        )
        deadline = time.monotonic() + 15
        while len(Ems._pool.nodes) < 4:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the engine did not see the 4 members"
            time.sleep(0.05)
        time.sleep(0.3)  # (a connection made at join would be open by now)
        at_start = connections()
        assert sum(at_start) <= HEALTH_FIRST, at_start
        Ems.get_cc().register_kvcache(make_cache(layers=1, blocks=4, block_size=4))
        assert sum(connections()) <= sum(at_start) + 2
    finally:
        Ems.shutdown()
        for n in nodes:
            n.cleanup()

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

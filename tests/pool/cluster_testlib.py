"""Helpers for cluster tests: an etcd process on free loopback ports, registered pool nodes, engine processes.

`EtcdProcess` needs the `etcd` binary (Debian: `apt-get install etcd-server`); the `etcd` fixture skips the test
with that reason when it is absent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from ems_testlib import free_port
from pool_testlib import PoolProcess, _die_with_parent, read_line

ENGINE = str(Path(__file__).resolve().parent / "cluster_engine.py")


class EtcdProcess:
    """One etcd member on 127.0.0.1 with a data dir of its own; `stop()`/`start()` keep the data and ports."""

    def __init__(self) -> None:
        self.data_dir = tempfile.mkdtemp(prefix="ems-etcd-")
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen | None = None
        self.log = open(os.path.join(self.data_dir, "etcd.log"), "ab")  # noqa: SIM115 - open for the process's life
        self.start()

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [
                "etcd",
                "--name",
                "ems-test",
                "--data-dir",
                os.path.join(self.data_dir, "data"),
                "--listen-client-urls",
                self.url,
                "--advertise-client-urls",
                self.url,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"ems-test={peer}",
                "--log-level",
                "error",
            ],
            stdout=self.log,
            stderr=self.log,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"etcd did not start; see {self.log.name}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def etcd():
    if shutil.which("etcd") is None:
        pytest.skip("the etcd binary is not installed (Debian: apt-get install etcd-server; .ci/run does this)")
    server = EtcdProcess()
    yield server
    server.cleanup()


class ClusterNode(PoolProcess):
    """A pool node registered in etcd, serving metrics on its own port."""

    def __init__(self, etcd_url: str, cluster: str, capacity: str = "128MiB", drain_s: float = 1.0) -> None:
        self.metrics_address = f"127.0.0.1:{free_port()}"
        super().__init__(
            capacity,
            args=[
                "--etcd",
                etcd_url,
                "--cluster",
                cluster,
                "--metrics",
                self.metrics_address,
                "--lease-ttl",
                "2",
                "--drain",
                str(drain_s),
            ],
        )

    def scrape(self) -> str:
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=5) as r:
            return r.read().decode()


class Engine:
    """An engine process (`cluster_engine.py`): one JSON command per line in, one JSON reply per line out."""

    def __init__(self, prefix: tuple[str, ...] | list[str] = (), **config) -> None:
        """`prefix`: argv that runs the engine elsewhere (`HostCluster.exec_prefix`: inside a host)."""
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, ENGINE, json.dumps(config)],
            cwd=tempfile.gettempdir(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_die_with_parent,
        )
        ready = self.reply(60)
        if ready.get("ready") is not True:
            self.close()
            raise RuntimeError(f"engine did not start: {ready}")

    def send(self, **command) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout_s: float = 60) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            line = read_line(self.proc, max(0.0, deadline - time.monotonic()))
            if not line:
                raise RuntimeError(f"engine gave no answer; stderr: {self._stderr()}")
            if line.startswith("{"):
                return json.loads(line)
            # anything else is a library writing to stdout (UCXX logs endpoint errors there): not a reply

    def call(self, timeout_s: float = 60, **command) -> dict:
        self.send(**command)
        return self.reply(timeout_s)

    def wait_members(self, expected: set[str], timeout_s: float = 15) -> float:
        """Seconds until the engine's live set is exactly `expected`."""
        t0 = time.monotonic()
        while True:
            members = set(self.call(op="members")["members"])
            if members == expected:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise AssertionError(f"engine sees {sorted(members)}, expected {sorted(expected)}")
            time.sleep(0.05)

    def _stderr(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stderr.read()[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="quit")
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()

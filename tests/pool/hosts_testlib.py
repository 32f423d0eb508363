"""A cluster of hosts on one machine: each host a network namespace with its own network stack, all behind one
bridge, each host's link shaped by a token bucket, so that what crosses a wire in production crosses a (virtual)
wire here: no shared memory between a client and a node, no loopback shortcuts, a real link that can be slowed or
cut.

Layout (`HostCluster`): a "switch" namespace holds the bridge `br0`; each host is a namespace whose `eth0` is one end
of a veth pair, the other end (`p<i>`) a port of the bridge. Hosts get 10.77.0.<i+1>/24 in the order they are named.
Everything is created inside namespaces this module made (the veth pairs are created in the switch namespace and
one end moved into the host's): the machine's own network namespace, its interfaces, routes and qdiscs are never
touched, and two clusters (parallel or aborted runs) never collide, since each has its own namespaces, named
`emsnet-<pid>-<random>-<role>`.

Shaping: `tbf` (a token bucket) on a host's `eth0` limits what it sends (its egress); `shape(host, rate, ingress=True)`
also limits what it receives (the bucket on its bridge port). This machine's kernel has `tbf` and `htb` but no
`netem`, so no delay or loss can be added: a round trip is what two veths and a bridge cost (tens of µs).

Faults: `cut(host)` takes the host's bridge port down (a partition: packets are dropped, connections are not reset,
as when a cable or a switch port fails); `restore(host)` brings it back. `shape(host, "8mbit")` squeezes a link to a
trickle (a slow node).

Processes: `popen(host, argv)` runs a command inside a host (`ip netns exec`), killed with the test process
(PR_SET_PDEATHSIG); `close()` kills what is still running in the cluster's namespaces and deletes them. A cluster
left behind by a killed run (its creator's pid is gone) is removed by the next `HostCluster` (`sweep_stale`).

Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN) and `ip` (iproute2) and `tc`: `unavailable()` says why not, and the
fixtures skip with that reason.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from pool_testlib import _die_with_parent

PREFIX = "emsnet-"
SUBNET = "10.77.0"
DEFAULT_RATE = "4gbit"


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


_reason: str | None = None
_checked = False


def unavailable() -> str | None:
    """Why a namespace cluster cannot be built here (None: it can). Tried once per process, on a namespace of its
    own (created and deleted)."""
    global _reason, _checked
    if _checked:
        return _reason
    _checked = True
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            _reason = f"`{tool}` (iproute2) is not installed"
            return _reason
    probe = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}-probe"
    result = _run(["ip", "netns", "add", probe], check=False)
    if result.returncode != 0:
        _reason = f"cannot create network namespaces here (needs root or CAP_SYS_ADMIN): {result.stderr.strip()}"
        return _reason
    try:
        result = _run(["ip", "-n", probe, "link", "add", "br0", "type", "bridge"], check=False)
        if result.returncode != 0:
            _reason = f"cannot create a bridge in a network namespace: {result.stderr.strip()}"
            return _reason
        result = _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "br0", "root", "tbf", "rate", "1gbit",
                       "burst", "256kb", "latency", "10ms"], check=False)  # fmt: skip
        if result.returncode != 0:
            _reason = f"the kernel has no tbf qdisc: {result.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return _reason


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    """SIGKILL every process still running in namespace `ns` (one this module created) and wait for them to go."""
    for _ in range(50):
        pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def sweep_stale() -> list[str]:
    """Delete the namespaces of clusters whose creating process is gone (a run killed before it could clean up);
    only names this module gives (`emsnet-<pid>-...`) are considered. The names removed."""
    removed = []
    for ns in _namespaces():
        if not ns.startswith(PREFIX):
            continue
        pid = ns[len(PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or _pid_alive(int(pid)):
            continue
        _kill_inside(ns)
        if _run(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
    return removed


@dataclass(frozen=True)
class Host:
    name: str  # the role the test gave it ("etcd", "client", "n1", ...)
    ns: str  # the network namespace
    ip: str
    port: str  # its bridge port, in the switch namespace


def tbf_args(rate: str) -> list[str]:
    """A token bucket of `rate` (tc's units: 4gbit, 500mbit, 8mbit) with about 1 ms of burst at that rate: at least
    128 KiB from 1 Gbit/s up (so a 64 KiB segmentation-offload packet always fits at full speed), and for a trickle
    10 ms of it, at least 4 KiB (tbf then cuts offload packets to fit); up to 20 ms of queue before drops."""
    byte_rate = _rate_bits(rate) // 8
    burst = max(128 << 10, byte_rate // 1000) if byte_rate >= 125_000_000 else max(4 << 10, byte_rate // 100)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "20ms"]


def _rate_bits(rate: str) -> int:
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"a rate in tc's units (4gbit, 500mbit, 8kbit), got {rate!r}")


class HostCluster:
    """Hosts as network namespaces behind one bridge; see the module docstring. A context manager: `close()` on exit."""

    def __init__(self, names: Sequence[str], rate: str | None = DEFAULT_RATE, shaped: Sequence[str] | None = None) -> None:
        """Hosts named `names` (in address order); `rate` limits the egress of each host in `shaped` (default: all)."""
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        if len(set(names)) != len(names) or not 0 < len(names) < 250:
            raise ValueError(f"1-249 distinct host names, got {list(names)}")
        sweep_stale()
        self.tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        try:
            self._build(names)
            for name in shaped if shaped is not None else names:
                if rate is not None:
                    self.shape(name, rate)
        except BaseException:
            self.close()
            raise

    def _build(self, names: Sequence[str]) -> None:
        _run(["ip", "netns", "add", self.switch])
        self._made.append(self.switch)
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for i, name in enumerate(names):
            ns = f"{self.tag}-h{i}"
            _run(["ip", "netns", "add", ns])
            self._made.append(ns)
            port = f"p{i}"
            _run(["ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0", "up"])
            ip = f"{SUBNET}.{i + 1}"
            _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            self.hosts[name] = Host(name, ns, ip, port)

    def __enter__(self) -> HostCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ip(self, host: str) -> str:
        return self.hosts[host].ip

    def exec_prefix(self, host: str) -> list[str]:
        """argv prefix that runs a command inside `host`."""
        return ["ip", "netns", "exec", self.hosts[host].ns]

    def popen(self, host: str, argv: Sequence[str], **kwargs: object) -> subprocess.Popen:
        """Start `argv` inside `host`; it is killed with the test process, and by `close()`."""
        kwargs.setdefault("preexec_fn", _die_with_parent)
        kwargs.setdefault("cwd", tempfile.gettempdir())  # (`python -m` imports from its working directory first)
        proc = subprocess.Popen([*self.exec_prefix(host), *argv], **kwargs)  # type: ignore[call-overload]
        self._procs.append(proc)
        return proc

    def run(self, host: str, argv: Sequence[str], timeout_s: float = 60) -> subprocess.CompletedProcess:
        """Run `argv` inside `host` to its end: its exit status and output."""
        return subprocess.run([*self.exec_prefix(host), *argv], capture_output=True, text=True, timeout=timeout_s, check=False)

    def shape(self, host: str, rate: str, ingress: bool = False) -> None:
        """Limit what `host` sends to `rate` (and, with `ingress`, what it receives), replacing any earlier limit."""
        h = self.hosts[host]
        _run(["ip", "netns", "exec", h.ns, "tc", "qdisc", "replace", "dev", "eth0", "root", *tbf_args(rate)])
        if ingress:
            _run(["ip", "netns", "exec", self.switch, "tc", "qdisc", "replace", "dev", h.port, "root", *tbf_args(rate)])

    def unshape(self, host: str) -> None:
        """No limit on `host`'s link either way."""
        h = self.hosts[host]
        _run(["ip", "netns", "exec", h.ns, "tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
        _run(["ip", "netns", "exec", self.switch, "tc", "qdisc", "del", "dev", h.port, "root"], check=False)

    def cut(self, host: str) -> None:
        """Partition `host`: its bridge port goes down; packets to and from it are dropped, nothing is reset."""
        _run(["ip", "-n", self.switch, "link", "set", self.hosts[host].port, "down"])

    def restore(self, host: str) -> None:
        """Undo `cut(host)`."""
        _run(["ip", "-n", self.switch, "link", "set", self.hosts[host].port, "up"])
        _run(["ip", "-n", self.hosts[host].ns, "link", "set", "eth0", "up"])

    def close(self) -> None:
        """Kill what runs in the cluster's namespaces and delete them (idempotent)."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self._procs.clear()
        for ns in reversed(self._made):
            _kill_inside(ns)
            _run(["ip", "netns", "del", ns], check=False)
        self._made.clear()


# ---- processes on the hosts: etcd, pool nodes ----

READY_PREFIX = "ems-pool ready on "


class HostEtcd:
    """One etcd member on `host`, port 2379, with a data directory of its own (removed by `cleanup`)."""

    def __init__(self, cluster: HostCluster, host: str) -> None:

        self.cluster, self.host = cluster, host
        self.url = f"http://{cluster.ip(host)}:2379"
        self.data_dir = tempfile.mkdtemp(prefix="ems-etcd-")
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        import json

        ip = self.cluster.ip(self.host)
        peer = f"http://{ip}:2380"
        log = open(os.path.join(self.data_dir, "etcd.log"), "ab")  # noqa: SIM115 - the process's log
        self.proc = self.cluster.popen(
            self.host,
            ["etcd", "--name", "ems-hosts", "--data-dir", os.path.join(self.data_dir, "data"),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url, "--listen-peer-urls", peer,
             "--initial-advertise-peer-urls", peer, "--initial-cluster", f"ems-hosts={peer}", "--log-level", "error"],
            stdout=log, stderr=log,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            health = f"import urllib.request as u; print(u.urlopen('{self.url}/health', timeout=1).read().decode())"
            probe = self.cluster.run(self.host, ["python3", "-c", health])
            if probe.returncode == 0 and json.loads(probe.stdout or "{}").get("health") == "true":
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"etcd did not start on {self.host}; see {self.data_dir}/etcd.log")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.data_dir, ignore_errors=True)


class HostNode:
    """`python -m ems.pool` on `host`, listening on the host's address, port 7700 (or `port`: several nodes on one
    host), registered in etcd (when given) with its metrics on port 9700 of the host (2000 above `port`)."""

    PORT, METRICS_PORT = 7700, 9700

    def __init__(
        self,
        cluster: HostCluster,
        host: str,
        etcd: str | None = None,
        capacity: str = "256MiB",
        args: Sequence[str] = (),
        cluster_name: str = "hosts",
        port: int | None = None,
    ) -> None:
        import sys

        self.cluster, self.host = cluster, host
        ip = cluster.ip(host)
        port = self.PORT if port is None else port
        self.address = f"{ip}:{port}"
        self.metrics_address = f"{ip}:{self.METRICS_PORT + port - self.PORT}"
        self.argv = [sys.executable, "-m", "ems.pool", "--listen", self.address, "--capacity", capacity,
                     "--log-level", "info", "--metrics", self.metrics_address, *args]  # fmt: skip
        if etcd is not None:
            self.argv += ["--etcd", etcd, "--cluster", cluster_name, "--advertise", self.address, "--lease-ttl", "2"]
        self.log = tempfile.NamedTemporaryFile(prefix=f"ems-pool-{host}-", suffix=".log", delete=False)  # noqa: SIM115 - kept
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout_s: float = 60.0) -> None:
        from pool_testlib import read_line

        env = dict(os.environ)
        env.pop("EMS_POOL_KEYS", None)
        deadline = time.monotonic() + timeout_s
        while True:
            self.proc = self.cluster.popen(self.host, self.argv, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
            line = read_line(self.proc, max(1.0, deadline - time.monotonic()))
            if line.startswith(READY_PREFIX):
                return
            self.kill()
            if time.monotonic() > deadline:  # (a restart may find its port still held for a moment)
                raise RuntimeError(f"pool node on {self.host} did not start: {line!r}; log: {self.log_text()[-3000:]}")
            time.sleep(0.5)

    def log_text(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def terminate(self, timeout_s: float = 20.0) -> int:
        assert self.proc is not None
        self.proc.terminate()
        return self.proc.wait(timeout_s)

    def restart(self) -> None:
        """Kill and start again, empty, on the same address."""
        self.kill()
        self.start()

    def cleanup(self) -> None:
        self.kill()
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


@pytest.fixture
def hosts():
    """`make(names, rate=..., shaped=...)` → a `HostCluster`; skips (with the reason) where namespaces cannot be made
    or etcd is missing; every cluster made is torn down when the test ends, passed or failed."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no cluster of network namespaces here: {reason}")
    if shutil.which("etcd") is None:
        pytest.skip("the etcd binary is not installed (Debian: apt-get install etcd-server; .ci/run does this)")
    made: list[HostCluster] = []

    def make(names: Sequence[str], rate: str | None = DEFAULT_RATE, shaped: Sequence[str] | None = None) -> HostCluster:
        cluster = HostCluster(names, rate, shaped)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()

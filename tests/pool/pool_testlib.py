"""Helpers for tests with real pool-node processes: start/stop/kill/pause nodes, make well-formed values."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import resource
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np
import pytest

from ems.store.value_format import ExpectedValues, ValueKind, build_headers, checksum

READY_PREFIX = "ems-pool ready on "
START_TIMEOUT_S = 30.0


def tcp_sockets(pid: int, state: str) -> list[list[str]]:
    """The rows of /proc/net/tcp and tcp6 (split into fields) of the TCP sockets process `pid` holds in `state`
    (the kernel's hex code: "0A" listening, "08" CLOSE_WAIT)."""
    inodes = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as f:
            next(f)
            rows += [fields for fields in map(str.split, f) if fields[3] == state and fields[9] in inodes]
    return rows


class PoolProcess:
    """One `python -m ems.pool` process on 127.0.0.1."""

    def __init__(
        self,
        capacity: str = "256MiB",
        keys: dict[str, str] | None = None,
        port: int = 0,
        args: tuple = (),
        nofile: int | None = None,
    ) -> None:
        self.capacity = capacity
        self.nofile = nofile  # the node's RLIMIT_NOFILE (None: inherited)
        self.keys = keys
        self.port = port
        self.args = tuple(args)
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="ems-pool-", suffix=".log", delete=False)  # noqa: SIM115 - the node's log, kept open
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ)
        env.pop("EMS_POOL_KEYS", None)
        if self.keys:
            env["EMS_POOL_KEYS"] = ",".join(f"{i}:{k}" for i, k in self.keys.items())
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ems.pool",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--capacity",
                self.capacity,
                "--log-level",
                "info",
                *self.args,
            ],
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
            preexec_fn=functools.partial(_die_with_parent, self.nofile),
        )
        line = read_line(self.proc, START_TIMEOUT_S)
        if not line.startswith(READY_PREFIX):
            self.kill()
            raise RuntimeError(f"pool node did not start: {line!r}; log: {self.log_text()}")
        self.port = int(line[len(READY_PREFIX) :].rsplit(":", 1)[1])

    def log_text(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def rss_bytes(self) -> int:
        """The node's resident memory (VmRSS)."""
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def fd_count(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def close_wait_sockets(self) -> int:
        """Sockets of the node in CLOSE_WAIT (the peer closed, the node did not)."""
        return len(tcp_sockets(self.proc.pid, "08"))

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def terminate(self, timeout_s: float = 10.0) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout_s)

    def restart(self) -> None:
        """Kill and start again on the same port (retrying while the old socket still holds it)."""
        self.kill()
        deadline = time.monotonic() + 15.0
        while True:
            try:
                self.start()
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def cleanup(self) -> None:
        self.kill()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()
        os.unlink(self.log.name)


def _die_with_parent(nofile: int | None = None) -> None:
    """Child side: SIGKILL when the test process dies, so a crashed test never leaves a node running; with `nofile`,
    at most that many descriptors."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if nofile is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The next stdout line of `proc`, or '' when it exits or `timeout_s` passes."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout_s):
            return ""
        return proc.stdout.readline()
    finally:
        sel.close()


@contextlib.contextmanager
def client_of_scripted_node(serve: Callable[[Any], Awaitable[None]]) -> Iterator[Any]:
    """A `UcxNode` connected to a listener whose every connection runs `serve(ep)`: a scripted node that sends what
    a real node never would. The listener is closed on exit."""
    from ucx_loop import UcxRuntime

    from ems.transport.ucx.client import UcxNode

    runtime = UcxRuntime.get()  # starts UCX (its environment first), then ucxx may load
    import ucxx

    async def listen():
        return ucxx.create_listener(serve, port=0, endpoint_error_handling=True)

    listener = asyncio.run_coroutine_threadsafe(listen(), runtime.loop).result(10)
    node = UcxNode(f"127.0.0.1:{listener.port}", connect_timeout_ms=3000)
    try:
        yield node
    finally:
        node.close()
        runtime.call_soon(listener.close)


def make_values(n: int, size: int, seed: int = 0) -> list[list[bytes]]:
    """`n` well-formed EMS values (header part + payload part) of `size` payload bytes each, random content."""
    rng = np.random.default_rng(seed)
    payload = rng.integers(0, 256, n * size, dtype=np.uint8).tobytes()
    payloads = [payload[i * size : (i + 1) * size] for i in range(n)]
    expected = ExpectedValues(ValueKind.RAW_V0, 0, np.zeros(n, np.uint64), np.full(n, size, np.int64))
    headers = build_headers(expected, [checksum([p]) for p in payloads])
    return [[h, p] for h, p in zip(headers, payloads)]


def joined(value: list[bytes]) -> bytes:
    return b"".join(value)


def scrape_metrics(address: str) -> dict:
    """A node's metrics endpoint at `address` ("host:port"): {(sample name, sorted label pairs): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def wait_until(predicate, timeout_s: float, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


KEY_A = "A" * 40
KEY_B = "b" * 36 + "+/=="


@pytest.fixture
def pool_nodes():
    """`start(capacity=..., keys=..., args=(extra options,))` → a running `PoolProcess`; all are killed when the test
    ends."""
    started: list[PoolProcess] = []

    def start(capacity: str = "256MiB", keys=None, args: tuple = (), nofile: int | None = None) -> PoolProcess:
        node = PoolProcess(capacity, keys, args=args, nofile=nofile)
        started.append(node)
        return node

    yield start
    for node in started:
        node.cleanup()


@pytest.fixture
def node_clients():
    """`make(address, **kw)` → a `UcxNode`; all are closed when the test ends."""
    from ems.transport.ucx.client import UcxNode

    made: list = []

    def make(address: str, **kwargs):
        kwargs.setdefault("connect_timeout_ms", 2000)
        node = UcxNode(address, **kwargs)
        made.append(node)
        return node

    yield make
    for node in made:
        node.close()


@pytest.fixture(scope="module")
def shared_node():
    """One anonymous node shared by a module's tests that neither stop it nor depend on its contents."""
    node = PoolProcess("512MiB")
    yield node
    node.cleanup()

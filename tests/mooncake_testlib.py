"""A Mooncake Store on 127.0.0.1 for tests: `mooncake_master` and one storage process (the memory, across TCP like
a pool node), both from Mooncake's pip package, on free loopback ports (`ems_testlib.free_port`); `clear()` empties
it between tests.

`mooncake_missing()` says why the package cannot run here (None when it can): tests skip with that reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ems_testlib import free_port

STORAGE = r"""
import sys, time
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[1])
print("ready", rc, flush=True)
while True:
    time.sleep(1)
"""


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the process that started it dies (a crashed test run leaves no
    Mooncake processes behind). Linux only; elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def master_executable() -> str | None:
    found = shutil.which("mooncake_master")
    if found:
        return found
    beside = Path(sys.executable).parent / "mooncake_master"
    return str(beside) if beside.exists() else None


def mooncake_missing() -> str | None:
    """Why Mooncake cannot run in this environment, or None."""
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"Mooncake's Python client is not installed (pip install mooncake-transfer-engine-non-cuda): {exc}"
    if master_executable() is None:
        return "mooncake_master is not on PATH nor beside the Python executable"
    return None


def _wait_listening(port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


class MooncakeCluster:
    """`mooncake_master` plus one storage process holding `segment_bytes`; `master` is its "127.0.0.1:port". A read
    holds a lease of `lease_ttl_ms` on what it reads (a read that takes longer answers LEASE_EXPIRED: a miss)."""

    def __init__(self, segment_bytes: int = 256 << 20, port: int | None = None, lease_ttl_ms: int = 5000) -> None:
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        self.segment_bytes = segment_bytes
        self.port = port or free_port()
        self.master = f"127.0.0.1:{self.port}"
        self.logs = tempfile.mkdtemp(prefix="ems-mooncake-")
        exe = master_executable()
        if exe is None:
            raise RuntimeError("mooncake_master not found")
        self.master_proc: subprocess.Popen | None = subprocess.Popen(
            [
                exe,
                f"--rpc_port={self.port}",
                "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=false",
                f"--metrics_port={free_port()}",
                "--metrics_host=127.0.0.1",
                f"--default_kv_lease_ttl={lease_ttl_ms}",
            ],
            stdout=open(os.path.join(self.logs, "master.log"), "w"),  # noqa: SIM115 - the child's log, kept open
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        self.storage: subprocess.Popen | None = None
        self._admin = None
        try:
            if not _wait_listening(self.port, 30.0):
                log = Path(self.logs, "master.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"mooncake_master did not listen on {self.master}: {log}")
            self.start_storage()
        except BaseException:
            self.close()
            raise

    def start_storage(self) -> None:
        """(Re)start the storage process; returns once it has mounted its segment."""
        log = open(os.path.join(self.logs, "storage.log"), "a")  # noqa: SIM115 - the child's log, kept open
        self.storage = subprocess.Popen(
            [sys.executable, "-u", "-c", STORAGE, self.master, str(self.segment_bytes)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            preexec_fn=_die_with_parent,
        )
        line = self.storage.stdout.readline() if self.storage.stdout else ""
        if not line.startswith("ready 0"):
            raise RuntimeError(f"Mooncake storage process did not start: {line!r} (log in {self.logs})")

    def kill_storage(self) -> None:
        if self.storage is not None:
            self.storage.kill()
            self.storage.wait(10)
            self.storage = None

    def settings(self, **more: object) -> dict:
        """The `EmsConfig` pool settings that point at this store."""
        return {"pool_backend": "mooncake", "mooncake_master": self.master, **more}

    def clear(self) -> None:
        """Remove every object (forced past leases): the next test starts on an empty store."""
        if self._admin is None:
            from mooncake.store import MooncakeDistributedStore

            admin = MooncakeDistributedStore()
            if admin.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", self.master) != 0:
                raise RuntimeError("Mooncake admin client setup failed")
            self._admin = admin
        self._admin.remove_all(True)

    def close(self) -> None:
        if self._admin is not None:
            try:
                self._admin.close()
            except Exception:  # closing a test store: best effort
                pass
            self._admin = None
        self.kill_storage()
        if self.master_proc is not None:
            self.master_proc.kill()
            self.master_proc.wait(10)
            self.master_proc = None
        shutil.rmtree(self.logs, ignore_errors=True)

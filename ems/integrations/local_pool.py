"""The host's shared local pool node, for engines configured without pool nodes.

An engine such as vLLM runs its scheduler and its workers in separate processes, and a second engine on the same
host should find what the first one saved; an embedded (per-process) pool gives neither. `ensure_local_pool(dir)`
returns the address of one `python -m ems.pool` node on 127.0.0.1 that every process using the same `dir` shares:

* `dir/pool.json` records `{"address": "127.0.0.1:PORT", "pid": PID}`; `dir/pool.lock` (an `fcntl` lock)
  serialises finding and starting, so concurrent processes start one node between them.
* A recorded node that accepts a TCP connection on its port is reused. Otherwise a new node is started with
  `--listen 127.0.0.1:0 --capacity CAPACITY` in its own session (it outlives the engine that started it, so a later
  engine finds its blocks), its `ems-pool ready on HOST:PORT` line is read (at most `start_timeout` seconds), and
  the file is rewritten. Its stderr goes to `dir/pool.log`.
* `stop_local_pool(dir)` stops the recorded node (SIGTERM) and removes the record.
* `default_dir()`: `$EMS_LOCAL_POOL_DIR`, else `<tmp>/ems-local-pool-<uid>`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ems import EmsErrorCode, EmsException

HOST = "127.0.0.1"


@dataclass(frozen=True)
class LocalPool:
    address: str
    pid: int
    started: bool  # True when this call started it


def default_dir() -> str:
    return os.environ.get("EMS_LOCAL_POOL_DIR") or os.path.join(tempfile.gettempdir(), f"ems-local-pool-{os.getuid()}")


@contextlib.contextmanager
def _locked(directory: str) -> Iterator[None]:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    with open(os.path.join(directory, "pool.lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _record_path(directory: str) -> str:
    return os.path.join(directory, "pool.json")


def read_record(directory: str) -> dict | None:
    try:
        with open(_record_path(directory), encoding="utf-8") as f:
            record = json.load(f)
        return record if isinstance(record, dict) and "address" in record and "pid" in record else None
    except (OSError, ValueError):
        return None


def answers(address: str, timeout: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def _start(directory: str, capacity: str, start_timeout: float) -> LocalPool:
    with open(os.path.join(directory, "pool.log"), "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ems.pool", "--listen", f"{HOST}:0", "--capacity", capacity],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
            env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"},
        )
    if proc.stdout is None:  # cannot happen with stdout=PIPE; keeps the type checker honest
        raise EmsException(EmsErrorCode.EMS_INTERNAL_ERROR, "no stdout pipe to the local pool node")
    deadline = time.monotonic() + start_timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            proc.kill()
            raise EmsException(
                EmsErrorCode.EMS_IO_ERROR,
                f"the local pool node did not start within {start_timeout} s (see {directory}/pool.log)",
            )
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                continue
            line += chunk
    text = line.decode(errors="replace").strip()
    prefix = "ems-pool ready on "
    if not text.startswith(prefix):
        proc.kill()
        raise EmsException(EmsErrorCode.EMS_IO_ERROR, f"unexpected line from the local pool node: {text!r}")
    proc.stdout.close()
    address = text[len(prefix):]
    record = {"address": address, "pid": proc.pid}
    tmp = _record_path(directory) + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(tmp, _record_path(directory))
    _children.append(proc)  # reaped by whoever outlives it; kept so Python does not warn
    return LocalPool(address, proc.pid, True)


_children: list[subprocess.Popen] = []


def ensure_local_pool(directory: str | None = None, capacity: str = "2GiB", start_timeout: float = 60.0) -> LocalPool:
    """The address of the host's shared local pool node under `directory`, started if none answers."""
    directory = directory or default_dir()
    with _locked(directory):
        record = read_record(directory)
        if record is not None and answers(str(record["address"])):
            return LocalPool(str(record["address"]), int(record["pid"]), False)
        return _start(directory, capacity, start_timeout)


def _gone(pid: int) -> bool:
    for proc in _children:
        if proc.pid == pid:
            return proc.poll() is not None  # our own child: reap it (a zombie still answers kill(pid, 0))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def stop_local_pool(directory: str | None = None, timeout: float = 10.0) -> bool:
    """Stop the recorded node (True if one was running) and forget it: SIGTERM, then SIGKILL after `timeout`
    seconds; returns once the process is gone."""
    directory = directory or default_dir()
    with _locked(directory):
        record = read_record(directory)
        with contextlib.suppress(OSError):
            os.remove(_record_path(directory))
    if record is None:
        return False
    pid = int(record["pid"])
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    if not _wait_gone(pid, timeout):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, timeout)
    return True

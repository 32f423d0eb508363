"""The host's shared local pool node, for engines configured without pool nodes.

An engine such as vLLM runs its scheduler and its workers in separate processes, and a second engine on the same
host should find what the first one saved; an embedded (per-process) pool gives neither. `ensure_local_pool(dir)`
returns the address of one `python -m ems.pool` node on 127.0.0.1 that every process using the same `dir` shares:

* `dir/pool.json` records `{"address": "127.0.0.1:PORT", "pid": PID}`; `dir/pool.lock` (an `fcntl` lock)
  serialises finding and starting, so concurrent processes start one node between them.
* A recorded node that accepts a TCP connection on its port is reused. Otherwise a new node is started with
  `--listen 127.0.0.1:0 --capacity CAPACITY`, its `ems-pool ready on HOST:PORT` line is read (at most
  `start_timeout` seconds), and the file is rewritten. Its stderr goes to `dir/pool.log`. Replacing a recorded
  node that no longer answers is logged as a warning (the blocks it held are gone: later lookups miss).
* The node is detached from the process that starts it: a short-lived launcher process starts it in its own session
  and exits, so the node's parent is init (or the host's subreaper), never the engine. It outlives the engine that
  started it, so a later engine finds its blocks, and an engine's shutdown that kills its own process tree (vLLM
  SIGKILLs every descendant of an EngineCore that does not exit within its grace period) does not kill it.
* A per-user key: `dir` must be a directory owned by this user and closed to others (it is created 0700; one that
  another user owns, or a symlink, is refused; one of ours open to others is closed to 0700). `dir/pool.key` holds
  one `access_id:access_key` line (`local-<uid>`, 64 random base64 characters), created 0600 and atomically (written
  to a private temporary file, then linked into place), and is the node's `--keys-file`: the node serves only
  clients that prove that key (`ems.pool` tenant keys, challenge-response), so another user's process, which cannot
  read the file, can neither read nor plant blocks. `LocalPool.access_id/access_key` are what this user's clients
  pass to `EmsConfig`. A recorded node that was not started with the current key file (an older record, or the key
  file was replaced) is stopped and replaced.
* `stop_local_pool(dir)` stops the recorded node (SIGTERM) and removes the record.
* `default_dir()`: `$EMS_LOCAL_POOL_DIR`, else `<tmp>/ems-local-pool-<uid>`.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ems import EmsErrorCode, EmsException
from ems.settings import local_pool_dir_from_environment

HOST = "127.0.0.1"

logger = logging.getLogger("ems.integrations")


@dataclass(frozen=True)
class LocalPool:
    address: str
    pid: int
    started: bool  # True when this call started it
    access_id: str = ""
    access_key: str = field(default="", repr=False)  # a secret: never in logs


def default_dir() -> str:
    return local_pool_dir_from_environment() or os.path.join(tempfile.gettempdir(), f"ems-local-pool-{os.getuid()}")


def _private_dir(directory: str) -> None:
    """Create `directory` 0700, or check that an existing one is a real directory of this user's, closed to others."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise EmsException(
            EmsErrorCode.EMS_INVALID_ARGUMENT,
            f"local_pool_dir {directory!r} is not a directory owned by this user (uid {os.getuid()}): refusing to "
            "keep the local pool's key there",
        )
    if info.st_mode & 0o077:
        os.chmod(directory, 0o700)


KEY_FILE = "pool.key"


def _key_path(directory: str) -> str:
    return os.path.join(directory, KEY_FILE)


def _read_key(directory: str) -> tuple[str, str] | None:
    """(access_id, access_key) from `dir/pool.key`, or None when there is no usable one (absent, unreadable, not
    ours, open to others, or malformed)."""
    path = _key_path(directory)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, encoding="ascii", errors="replace") as f:
        info = os.fstat(f.fileno())
        if info.st_uid != os.getuid() or info.st_mode & 0o077 or not stat.S_ISREG(info.st_mode):
            logger.warning("ignoring %s: not a private file of this user's (mode %o)", path, info.st_mode & 0o777)
            return None
        access_id, _, access_key = f.read().strip().partition(":")
    if not access_id or len(access_key) < 32:
        return None
    return access_id, access_key


def _make_key(directory: str) -> tuple[str, str]:
    """A new key file: written 0600 to a private temporary file, then renamed over `pool.key` (atomic)."""
    access_id = f"local-{os.getuid()}"
    access_key = base64.b64encode(secrets.token_bytes(48)).decode("ascii")
    tmp = f"{_key_path(directory)}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(f"{access_id}:{access_key}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, _key_path(directory))
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return access_id, access_key


def _key_digest(access_key: str) -> str:
    """What the record says about the key the node was started with (a digest: the record is not secret)."""
    return hashlib.blake2b(access_key.encode(), digest_size=16).hexdigest()


@contextlib.contextmanager
def _locked(directory: str) -> Iterator[None]:
    _private_dir(directory)
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
    """True when something accepts a TCP connection at `address` (the node's UCX listener)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


# Runs as `python -c _LAUNCHER NODE_ARGV...`: starts the node in a new session with the launcher's stdin, stdout (the
# caller's pipe) and stderr (pool.log), writes `pid N` to that pipe, and exits without waiting, so the node is
# reparented away from the caller's process tree.
_LAUNCHER = (
    "import os, subprocess, sys\n"
    "p = subprocess.Popen(sys.argv[1:], start_new_session=True)\n"
    "sys.stdout.write(f'pid {p.pid}\\n'); sys.stdout.flush()\n"
    "os._exit(0)\n"
)
_READY = "ems-pool ready on "


def _start(directory: str, capacity: str, start_timeout: float, key: tuple[str, str]) -> LocalPool:
    deadline = time.monotonic() + start_timeout
    node_argv = [
        sys.executable,
        "-m",
        "ems.pool",
        "--listen",
        f"{HOST}:0",
        "--capacity",
        capacity,
        "--keys-file",
        _key_path(directory),
    ]
    # the node's keys are exactly the key file's: an EMS_POOL_KEYS of the engine's environment does not reach it
    env = {k: v for k, v in os.environ.items() if k != "EMS_POOL_KEYS"}
    with open(os.path.join(directory, "pool.log"), "ab") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, *node_argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
            env={**env, "UCX_WARN_UNUSED_ENV_VARS": "n"},
        )
    if launcher.stdout is None:  # cannot happen with stdout=PIPE; keeps the type checker honest
        raise EmsException(EmsErrorCode.EMS_INTERNAL_ERROR, "no stdout pipe to the local pool node")
    pid: int | None = None
    try:
        lines = _read_lines(launcher.stdout.fileno(), 2, deadline)  # `pid N`, then the node's ready line
        with contextlib.suppress(subprocess.TimeoutExpired):
            launcher.wait(timeout=max(0.1, deadline - time.monotonic()))  # reap it (it exits at once)
        if lines and lines[0].startswith("pid "):
            pid = int(lines[0][4:])
        if pid is None or len(lines) < 2 or not lines[1].startswith(_READY):
            raise EmsException(
                EmsErrorCode.EMS_IO_ERROR,
                f"the local pool node did not start (it exited, or no ready line within {start_timeout} s; "
                f"got {lines!r}; see {directory}/pool.log)",
            )
    except BaseException:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        raise
    finally:
        launcher.stdout.close()
    address = lines[1][len(_READY) :]
    record = {"address": address, "pid": pid, "key": _key_digest(key[1])}
    tmp = _record_path(directory) + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(tmp, _record_path(directory))
    return LocalPool(address, pid, True, key[0], key[1])


def _read_lines(fd: int, count: int, deadline: float) -> list[str]:
    """Up to `count` newline-terminated lines from `fd`, stopping at end of file or at `deadline`."""
    data = b""
    while data.count(b"\n") < count:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:  # every writer is gone: the node exited (or never started)
            break
        data += chunk
    return [line.strip() for line in data.decode(errors="replace").splitlines()[:count]]


def ensure_local_pool(directory: str | None = None, capacity: str = "2GiB", start_timeout: float = 60.0) -> LocalPool:
    """The address of the host's shared local pool node under `directory`, started if none answers."""
    directory = directory or default_dir()
    with _locked(directory):
        key = _read_key(directory)
        if key is None:
            key = _make_key(directory)
        record = read_record(directory)
        if record is not None and answers(str(record["address"])):
            if record.get("key") == _key_digest(key[1]):
                return LocalPool(str(record["address"]), int(record["pid"]), False, key[0], key[1])
            logger.warning(
                "the local pool node recorded in %s (pid %s at %s) was not started with this user's current key "
                "file: stopping it and starting a keyed one",
                directory,
                record["pid"],
                record["address"],
            )
            _terminate(int(record["pid"]), 10.0)
            record = None
        started = _start(directory, capacity, start_timeout, key)
        if record is not None:
            logger.warning(
                "the local pool node recorded in %s (pid %s at %s, process %s) does not answer: started a new, "
                "empty node (pid %d at %s); blocks saved to the old node are lost",
                directory,
                record["pid"],
                record["address"],
                "gone" if _gone(int(record["pid"])) else "still there",
                started.pid,
                started.address,
            )
        else:
            logger.info("started the local pool node (pid %d at %s, record in %s)", started.pid, started.address, directory)
        return started


def _gone(pid: int) -> bool:
    """True when `pid` no longer runs (no such process, or a zombie its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's process reuses the pid
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
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
    return _terminate(int(record["pid"]), timeout)


def _terminate(pid: int, timeout: float) -> bool:
    """SIGTERM `pid`, SIGKILL after `timeout` seconds; True once it is gone, False when it was not running."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    if not _wait_gone(pid, timeout):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, timeout)
    return True

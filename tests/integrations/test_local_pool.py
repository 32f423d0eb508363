"""local_pool: processes that find no configured pool share one real `ems.pool` node on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from ems import EmsErrorCode, EmsException
from ems.integrations.local_pool import (
    answers,
    ensure_local_pool,
    read_record,
    stop_local_pool,
)


def test_one_node_shared_reused_and_replaced(tmp_path):
    directory = str(tmp_path)
    try:
        # four processes race to find-or-start: one node between them
        code = (
            "import sys; from ems.integrations.local_pool import ensure_local_pool as e; print(e(sys.argv[1], '16MiB').address)"
        )
        procs = [subprocess.Popen([sys.executable, "-c", code, directory], stdout=subprocess.PIPE, text=True) for _ in range(4)]
        addresses = {p.communicate(timeout=120)[0].strip() for p in procs}
        assert len(addresses) == 1 and all(p.returncode == 0 for p in procs)
        first = ensure_local_pool(directory, "16MiB")
        assert not first.started and first.address in addresses and answers(first.address)
        # the node outlives the processes that started it; a dead node is replaced by a new one
        assert stop_local_pool(directory)
        assert read_record(directory) is None and not answers(first.address)
        second = ensure_local_pool(directory, "16MiB")
        assert second.started and answers(second.address) and second.address != first.address
        # a stale record (nothing listens there) is replaced too
        with open(os.path.join(directory, "pool.json"), "w") as f:
            json.dump({"address": first.address, "pid": 999999}, f)
        stop = ensure_local_pool(directory, "16MiB")
        assert stop.started
        os.kill(second.pid, 15)
    finally:
        stop_local_pool(directory)
    assert not stop_local_pool(directory)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc's parent links (what psutil's children(recursive=True) sees)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def test_node_survives_the_process_tree_of_the_engine_that_started_it(tmp_path, caplog):
    """vLLM's shutdown SIGKILLs every descendant of an EngineCore that outlives its grace period (kill_process_tree):
    the node a worker started must not be one of them, or the next engine finds an empty pool."""
    directory = str(tmp_path)
    code = (
        "import sys, time; from ems.integrations.local_pool import ensure_local_pool as e; "
        "n = e(sys.argv[1], '16MiB'); print(n.address, n.pid, flush=True); time.sleep(600)"
    )
    starter = subprocess.Popen([sys.executable, "-c", code, directory], stdout=subprocess.PIPE, text=True)
    try:
        assert starter.stdout is not None
        address, pid = starter.stdout.readline().split()
        tree = _descendants(starter.pid)
        assert int(pid) not in tree
        for victim in [*tree, starter.pid]:  # as vLLM's kill_process_tree does
            os.kill(victim, signal.SIGKILL)
        starter.wait(timeout=30)
        assert answers(address)
        again = ensure_local_pool(directory, "16MiB")
        assert not again.started and (again.address, again.pid) == (address, int(pid))
        # a recorded node that died is replaced, and the loss is logged as a warning
        os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while answers(address) and time.monotonic() < deadline:  # the kernel closes its port once it is gone
            time.sleep(0.02)
        with caplog.at_level(logging.WARNING, logger="ems.integrations"):
            replaced = ensure_local_pool(directory, "16MiB")
        assert replaced.started and replaced.pid != int(pid)
        assert any("does not answer" in r.getMessage() and pid in r.getMessage() for r in caplog.records)
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        stop_local_pool(directory)


def test_a_node_that_cannot_start_is_reported(tmp_path):
    """A node that exits at once (a capacity it refuses) is an EMS_IO_ERROR naming pool.log, within the timeout."""
    directory = str(tmp_path)
    with pytest.raises(EmsException) as err:
        ensure_local_pool(directory, "not-a-size", start_timeout=60)
    assert err.value.status_code() == EmsErrorCode.EMS_IO_ERROR and "pool.log" in err.value.message()
    assert read_record(directory) is None


# ---------------------------------------------------------------- the per-user key

USER_CODE = """
import sys, torch
from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsException, KvBufferWrapper, PrimaryKey
address, key_path, access_id, access_key = sys.argv[1:5]
try:
    open(key_path).read()
    print("read-key")
except OSError:
    print("no-key")
buf = torch.arange(64, dtype=torch.uint8)
try:
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m"), pool_nodes=[address],
                       access_id=access_id or None, access_key=access_key or None, connect_timeout_ms=2000))
    ok = Ems.get_cc().save(CcKvOption(timeout=2000), [PrimaryKey("d", "a")], [[KvBufferWrapper(buf.data_ptr(), 64)]])
    print("saved" if ok.success == 1 else "refused")
except EmsException as exc:
    print("refused", exc.status_code().name)
"""


def client(node, directory: str, access_id: str = "", access_key: str = "") -> list[str]:
    """A separate process that tries to read the key file and to save one value."""
    proc = subprocess.run(
        [sys.executable, "-c", USER_CODE, node.address, os.path.join(directory, "pool.key"), access_id, access_key],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


def test_the_node_serves_only_clients_with_this_users_key(tmp_path):
    directory = str(tmp_path / "pool")
    try:
        node = ensure_local_pool(directory, "16MiB")
        info = os.stat(os.path.join(directory, "pool.key"))
        assert info.st_mode & 0o777 == 0o600 and info.st_uid == os.getuid()
        assert os.stat(directory).st_mode & 0o777 == 0o700
        assert node.access_id == f"local-{os.getuid()}" and len(node.access_key) >= 32
        with open(f"/proc/{node.pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert b"--keys-file" in argv and node.access_key.encode() not in b" ".join(argv)  # never on the command line
        assert repr(node).count(node.access_key) == 0
        # this user's processes (the key file) are served; a process without the key, or with a guessed one, is not
        assert client(node, directory, node.access_id, node.access_key) == ["read-key", "saved"]
        assert client(node, directory)[1] == "refused"
        assert client(node, directory, node.access_id, "A" * 64)[1] == "refused"
        # a second engine of this user finds the same node and the same key
        again = ensure_local_pool(directory, "16MiB")
        assert (again.address, again.access_key) == (node.address, node.access_key) and not again.started
    finally:
        stop_local_pool(directory)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another user")
def test_another_user_cannot_read_the_key(tmp_path):
    """Another user's process cannot read the key file (0600 in a 0700 folder), and without the key the node
    refuses it (the test above): it can neither read nor plant blocks."""
    os.chmod(tmp_path, 0o755)  # the test's own folder: let `nobody` reach the pool folder's parent
    directory = str(tmp_path / "pool")
    nobody = 65534
    try:
        ensure_local_pool(directory, "16MiB")
        for path in (os.path.join(directory, "pool.key"), os.path.join(directory, "pool.json")):
            proc = subprocess.run(
                ["cat", path],
                capture_output=True,
                text=True,
                timeout=30,
                preexec_fn=lambda: (os.setgid(nobody), os.setuid(nobody)),
            )
            assert proc.returncode != 0 and "Permission denied" in proc.stderr and not proc.stdout
        os.chmod(directory, 0o711)  # even with the folder opened for traversal, the file itself is closed
        proc = subprocess.run(
            ["cat", os.path.join(directory, "pool.key")],
            capture_output=True,
            text=True,
            timeout=30,
            preexec_fn=lambda: (os.setgid(nobody), os.setuid(nobody)),
        )
        assert proc.returncode != 0 and "Permission denied" in proc.stderr
    finally:
        stop_local_pool(directory)


def test_a_folder_of_another_user_or_open_to_others_is_not_trusted(tmp_path):
    lax = tmp_path / "lax"
    lax.mkdir(mode=0o777)
    os.chmod(lax, 0o777)
    try:
        ensure_local_pool(str(lax), "16MiB")
        assert os.stat(lax).st_mode & 0o777 == 0o700  # ours: closed
    finally:
        stop_local_pool(str(lax))
    link = tmp_path / "link"
    link.symlink_to(lax)
    with pytest.raises(EmsException) as err:
        ensure_local_pool(str(link), "16MiB")
    assert err.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT and "local_pool_dir" in err.value.message()
    if os.getuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 65534, 65534)
        with pytest.raises(EmsException, match="not a directory owned by this user"):
            ensure_local_pool(str(foreign), "16MiB")


def test_a_node_without_the_current_key_is_replaced(tmp_path, caplog):
    directory = str(tmp_path)
    try:
        first = ensure_local_pool(directory, "16MiB")
        os.remove(os.path.join(directory, "pool.key"))  # a new key: the running node does not know it
        with caplog.at_level(logging.WARNING, logger="ems.integrations"):
            second = ensure_local_pool(directory, "16MiB")
        assert second.started and second.access_key != first.access_key and not answers(first.address)
        assert any("current key file" in r.getMessage() for r in caplog.records)
        record = read_record(directory)
        assert record is not None and first.access_key not in json.dumps(record)  # the record holds a digest
    finally:
        stop_local_pool(directory)

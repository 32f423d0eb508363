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
        code = ("import sys; from ems.integrations.local_pool import ensure_local_pool as e; "
                "print(e(sys.argv[1], '16MiB').address)")
        procs = [subprocess.Popen([sys.executable, "-c", code, directory], stdout=subprocess.PIPE, text=True)
                 for _ in range(4)]
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
    code = ("import sys, time; from ems.integrations.local_pool import ensure_local_pool as e; "
            "n = e(sys.argv[1], '16MiB'); print(n.address, n.pid, flush=True); time.sleep(600)")
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

"""local_pool: processes that find no configured pool share one real `ems.pool` node on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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

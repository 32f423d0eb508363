"""transport/ucx/direct.py under each client submission mode (`ucx.config.Submission`, EMS_UCX_CLIENT_SUBMIT), against
a real pool node over UCX (shared memory off): one client process per mode, since a process has one client worker.

In every mode the process runs the mode it was given, values of every size (64 B inline to 1 MiB) come back
byte-exact, and small calls (exists, ping) and bulk calls (put, get) from several threads at once on one connection
each get their own answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ems.transport.ucx.config import Submission

CHILD = r"""
import json, sys, threading
sys.path.insert(0, sys.argv[2])
from pool_testlib import joined, make_values
from ems.transport.shm.client import ShmMode
from ems.transport.ucx.client import UcxNode
from ems.transport.ucx.direct import DirectRuntime

node = UcxNode(sys.argv[1], connect_timeout_ms=5000, shm=ShmMode.OFF)
errors = []

def worker(i):
    try:
        values = make_values(3, 64, seed=i) + make_values(3, 1 << 20, seed=100 + i)
        keys = [b"submit-%s-%d-%d" % (sys.argv[3].encode(), i, j) for j in range(len(values))]
        for _ in range(5):
            assert node.exists(keys, 10.0) == [False] * len(keys)
            assert node.ping(10.0)
        assert node.put(keys, values, 10.0) == [True] * len(keys)
        for _ in range(20):
            assert node.exists(keys, 10.0) == [True] * len(keys)
        got = node.get(keys, 10.0)
        assert [bytes(g) for g in got] == [joined(v) for v in values], "bytes differ"
        outs = [bytearray(len(joined(v))) for v in values]
        assert node.get_into(keys, outs, 10.0) == [True] * len(keys)
        assert [bytes(o) for o in outs] == [joined(v) for v in values], "bytes differ (get_into)"
    except BaseException as error:
        errors.append(f"thread {i}: {error!r}")

threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join(120)
node.close()
print(json.dumps({"mode": DirectRuntime.get().submission.value, "errors": errors}))
"""


@pytest.mark.parametrize("mode", [m.value for m in Submission])
def test_each_mode_moves_values_exactly_with_calls_in_flight(shared_node, mode):
    env = dict(os.environ, EMS_UCX_CLIENT_SUBMIT=mode)
    pool_tests = str(Path(__file__).resolve().parent.parent / "pool")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, shared_node.address, pool_tests, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"mode": mode, "errors": []}

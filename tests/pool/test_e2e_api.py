"""End to end through the public API (`import ems`) with real pool nodes. A process holds one `Ems.init` at a time, so each
client runs in its own process (`e2e_client.py`): one process saves, another loads the same blocks byte-exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pool_testlib import KEY_A, KEY_B

pytestmark = pytest.mark.slow
CLIENT = str(Path(__file__).resolve().parent / "e2e_client.py")


def run_client(**args) -> dict:
    proc = subprocess.run([sys.executable, CLIENT, json.dumps(args)], capture_output=True, text=True, timeout=90)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, (proc.stdout, proc.stderr[-3000:])
    return json.loads(lines[-1])


def test_save_in_one_process_load_in_another(pool_nodes):
    nodes = [pool_nodes().address for _ in range(3)]
    saved = run_client(nodes=nodes, steps=["health", "save", "exists"])
    assert saved == {"health": True, "save": [12, 12], "exists": [12, 12]}
    loaded = run_client(nodes=nodes, steps=["exists", "load"])
    assert loaded == {"exists": [12, 12], "load": [12, 12], "load_exact": True}


def test_tokens_saved_in_one_process_load_in_another(pool_nodes):
    """The token form's keys are derived from the token ids alone (never Python's hash(), which differs per
    process): a process that saves by tokens and another that loads them by tokens (an int32 tensor there, a list
    here) meet, over three nodes; the second holds the first 6 tokens already and gets the other 42, byte-exact."""
    nodes = [pool_nodes().address for _ in range(3)]
    assert run_client(nodes=nodes, steps=["tsave"]) == {"tsave": [48, 48]}
    assert run_client(nodes=nodes, steps=["tload"]) == {"tload": [42, 42], "tload_exact": True}


def test_a_dead_node_is_a_miss_not_an_error(pool_nodes):
    procs = [pool_nodes() for _ in range(3)]
    nodes = [p.address for p in procs]
    assert run_client(nodes=nodes, steps=["save"])["save"] == [12, 12]
    procs[0].kill()
    loaded = run_client(nodes=nodes, steps=["load"])
    assert loaded["load_exact"] and loaded["load"][0] <= 12  # the prefix before the first block of the dead node


def test_unreachable_pool_fails_init(pool_nodes):
    out = run_client(nodes=["127.0.0.1:1"], steps=["save"])
    assert out["init_error"] == "EMS_RECOVERD_ERROR"  # the SDK's code: not reachable yet, retry init


def test_tenants_through_the_api(pool_nodes):
    node = pool_nodes(keys={"alpha": KEY_A, "beta": KEY_B}).address
    alpha = {"access_id": "alpha", "access_key": KEY_A}
    beta = {"access_id": "beta", "access_key": KEY_B}
    assert run_client(nodes=[node], steps=["save"], **alpha)["save"] == [12, 12]
    assert run_client(nodes=[node], steps=["exists", "load"], **beta) == {"exists": [0, 12], "load": [0, 12], "load_exact": True}
    assert run_client(nodes=[node], steps=["load"], **alpha)["load"] == [12, 12]
    wrong = run_client(nodes=[node], steps=["save"], access_id="alpha", access_key=KEY_B)
    assert wrong["init_error"] == "EMS_IO_ERROR" and "authentication failed" in wrong["message"]


def test_mla_ranks_share_blocks(pool_nodes):
    node = pool_nodes().address
    assert run_client(nodes=[node], steps=["save"], mla=True, rank=0)["save"] == [12, 12]
    assert run_client(nodes=[node], steps=["load"], mla=True, rank=1) == {"load": [12, 12], "load_exact": True}

"""Defect 1 of issue 7: a frame shorter than announced must never let a tenant read another tenant's bytes.

The attack: tenant B sends a PUT announcing one value of S bytes and then a data frame of 1 byte. A node that
received into a buffer recycled from tenant A's overwritten value of S bytes, without checking how much arrived,
stored A's value under B's key (A's bytes are a complete valid value, so the checksum passed) and B's GET returned
it. The same root cause accepted header frames of 16 or 31 bytes, completed from stale memory. Every other frame kind,
cut short by every length, on both sides of the wire: `test_exact_frames.py`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pool_testlib import KEY_A, KEY_B, joined, make_values
from raw_ucx import CLOSED, RawSession

from ems.transport import protocol

pytestmark = pytest.mark.slow
TENANTS = {"alpha": KEY_A, "beta": KEY_B}
SAVER = str(Path(__file__).resolve().parent / "api_saver.py")


def _short_put_then_get(port: int, announced: int) -> tuple[object, object]:
    """Tenant beta's attack: PUT `stolen` announcing `announced` bytes, send 1 byte; then GET it on a new
    connection. Returns (what the PUT got, what the GET got)."""
    with RawSession(port) as attacker:
        attacker.login("beta", KEY_B)
        attacker.send(*attacker.put_frames(b"stolen", announced, [b"E"]))  # 'E': the first byte of every value
        put_outcome = attacker.reply(timeout_s=5.0)
    with RawSession(port) as reader:
        reader.login("beta", KEY_B)
        got = reader.get([b"stolen"])
    return put_outcome, got


def test_short_data_frame_cannot_read_a_recycled_v0_value(pool_nodes, node_clients):
    node = pool_nodes("64MiB", keys=TENANTS)
    alpha = node_clients(node.address, access_id="alpha", access_key=KEY_A)
    first, second = make_values(2, 100_000, seed=11)
    assert alpha.put([b"secret"], [first], 5.0) == [True]
    assert alpha.put([b"secret"], [second], 5.0) == [True]  # the first value's buffer is now a spare of its size
    put_outcome, got = _short_put_then_get(node.port, len(joined(first)))
    assert isinstance(got, list), got
    assert got[0] != joined(first), "tenant beta read tenant alpha's value"
    assert got[0] is None, "a short frame stored a value"
    assert put_outcome == CLOSED, put_outcome  # the node refused the short frame and dropped that connection
    assert bytes(alpha.get([b"secret"], 5.0)[0]) == joined(second)  # the victim is unharmed
    assert node.proc.poll() is None


def test_short_data_frame_cannot_read_a_block_saved_twice_through_the_api(pool_nodes):
    node = pool_nodes("64MiB", keys=TENANTS)
    proc = subprocess.run(
        [sys.executable, SAVER, json.dumps({"nodes": [node.address], "access_id": "alpha", "access_key": KEY_A, "times": 2})],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, (proc.stdout, proc.stderr[-3000:])
    saved = json.loads(lines[-1])
    assert saved["saves"] == [1, 1] and saved["load"] == 1 and saved["load_exact"], saved
    assert saved["value_len"] >= protocol.SEGMENT_BYTES  # a 1 MiB block travels (and is stored) as its own buffer
    put_outcome, got = _short_put_then_get(node.port, saved["value_len"])
    assert isinstance(got, list), got
    assert got[0] is None or len(got[0]) != saved["value_len"], "tenant beta read tenant alpha's block"
    assert got[0] is None, "a short frame stored a value"
    assert put_outcome == CLOSED, put_outcome


@pytest.mark.parametrize("length", [1, 16, 24, 31])
@pytest.mark.parametrize("when", ["before-handshake", "after-handshake"])
def test_short_header_frames_are_refused(shared_node, node_clients, length, when):
    """A PING header cut to `length` bytes: the node must close the connection, not complete the header from
    stale memory and answer it."""
    ping = protocol.pack_header(protocol.Op.PING)
    with RawSession(shared_node.port) as raw:
        if when == "after-handshake":
            raw.login()
            assert isinstance(raw.get([b"warm"]), list)  # a full request first, so stale header bytes are likely
        raw.send(ping[:length])
        outcome = raw.reply(timeout_s=3.0)
    assert outcome == CLOSED, outcome
    assert node_clients(shared_node.address).ping(2.0)

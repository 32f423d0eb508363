"""Defect 1 of issue 7: a frame shorter than announced must never let a tenant read another tenant's bytes.

The attack: tenant B sends a PUT announcing one value of S bytes and then a data frame of 1 byte. A node that
received into a buffer recycled from tenant A's overwritten value of S bytes, without checking how much arrived,
stored A's value under B's key (A's bytes are a complete valid value, so the checksum passed) and B's GET returned
it. The same root cause accepted header frames of 16 or 31 bytes, completed from stale memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pool_testlib import KEY_A, KEY_B, client_of_scripted_node, joined, make_values
from raw_ucx import CLOSED, SILENT, RawSession, Reply

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


@pytest.mark.parametrize("cut", [1, 7, 8, 100])
def test_short_meta_frames_are_refused(shared_node, node_clients, cut):
    """A GET whose key-bytes meta arrives `cut` bytes short."""
    keys = [b"k" * 40, b"other-key" * 3]
    meta = protocol.encode_keys_meta(keys)
    with RawSession(shared_node.port) as raw:
        raw.login()
        raw.send(protocol.pack_header(protocol.Op.GET, count=2, meta_len=len(meta)), meta[: max(0, len(meta) - cut)] or b"x")
        outcome = raw.reply(timeout_s=2.0)
    # short by 8 or more: detected and closed; by fewer: the missing bytes are the node's random canary, which
    # cannot decode to the keys the client meant (never to stale bytes): a refusal or a miss, nothing else
    if cut >= 8:
        assert outcome == CLOSED, outcome
    else:
        assert outcome in (CLOSED, SILENT) or (isinstance(outcome, Reply) and outcome.header.data_len == 0), outcome
    assert node_clients(shared_node.address).ping(2.0)


def test_client_refuses_a_short_reply_segment():
    """The client side: a GET reply segment shorter than announced raises instead of returning stale bytes."""
    import asyncio

    from ems.errors import EmsErrorCode
    from ems.transport.base import TransportError
    from ems.transport.ucx_frames import recv_head, recv_header_frame, recv_meta, send_all

    value = joined(make_values(1, 300_000, seed=3)[0])

    async def fake_node(ep) -> None:
        try:
            await recv_header_frame(ep)
            await recv_meta(ep, 0)
            nonce = bytes(protocol.NONCE_BYTES)
            await send_all(ep, [protocol.pack_header(protocol.Op.CHALLENGE, meta_len=len(nonce)), nonce])
            await recv_header_frame(ep)
            await send_all(ep, [protocol.pack_header(protocol.Op.AUTH | protocol.REPLY)])
            header, _ = await recv_head(ep)  # the GET, inline (protocol version 2)
            rid = header.request_id
            lens = np.array([len(value)], "<i8").tobytes()
            reply = protocol.pack_header(
                protocol.Op.GET | protocol.REPLY,
                count=1,
                meta_len=8,
                data_len=len(value),
                flags=protocol.Flags.INLINE,
                request_id=rid,
            )
            # the head (header and lens) and then a data frame of 10 bytes of 300,040, on the request's tag
            await send_all(ep, [protocol.pack_head(reply, lens), np.frombuffer(value[:10], np.uint8)], rid)
            await asyncio.sleep(2.0)
        except Exception:  # the client hung up
            pass

    with client_of_scripted_node(fake_node) as node:
        # the client's buffer for the segment first holds whatever was freed before: make that the value itself
        with pytest.raises(TransportError) as info:
            node.get([b"k"], 5.0)
        assert info.value.status_code() == EmsErrorCode.EMS_IO_ERROR
        assert "shorter" in info.value.message()

"""Issue 16, item 5: messages a node never receives hold none of its memory once their sender has left, and a
request id may be reused as soon as its reply has arrived (protocol docstring, "Tags" and "Request ids").

Attacks from a raw UCX client: thousands of messages on tags of no connection, on the connection's own request
tags before the handshake, and heads parked behind 32 stalled requests; each repeated for a few rounds, the node's
resident memory must not grow round after round (UCX keeps the buffers it released for reuse)."""

from __future__ import annotations

import time
import urllib.request

import numpy as np
import pytest
from cluster_testlib import free_port
from pool_testlib import PoolProcess, joined, make_values, wait_until
from prometheus_client.parser import text_string_to_metric_families
from raw_ucx import CLOSED, RawSession

from ems.transport import metas, protocol
from ems.transport.ucx import frames as ucx_frames

pytestmark = pytest.mark.slow
MiB = 1 << 20
FRAME = np.random.default_rng(16).integers(0, 256, 4096, dtype=np.uint8)


def _inline_head(op: int, request_id: int, meta: bytes = b"", data_len: int = 0, count: int = 1) -> np.ndarray:
    header = protocol.pack_header(
        op,
        count=count,
        meta_len=len(meta),
        meta_end=protocol.end_byte(meta),
        data_len=data_len,
        flags=protocol.Flags.INLINE,
        request_id=request_id,
    )
    return ucx_frames.pack_head(header, meta)


def _rounds(node, attack, rounds: int = 5) -> list[int]:
    """The node's RSS after each round of `attack(port)` (each round's client has left and been swept)."""
    sizes = []
    for _ in range(rounds):
        attack(node.port)
        time.sleep(1.2)  # two watchdog sweeps
        sizes.append(node.rss_bytes())
    return sizes


def _assert_bounded(sizes: list[int]) -> None:
    # without the sweep every round added ~31-47 MiB (+120 MiB or more over these rounds); with it, UCX's buffer
    # pools grow to their peak in one or two rounds (~14 MiB on a quiet host; 7 then 25 MiB with both cores busy,
    # where more messages wait at once) and are reused after: most rounds add (almost) nothing
    steps = np.diff(sizes)
    assert float(np.median(steps)) < 8 * MiB and sizes[-1] - sizes[0] < 48 * MiB, [s / MiB for s in sizes]


def _exercise(port: int) -> None:
    """Issue 42's exercise: 12,000 frames of 4 KiB, a third each on a connection's request tags before its
    handshake, on request ids not in flight after it, and on tags of no connection; then the clients leave."""
    before = RawSession(port)
    before.post_sends(*([FRAME] * 4000), tags=[1 + i % 97 for i in range(4000)])
    after = RawSession(port)
    after.login()
    after.post_sends(*([FRAME] * 4000), tags=[1000 + i % 97 for i in range(4000)])
    nowhere = RawSession(port)
    nowhere.post_sends(*([FRAME] * 4000), tags=[(7 << 40) + i % 97 for i in range(4000)], raw_tags=True)
    time.sleep(1.0)
    for raw in (before, after, nowhere):
        raw.close()


def test_the_messages_nobody_will_receive_are_discarded_as_they_arrive():
    """The node's resident memory 10 s after five rounds of the exercise stays within 16 MiB of its level before
    them, and flat from round to round after the first: the messages are discarded while they arrive (the watchdog alone let them
    pile up to +62-64 MiB); the discards are counted in the node's metrics."""
    metrics = f"127.0.0.1:{free_port()}"
    node = PoolProcess("8MiB", args=["--metrics", metrics])
    try:
        time.sleep(1.0)
        base = node.rss_bytes()
        sizes = []
        for _ in range(5):
            _exercise(node.port)
            time.sleep(1.5)
            sizes.append(node.rss_bytes())
        time.sleep(10.0)
        final = node.rss_bytes()
        figures = {"base_mib": base / MiB, "rounds_mib": [(s - base) / MiB for s in sizes], "final_mib": (final - base) / MiB}
        assert final - base < 16 * MiB, figures
        # flat: no round keeps more than the one before it. From the second round on: the first can end below the
        # allocator's high-water mark, which a later round reaches once (a CI run read +3.1, then +11.5 to +11.7 MiB)
        later = sizes[1:]
        assert max(later) - min(later) < 8 * MiB, figures
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as reply:
            scraped = {
                sample.name: sample.value
                for family in text_string_to_metric_families(reply.read().decode())
                for sample in family.samples
            }
        # (messages that reach a connection after the node aborted it are dropped by UCX itself, never unread)
        assert scraped["ems_pool_unread_discarded_total"] > 4000, scraped
        assert scraped["ems_pool_unread_discarded_bytes_total"] >= scraped["ems_pool_unread_discarded_total"] * 4096
        assert scraped["ems_pool_stray_closes_total"] >= 10  # two connections a round
        log = node.log_text()
        assert "before the handshake" in log and "not in flight" in log and "discarded" in log
    finally:
        node.kill()


def test_messages_on_tags_of_no_connection_are_discarded(pool_nodes, node_clients):
    node = pool_nodes("8MiB")

    def attack(port: int) -> None:
        raw = RawSession(port)  # no HELLO: 4,000 messages of 4 KiB on assorted tags of no connection, then abort
        raw.post_sends(*([FRAME] * 4000), tags=[(7 << 40) + i % 97 for i in range(4000)], raw_tags=True)
        time.sleep(0.5)
        raw.close()

    _assert_bounded(_rounds(node, attack))
    assert "discarded" in node.log_text()
    assert node_clients(node.address).ping(2.0)


def test_messages_on_request_tags_before_the_handshake_close_the_connection(pool_nodes, node_clients):
    node = pool_nodes("8MiB")

    def attack(port: int) -> None:
        raw = RawSession(port)
        raw.post_sends(*([FRAME] * 4000), tags=[1 + i % 97 for i in range(4000)])  # the connection's own tags
        outcome = raw.recv(protocol.HEADER_SIZE, timeout_s=3.0)
        raw.close()
        assert outcome == CLOSED, outcome

    _assert_bounded(_rounds(node, attack))
    assert "before the handshake" in node.log_text()
    assert node_clients(node.address).ping(2.0)


def test_heads_parked_behind_stalled_requests_are_released_when_the_client_leaves(pool_nodes, node_clients):
    node = pool_nodes("8MiB")

    def attack(port: int) -> None:
        raw = RawSession(port)
        raw.login()
        frames, tags = [], []
        for rid in range(1, 33):  # fill the connection's 32 request slots with PUTs whose data never come
            meta = metas.encode_put_meta([b"k%d" % rid], np.array([MiB]), np.array([MiB]), bytes(1))
            frames.append(_inline_head(protocol.Op.PUT, rid, meta, data_len=MiB))
            tags.append(None)
        get_meta = metas.encode_keys_meta([b"a" * 4000, b"b" * 4000])
        for rid in range(100, 4100):  # then 4,000 GET heads of ~8 KiB the node will not read
            frames.append(_inline_head(protocol.Op.GET, rid, get_meta, count=2))
            tags.append(None)
        raw.post_sends(*frames, tags=tags)
        time.sleep(0.5)
        raw.close()

    _assert_bounded(_rounds(node, attack))
    assert node_clients(node.address).ping(2.0)


def test_messages_parked_on_a_request_not_in_flight_close_the_connection(pool_nodes, node_clients):
    node = pool_nodes("8MiB")
    with RawSession(node.port) as raw:
        raw.login()
        raw.post_sends(*([FRAME] * 200), tags=[999] * 200)  # data for request 999, whose head never comes
        t0 = time.monotonic()
        assert wait_until(lambda: raw.recv(protocol.HEADER_SIZE, timeout_s=0.5) == CLOSED, 5.0, 0.0)
        assert time.monotonic() - t0 < 4.0
    assert "not in flight" in node.log_text()
    assert node_clients(node.address).ping(2.0)


def test_a_request_id_may_be_reused_as_soon_as_its_reply_arrived(pool_nodes, node_clients):
    node = pool_nodes("64MiB")
    values = make_values(1, 4 * MiB, seed=7)  # sent by rendezvous: its send ends only once the client has it
    value = np.frombuffer(joined(values[0]), dtype=np.uint8)
    assert node_clients(node.address).put([b"v"], values, 5.0) == [True]
    head = _inline_head(protocol.Op.GET, 7, metas.encode_keys_meta([b"v"]))
    reply_head = ucx_frames.head_layout(8, value.size).length
    with RawSession(node.port) as raw:
        raw.login()
        for i in range(100):  # the same id, again the moment its reply is in (the node's send may not have ended)
            raw.post_sends(head, tags=[None])
            got = raw.recv_tagged(reply_head, 7, timeout_s=5.0)
            assert not isinstance(got, str), (i, got)
            reply = protocol.unpack_header(got[: protocol.HEADER_SIZE])
            assert reply.status == protocol.Status.OK and reply.op == protocol.Op.GET | protocol.REPLY, (i, reply)
            data = raw.recv_tagged(value.size, 7, timeout_s=5.0)
            assert not isinstance(data, str), (i, data)
            assert np.array_equal(data, value), i
    assert "already in flight" not in node.log_text()
    assert node_clients(node.address).ping(2.0)

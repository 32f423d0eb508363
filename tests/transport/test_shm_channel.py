"""Both ends of a region's channel over a socket pair, each against a scripted peer: the client's `ClientChannel`
(replies split across receives, several in one, late, cut off) and the node's `RequestReader` (many requests per
receive, reading paused while too much is held, the ends of a channel). The real node and client over the channel:
tests/transport/test_shm.py."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ems.transport import metas, protocol
from ems.transport.shm.wire import CHANNEL_IN_FLIGHT, CHANNEL_OPS
from ems.transport.stream import ChannelClosed, ChannelTimeout, ClientChannel
from ems.transport.stream_node import RequestReader

EXISTS = int(protocol.Op.EXISTS)


def _exists_request(request_id: int, keys: list[bytes]) -> bytes:
    meta = metas.encode_keys_meta(keys)
    head = protocol.pack_header(
        EXISTS, count=len(keys), meta_len=len(meta), request_id=request_id, meta_end=protocol.end_byte(meta)
    )
    return head.tobytes() + meta


def _exists_reply(request_id: int, flags: list[bool]) -> bytes:
    meta = protocol.encode_flags(flags)
    head = protocol.pack_header(
        EXISTS | protocol.REPLY,
        count=len(flags),
        meta_len=len(meta),
        request_id=request_id,
        meta_end=protocol.end_byte(meta),
    )
    return head.tobytes() + meta


def _read_request(sock: socket.socket) -> protocol.Header | None:
    """One request off the node's end (blocking), or None once the client closed it."""
    head = b""
    while len(head) < protocol.HEADER_SIZE:
        chunk = sock.recv(protocol.HEADER_SIZE - len(head))
        if not chunk:
            return None
        head += chunk
    header = protocol.unpack_header(head)
    meta = b""
    while len(meta) < header.meta_len:
        meta += sock.recv(header.meta_len - len(meta))
    return header


@pytest.fixture
def pair():
    client_end, node_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    node_end.settimeout(10.0)
    channel = ClientChannel(client_end, CHANNEL_IN_FLIGHT)
    yield channel, node_end
    channel.close()
    node_end.close()


def _lookup(channel: ClientChannel, keys: int, timeout_s: float = 5.0, keep_on_timeout: bool = False) -> list[bool]:
    meta = metas.encode_keys_meta([b"k%d" % i for i in range(keys)])
    body = channel.request(EXISTS, keys, meta, time.monotonic() + timeout_s, keep_on_timeout=keep_on_timeout)
    return protocol.decode_flags(keys, body)


# ---------------------------------------------------------------- the client's end


def test_a_reply_sent_a_byte_at_a_time_arrives_whole(pair):
    channel, node_end = pair

    def node() -> None:
        header = _read_request(node_end)
        assert header is not None
        for byte in _exists_reply(header.request_id, [True, False, True]):
            node_end.sendall(bytes([byte]))
            time.sleep(0.001)

    peer = threading.Thread(target=node)
    peer.start()
    assert _lookup(channel, 3) == [True, False, True]
    peer.join()


@settings(max_examples=25, deadline=None)
@given(callers=st.integers(2, 8), seed=st.integers(0, 2**32 - 1))
def test_replies_in_any_order_and_any_cut_reach_their_own_callers(callers, seed):
    """Callers in flight at once; the node answers all of them in a random order, as one stream cut at random
    places (several replies in one receive, one reply over several): each caller gets its own reply's flags."""
    rng = random.Random(seed)
    client_end, node_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    node_end.settimeout(10.0)
    channel = ClientChannel(client_end, in_flight=callers)
    keys_of = {t: 1 + t for t in range(callers)}  # each caller asks a different number of keys: its reply says which
    got: dict[int, list[bool]] = {}

    def caller(t: int) -> None:
        got[t] = _lookup(channel, keys_of[t])

    def node() -> None:
        asked = [_read_request(node_end) for _ in range(callers)]
        rng.shuffle(asked)
        stream = b"".join(_exists_reply(h.request_id, [i % 2 == 0 for i in range(h.count)]) for h in asked if h)
        cuts = sorted(rng.sample(range(1, len(stream)), min(len(stream) - 1, rng.randint(0, 12))))
        for start, end in zip([0, *cuts], [*cuts, len(stream)]):
            node_end.sendall(stream[start:end])
            time.sleep(rng.choice((0, 0, 0.001)))

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(callers)]
    peer = threading.Thread(target=node)
    try:
        peer.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        peer.join(10)
        assert got == {t: [i % 2 == 0 for i in range(keys_of[t])] for t in range(callers)}
        assert not channel.spent
    finally:
        channel.close()
        node_end.close()


def test_a_lookup_given_up_between_frames_leaves_the_channel_serving(pair):
    """A lookup's timeout with nothing of its reply received: it is abandoned, its late reply dropped, and the next
    request is answered on the same channel."""
    channel, node_end = pair
    asked: list[protocol.Header] = []

    def node() -> None:
        header = _read_request(node_end)
        assert header is not None
        asked.append(header)
        time.sleep(1.0)  # well past the caller's deadline (0.1 s), whatever the host's load
        node_end.sendall(_exists_reply(header.request_id, [True]))
        second = _read_request(node_end)
        assert second is not None
        node_end.sendall(_exists_reply(second.request_id, [False, True]))

    peer = threading.Thread(target=node)
    peer.start()
    with pytest.raises(ChannelTimeout) as timeout:
        _lookup(channel, 1, timeout_s=0.1, keep_on_timeout=True)
    assert not timeout.value.mid_frame and not channel.spent
    assert _lookup(channel, 2) == [False, True]
    peer.join()
    assert len(asked) == 1


def test_a_timeout_with_part_of_a_reply_held_spends_the_channel(pair):
    """Half a reply received when the deadline strikes: the stream is out of step, so the channel fails every
    request from then on (its callers drop the connection), even a lookup's."""
    channel, node_end = pair

    def node() -> None:
        header = _read_request(node_end)
        assert header is not None
        node_end.sendall(_exists_reply(header.request_id, [True])[:10])

    peer = threading.Thread(target=node)
    peer.start()
    with pytest.raises(ChannelTimeout) as timeout:
        _lookup(channel, 1, timeout_s=1.0, keep_on_timeout=True)  # (the half reply goes out at once)
    peer.join()
    assert timeout.value.mid_frame and channel.spent
    with pytest.raises(ChannelClosed):
        _lookup(channel, 1)


def test_the_node_closing_the_channel_fails_the_request(pair):
    channel, node_end = pair

    def node() -> None:
        _read_request(node_end)
        node_end.shutdown(socket.SHUT_WR)

    peer = threading.Thread(target=node)
    peer.start()
    with pytest.raises(ChannelClosed):
        _lookup(channel, 1)
    peer.join()
    assert channel.spent


# ---------------------------------------------------------------- the node's end


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_the_reader_parses_every_request_in_order_and_holds_a_bounded_amount():
    """Far more requests than one receive takes, written at once while the parser reads slowly: each is parsed, in
    order, and what the reader holds unparsed never passes READ_BYTES plus one receive (it stops reading)."""
    count = 6000  # ~80 bytes each: over seven times READ_BYTES
    stream = b"".join(_exists_request(rid, [b"key-%d" % rid]) for rid in range(1, count + 1))
    assert len(stream) > 4 * RequestReader.READ_BYTES

    async def main() -> tuple[list[int], int]:
        node_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        node_end.setblocking(False)
        writer = threading.Thread(target=client_end.sendall, args=(stream,))
        writer.start()
        reader = RequestReader(node_end, CHANNEL_OPS)
        ids, most = [], 0
        try:
            while len(ids) < count:
                request = await reader.next()
                assert request is not None
                ids.append(request[0].request_id)
                most = max(most, len(reader._held))
                if len(ids) % 500 == 0:
                    await asyncio.sleep(0.01)  # a slow parser: the socket fills meanwhile
        finally:
            reader.close()
            writer.join(10)
            node_end.close()
            client_end.close()
        return ids, most

    ids, most = _run(main())
    assert ids == list(range(1, count + 1))
    assert most <= 2 * RequestReader.READ_BYTES


def test_the_reader_sees_the_channels_ends():
    """The client closing between requests: None; closing mid-request: ConnectionError; `close()` leaves the
    socket unwatched (the loop has no reader for it)."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for cut, expect_none in ((0, True), (10, False), (protocol.HEADER_SIZE + 2, False)):
            node_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            node_end.setblocking(False)
            reader = RequestReader(node_end, CHANNEL_OPS)
            whole = _exists_request(5, [b"a", b"b"])
            client_end.sendall(whole + whole[:cut])
            client_end.close()
            request = await reader.next()
            assert request is not None and request[0].request_id == 5
            if expect_none:
                assert await reader.next() is None
            else:
                with pytest.raises(ConnectionError):
                    await reader.next()
            reader.close()
            assert not loop.remove_reader(node_end.fileno())
            node_end.close()

    _run(main())


def test_a_shut_reading_side_ends_a_pending_read():
    """The node ends a channel by shutting its reading side (a refused request): the read waiting for the next
    request returns at once, as the client's close would."""

    async def main() -> float:
        node_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        node_end.setblocking(False)
        reader = RequestReader(node_end, CHANNEL_OPS)
        pending = asyncio.ensure_future(reader.next())
        await asyncio.sleep(0.05)
        started = time.monotonic()
        node_end.shutdown(socket.SHUT_RD)
        assert await pending is None
        reader.close()
        node_end.close()
        client_end.close()
        return time.monotonic() - started

    assert _run(main()) < 1.0

"""A region's request channel: SHM_GET / SHM_PUT and their replies over the Unix socket the region was handed over on.

Contract:
* After the hand-over (`shm.server`, `shm.client`) the socket stays open, one per region, and carries that region's
  data requests and the connection's lookups (EXISTS, with its LEASE or PIN flag; the node answers it as on UCX):
  the same 32-byte header and meta as on UCX (`protocol.pack_header`; no data frames, count and
  request id as there), the reply a header (op | REPLY, status, count, meta length) and its meta. The socket's
  peer was proven at the hand-over (token, SO_PEERCRED both ways), so a request on it belongs to the region's
  connection and tenant; only SHM_GET, SHM_PUT and EXISTS travel on it, and the node serves them as it serves the same
  ops on UCX. Up to `CHANNEL_IN_FLIGHT` requests are in flight on it at once, told apart by their request ids (an
  id is not reused while its request is in flight: the node ends the channel if it is); a client call takes one of
  the channel's slots for its whole request, and one that finds none free goes over UCX. The node serves the
  requests of a channel at once and writes each reply whole; replies may come in any order.
* The node ends a channel on anything malformed (a ProtocolError) and on a refusal (answered BAD_REQUEST first),
  and when the region's connection ends. The client drops the connection after any failure on its channel
  (a timeout included), as after any failed UCX request: the region is poisoned and a fresh connection gets a
  fresh region.
* Client side, `ClientChannel.request` keeps the GIL through its socket calls (non-blocking `send` / `recv` through
  libc with the GIL held) and releases it once, to wait for the reply (`poll`). With several requests in flight,
  one waiter at a time reads the socket and hands the others their replies (each waking only its owner); any failure
  (a timeout included) spends the channel for every request on it.

Why: over UCX an SHM request posts its receive and its head (ucxx releases the GIL for each post) and then waits:
three GIL hand-overs per request, each up to a switch interval (5 ms) beside a busy Python thread (an engine's
loop). Here a request costs one (perf/RESULTS.md, "Same-host requests over the region's socket").
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import select
import socket
import threading
import time
from collections.abc import Callable

from ems.transport import protocol

_MSG_DONTWAIT = 0x40
_MSG_NOSIGNAL = 0x4000
_MAX_POLL_MS = 60_000
# what travels on a channel: the region's data requests, and lookups (a same-host EXISTS costs a socket round trip
# here, against UCX's posts and progress thread: perf/RESULTS.md, "exists over the region's channel")
CHANNEL_OPS = frozenset({int(protocol.Op.SHM_GET), int(protocol.Op.SHM_PUT), int(protocol.Op.EXISTS)})
_NOT_ON_A_CHANNEL = int(protocol.Flags.INLINE)  # a UCX framing: never on a channel
CHANNEL_IN_FLIGHT = 8  # requests in flight on one region's channel (the node serves them at once, in this bound)

_libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: these calls keep the GIL (never block: MSG_DONTWAIT)
_libc.send.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.send.restype = ctypes.c_ssize_t
_libc.recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.recv.restype = ctypes.c_ssize_t


class ChannelTimeout(Exception):
    """No reply within the call's deadline. `mid_frame`: it struck with part of a frame sent or read, so the socket's
    stream is out of step (the channel cannot go on)."""

    def __init__(self, mid_frame: bool = False) -> None:
        super().__init__("mid-frame" if mid_frame else "between frames")
        self.mid_frame = mid_frame


class ChannelClosed(Exception):
    """The node closed the channel (it ended the region, or it died)."""


class ChannelRefused(Exception):
    """The node answered with an error status (its message is args[0])."""


class ClientChannel:
    """The client's end of a region's channel (see the module docstring)."""

    def __init__(self, sock: socket.socket, in_flight: int = CHANNEL_IN_FLIGHT) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._fd = sock.fileno()
        # a caller takes a slot for its whole request; one that finds none free uses UCX
        self.slots = threading.BoundedSemaphore(in_flight)
        self._send_lock = threading.Lock()  # one request's bytes at a time on the socket
        self._lock = threading.Lock()  # guards everything below
        self._head = ctypes.create_string_buffer(protocol.HEADER_SIZE)  # the reader's (one at a time)
        self._next_id = 0
        # the requests sent and not yet answered, each with its own event, set to wake just that waiter (its reply
        # handed over, the reading handed on to it, or a failure): a reply wakes one thread, not every waiter
        self._waiting: dict[int, threading.Event] = {}
        self._replies: dict[int, tuple[protocol.Header, bytes]] = {}  # read by the reader for another waiter
        self._reading = False  # a waiter is reading replies off the socket for everyone
        # requests given up at their deadline with the stream in step (`request(..., keep_on_timeout=True)`): their
        # late replies are read and dropped; each holds a place of the node's in-flight bound until then
        self._abandoned: set[int] = set()
        self._failure: str | None = None  # the channel is spent: why (every request on it raises ChannelClosed)
        self.closed = False

    @property
    def spent(self) -> bool:
        """Whether the channel fails every request from now on."""
        return self._failure is not None

    def close(self) -> None:
        self._spend_with("the channel is closed")
        self.closed = True
        self._sock.close()

    def request(
        self,
        op: int,
        count: int,
        meta: bytes,
        deadline_at: float,
        after_send: Callable[[int], None] | None = None,
        flags: int = 0,
        keep_on_timeout: bool = False,
    ) -> bytes:
        """Send one request and return its reply meta; the caller holds one of `slots`. ChannelTimeout past
        `deadline_at` (monotonic), ChannelRefused on an error status, ChannelClosed or ProtocolError otherwise.
        Any failure spends the channel for every request in flight on it (their callers drop the connection), except,
        with `keep_on_timeout` (a lookup, which writes nothing), a timeout that struck with the stream in step: the
        request is abandoned (its late reply dropped) and the requests beside it go on.
        `after_send(fd)` runs once the request is sent, before its reply is read: work that overlaps the node's
        (it may watch the socket's descriptor, never read it)."""
        woken = threading.Event()
        with self._lock:
            if self._failure is not None:
                raise ChannelClosed(self._failure)
            self._next_id = self._next_id % protocol.MAX_REQUEST_ID + 1
            rid = self._next_id
            self._waiting[rid] = woken
        try:
            header = protocol.pack_header(
                op, count=count, meta_len=len(meta), request_id=rid, meta_end=protocol.end_byte(meta), flags=flags
            )
            with self._send_lock:
                self._send_all(header.tobytes() + meta, deadline_at)
            if after_send is not None:
                after_send(self._fd)
            reply, body = self._reply_of(rid, woken, deadline_at)
        except ChannelTimeout as timeout:
            if keep_on_timeout and not timeout.mid_frame:
                with self._lock:
                    if self._replies.pop(rid, None) is None:  # (not read for it meanwhile: its reply is to come)
                        self._abandoned.add(rid)
            else:
                self._spend_with(f"the channel failed: {timeout!r}")
            raise
        except Exception as error:
            self._spend_with(f"the channel failed: {error!r}")
            raise
        finally:
            with self._lock:
                self._waiting.pop(rid, None)
        if reply.status != protocol.Status.OK:
            refused = ChannelRefused(body.decode("utf-8", "replace") or f"node answered status {reply.status}")
            self._spend_with(f"the node refused a request: {refused}")
            raise refused
        if reply.op != op | protocol.REPLY or reply.count != count:
            malformed = protocol.ProtocolError(f"expected op {op | protocol.REPLY:#x} for request {rid}, got {reply.op:#x}")
            self._spend_with(f"a malformed reply: {malformed}")
            raise malformed
        return body

    def _reply_of(self, rid: int, woken: threading.Event, deadline_at: float) -> tuple[protocol.Header, bytes]:
        """Request `rid`'s reply: handed over by the waiter reading the socket, or read here while no other waiter
        reads it (then the replies of others are handed to them, each waking only its own waiter). Alone, a request
        never waits on its event: it reads its own reply, so the GIL is given away once, in `poll`."""
        while True:
            with self._lock:
                if self._failure is not None:
                    raise ChannelClosed(self._failure)
                got = self._replies.pop(rid, None)
                if got is not None:
                    return got
                if not self._reading:
                    self._reading = True
                    break
                woken.clear()  # (under the lock: a hand-over after this sets it again)
            left = deadline_at - time.monotonic()
            if left <= 0 or not woken.wait(left):
                raise ChannelTimeout()
        try:
            while True:
                head = self._recv_exactly(protocol.HEADER_SIZE, deadline_at, self._head)
                reply = protocol.unpack_header(head)
                try:
                    body = self._recv_exactly(reply.meta_len, deadline_at) if reply.meta_len else b""
                except ChannelTimeout:
                    raise ChannelTimeout(mid_frame=True) from None
                protocol.check_meta_end(reply, body)
                if reply.request_id == rid:
                    return reply, body
                with self._lock:
                    owner = self._waiting.get(reply.request_id)
                    if owner is None and reply.request_id in self._abandoned:
                        self._abandoned.discard(reply.request_id)  # a late reply to a request given up: dropped
                        continue
                    if owner is None:
                        raise protocol.ProtocolError(f"a reply to request {reply.request_id}, which is not in flight")
                    self._replies[reply.request_id] = (reply, body)
                    owner.set()
        finally:
            with self._lock:
                self._reading = False
                # the reading goes on with one waiter still without its reply
                heir = next((e for r, e in self._waiting.items() if r != rid and r not in self._replies), None)
                if heir is not None:
                    heir.set()

    def _spend_with(self, why: str) -> None:
        """The channel fails every request on it from now on; the waiting ones are woken to see it."""
        with self._lock:
            if self._failure is None:
                self._failure = why
            for event in self._waiting.values():
                event.set()

    def _send_all(self, data: bytes, deadline_at: float) -> None:
        buffer = (ctypes.c_char * len(data)).from_buffer_copy(data)
        sent = 0
        while sent < len(data):
            n = _libc.send(self._fd, ctypes.addressof(buffer) + sent, len(data) - sent, _MSG_DONTWAIT | _MSG_NOSIGNAL)
            if n >= 0:
                sent += n
                continue
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            if code != errno.EAGAIN:
                raise ChannelClosed(os.strerror(code))
            try:
                self._wait(select.POLLOUT, deadline_at)
            except ChannelTimeout:
                raise ChannelTimeout(mid_frame=sent > 0) from None

    def _recv_exactly(self, n: int, deadline_at: float, into: ctypes.Array | None = None) -> bytes:
        buffer = into if into is not None and len(into) >= n else ctypes.create_string_buffer(n)
        got = 0
        while got < n:
            r = _libc.recv(self._fd, ctypes.addressof(buffer) + got, n - got, _MSG_DONTWAIT)
            if r > 0:
                got += r
                continue
            if r == 0:
                raise ChannelClosed("the node closed the channel")
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            if code != errno.EAGAIN:
                raise ChannelClosed(os.strerror(code))
            try:
                self._wait(select.POLLIN, deadline_at)  # the one place the GIL is given away
            except ChannelTimeout:
                raise ChannelTimeout(mid_frame=got > 0) from None
        return buffer.raw[:n]

    def _wait(self, events: int, deadline_at: float) -> None:
        poller = select.poll()
        poller.register(self._fd, events | select.POLLHUP | select.POLLERR)
        while True:
            left = deadline_at - time.monotonic()
            if left <= 0:
                raise ChannelTimeout()
            # at most a minute per poll (a deadline of years would overflow poll's int): the loop re-checks the deadline
            if poller.poll(min(int(left * 1000) + 1, _MAX_POLL_MS)):
                return


class NodeChannel:
    """The node's `RequestChannel` for one request read off a region's channel (`transport.handler.RequestChannel`)."""

    def __init__(
        self, sock: socket.socket, header: protocol.Header, conn: object, meta: bytes, sending: asyncio.Lock, region: object
    ) -> None:
        self.sock = sock
        self.header = header
        self.conn = conn
        self.region = region  # the region this channel belongs to (its requests are served over it, whatever comes later)
        self._meta = meta
        self._sending = sending  # the channel's: one reply's bytes at a time (requests are served at once)

    async def meta(self) -> bytes:
        return self._meta

    def inline_data(self) -> memoryview | None:
        return None

    async def receive_frames(self, views: object, ends: bytes) -> None:
        raise protocol.ProtocolError("shared-memory requests carry no data frames")

    async def reply(
        self,
        op: int,
        *,
        count: int = 0,
        meta: bytes = b"",
        data: object = (),
        data_len: int = 0,
        status: protocol.Status = protocol.Status.OK,
    ) -> None:
        if data or data_len:
            raise protocol.ProtocolError("a shared-memory reply carries no data frames")
        header = protocol.pack_header(
            op | protocol.REPLY,
            count=count,
            meta_len=len(meta),
            status=status,
            request_id=self.header.request_id,
            meta_end=protocol.end_byte(meta),
        )
        async with self._sending:
            await asyncio.get_running_loop().sock_sendall(self.sock, header.tobytes() + bytes(meta))


async def read_request(sock: socket.socket) -> tuple[protocol.Header, bytes] | None:
    """The next request's header and meta off a region's channel; None when the client closed it between requests.
    ProtocolError for anything but an SHM_GET, SHM_PUT or EXISTS within the protocol's limits (flags as the op
    defines them, `protocol.unpack_header`; never INLINE)."""
    head = await _recv_exactly(sock, protocol.HEADER_SIZE, allow_eof=True)
    if head is None:
        return None
    header = protocol.unpack_header(head)  # checks magic, version and every limit (meta length included)
    if header.op not in CHANNEL_OPS or header.data_len or header.status or header.flags & _NOT_ON_A_CHANNEL:
        raise protocol.ProtocolError(
            f"op {header.op} (data {header.data_len}, flags {header.flags:#x}) on a shared-memory channel"
        )
    meta = await _recv_exactly(sock, header.meta_len) if header.meta_len else b""
    protocol.check_meta_end(header, meta or b"")
    return header, meta or b""


async def _recv_exactly(sock: socket.socket, n: int, allow_eof: bool = False) -> bytes | None:
    loop = asyncio.get_running_loop()
    parts, got = [], 0
    while got < n:
        chunk = await loop.sock_recv(sock, min(n - got, 1 << 20))
        if not chunk:
            if allow_eof and got == 0:
                return None
            raise ConnectionError("the client closed the channel mid-request")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)

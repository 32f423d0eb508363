"""A request channel on a stream socket, both ends: the client's (`ClientChannel`, here) and the node's reader
(`RequestReader`, with the reply's framing `pack_reply`: `transport.stream_node`). Two media use it: a same-host region's channel
(`transport.shm`, on the Unix socket its descriptor came on) and the lookup channel across hosts (`transport.tcp`).

Contract:
* On the socket, a request is the protocol's 32-byte header (`protocol.pack_header`) and its meta; no data frames,
  never the INLINE flag (a UCX framing). A reply is a header (op | REPLY, status, count, meta length, the request's
  id) and its meta. Requests are told apart by their ids; replies may come in any order.
* `ClientChannel(sock, in_flight)`: `request` sends one request and returns its reply's meta; the caller holds one
  of its `slots` (`in_flight` of them) for the whole request. Any failure (ChannelTimeout, ChannelRefused,
  ChannelClosed, ProtocolError) spends the channel for every request on it, except a timeout that struck between
  frames of a request that writes nothing (`keep_on_timeout`, a lookup): its late reply is dropped. It keeps the GIL
  through its socket calls (non-blocking sends through libc with the GIL held) and releases it once, to wait for the
  reply (a receive that blocks up to the deadline, `SO_RCVTIMEO`). With several requests in flight, one waiter at a
  time reads the socket and hands the others their replies (each waking only its owner).
* `RequestReader(sock, ops)` (the node's event loop): `next()` gives the requests in order, each checked before its
  meta is read: an op of `ops` only, within the protocol's limits, no data, no status, never INLINE (ProtocolError
  otherwise). It holds at most `READ_BYTES` plus one receive unparsed (reading pauses past that: the channel's
  back-pressure, a client's requests wait in its socket). `close()` unregisters the socket, which the reader's owner
  does before closing it, on every path.

Why: over UCX a small request posts its receive and its head (ucxx releases the GIL for each post) and then waits on
UCX's progress thread: three GIL hand-overs and about 80 µs of UCX's own a round trip; on a socket a request costs one
wake-up on each side (perf/RESULTS.md, "Same-host requests over the region's socket", "a lookup channel across hosts").
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from ems.transport import protocol

_MSG_DONTWAIT = 0x40
_MSG_NOSIGNAL = 0x4000
_MAX_POLL_MS = 60_000

_libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: these calls keep the GIL (never block: MSG_DONTWAIT)
_libc.send.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.send.restype = ctypes.c_ssize_t
# CDLL: the one call that waits (a receive that blocks, up to the socket's SO_RCVTIMEO) gives the GIL away for it
_waiting_libc = ctypes.CDLL(None, use_errno=True)
_waiting_libc.recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_waiting_libc.recv.restype = ctypes.c_ssize_t
_TIMEVAL = struct.Struct("ll")  # struct timeval: seconds, microseconds
_MAX_WAIT_S = 60.0  # one receive's longest wait (the loop re-checks the deadline)


class ChannelTimeout(Exception):
    """No reply within the call's deadline. `mid_frame`: it struck with part of a frame sent or read, so the socket's
    stream is out of step (the channel cannot go on)."""

    def __init__(self, mid_frame: bool = False) -> None:
        super().__init__("mid-frame" if mid_frame else "between frames")
        self.mid_frame = mid_frame


class ChannelClosed(Exception):
    """The node closed the channel (it ended it, or it died)."""


class ChannelRefused(Exception):
    """The node answered with an error status (its message is args[0])."""


class ClientChannel:
    """The client's end of a request channel on a stream socket (see the module docstring)."""

    RECEIVE_BYTES = 64 << 10  # one receive's most: a GET's or PUT's reply meta is 8 bytes a key

    def __init__(self, sock: socket.socket, in_flight: int) -> None:
        sock.setblocking(True)  # (receives wait, up to SO_RCVTIMEO; sends never do: MSG_DONTWAIT)
        self._sock = sock
        self._fd = sock.fileno()
        # a caller takes a slot for its whole request; one that finds none free uses UCX
        self.slots = threading.BoundedSemaphore(in_flight)
        self._send_lock = threading.Lock()  # one request's bytes at a time on the socket
        self._lock = threading.Lock()  # guards everything below
        # the reader's (one at a time): what its receives brought and no reply has taken yet, and their buffer
        self._inbox = bytearray()
        self._receive_buffer = ctypes.create_string_buffer(self.RECEIVE_BYTES)
        self._receive_at = ctypes.addressof(self._receive_buffer)
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
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # (a reader waiting in its receive wakes up at once)
        except OSError:
            pass  # (not connected any more)
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
        never waits on its event: it reads its own reply, so the GIL is given away once, in its receive."""
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
                reply, body = self._next_reply(deadline_at)
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

    def _next_reply(self, deadline_at: float) -> tuple[protocol.Header, bytes]:
        """The next reply off the socket (the reader's: one at a time). What a receive brings beyond it stays in
        `_inbox` for the next: a reply's header and meta usually come in one receive, and replies in flight together
        often in one."""
        inbox = self._inbox
        while len(inbox) < protocol.HEADER_SIZE:
            self._receive(deadline_at)
        reply = protocol.unpack_header(bytes(inbox[: protocol.HEADER_SIZE]))
        end = protocol.HEADER_SIZE + reply.meta_len
        while len(inbox) < end:
            self._receive(deadline_at)
        body = bytes(inbox[protocol.HEADER_SIZE : end])
        del inbox[:end]
        protocol.check_meta_end(reply, body)
        return reply, body

    def _receive(self, deadline_at: float) -> None:
        """One receive of what the socket holds (up to `RECEIVE_BYTES`) into `_inbox`, waiting for it in the receive
        itself (the socket's SO_RCVTIMEO set to what is left of the deadline): the reader comes here for a reply it
        has just asked for, which is not there yet, and a receive that waits is woken by the reply itself (waiting in
        `poll` first and receiving after cost ~15-20 µs more a round trip here). ChannelTimeout (`mid_frame` when part
        of a frame is held); ChannelClosed when the node closed the channel or on a socket error."""
        while True:
            left = deadline_at - time.monotonic()
            if left <= 0:
                raise ChannelTimeout(mid_frame=bool(self._inbox))
            wait_s = min(left, _MAX_WAIT_S)
            seconds = int(wait_s)
            timeout = _TIMEVAL.pack(
                seconds, max(1, int((wait_s - seconds) * 1e6)) if seconds == 0 else int((wait_s - seconds) * 1e6)
            )
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeout)
            got = _waiting_libc.recv(self._fd, self._receive_at, self.RECEIVE_BYTES, 0)
            if got > 0:
                self._inbox += ctypes.string_at(self._receive_at, got)
                return
            if got == 0:
                raise ChannelClosed("the node closed the channel")
            code = ctypes.get_errno()
            if code not in (errno.EINTR, errno.EAGAIN):  # (EAGAIN: its wait ran out; the loop checks the deadline)
                raise ChannelClosed(os.strerror(code))

    def _spend_with(self, why: str) -> None:
        """The channel fails every request on it from now on; the waiting ones are woken to see it."""
        with self._lock:
            if self._failure is None:
                self._failure = why
            for event in self._waiting.values():
                event.set()

    def _send_all(self, data: bytes, deadline_at: float) -> None:
        """Send all of `data` (non-blocking sends, waiting while the socket is full: the one place a send gives the
        GIL away). ChannelClosed on a socket error; ChannelTimeout past `deadline_at`, `mid_frame` once some bytes
        have gone. The first send goes straight from `data` (a request's bytes usually go in one); only a rest left
        over is copied into a buffer that can be addressed at an offset."""
        n, done = len(data), 0
        sent = _libc.send(self._fd, data, n, _MSG_DONTWAIT | _MSG_NOSIGNAL)
        if sent == n:
            return
        buffer = (ctypes.c_char * n).from_buffer_copy(data)
        at = ctypes.addressof(buffer)
        while True:
            if sent > 0:
                done += sent
                if done == n:
                    return
            elif sent == 0:  # (a send of a non-empty rest never returns 0: were it to, nothing would ever move)
                raise ChannelClosed("the channel took no bytes")
            else:
                code = ctypes.get_errno()
                if code not in (errno.EINTR, errno.EAGAIN):
                    raise ChannelClosed(os.strerror(code))
                if code == errno.EAGAIN:
                    try:
                        self._wait(select.POLLOUT, deadline_at)
                    except ChannelTimeout:
                        raise ChannelTimeout(mid_frame=done > 0) from None
            sent = _libc.send(self._fd, at + done, n - done, _MSG_DONTWAIT | _MSG_NOSIGNAL)

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

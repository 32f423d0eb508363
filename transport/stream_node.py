"""A request channel on a stream socket, the node's end: its reader (`RequestReader`), a request's checks
(`request_header`, `take_request`) and the reply's framing (`pack_reply`). The channel's contract, both ends, is
`transport.stream`'s; the client's end is there too.
"""

from __future__ import annotations

import asyncio
import socket

from ems.transport import protocol


class RequestReader:
    """The requests off a channel, in order. The socket stays registered with the event loop while the reader
    wants bytes: each readiness is one receive of what the socket holds (up to `READ_BYTES`), with no receive tried
    before it nor registration made and undone around it, and one receive often holds several requests (a client's
    calls in flight), whose parsing costs no loop turn of its own. Reading pauses once `READ_BYTES` are held unparsed
    (the channel's back-pressure: a client's requests wait in its socket) and resumes when the parser needs more, so
    what it holds is bounded by `READ_BYTES` plus one receive. `close()` unregisters the socket (before it is closed:
    never a socket closed under the loop's watch)."""

    READ_BYTES = 64 << 10

    def __init__(self, sock: socket.socket, ops: frozenset[int]) -> None:
        self._sock = sock
        self._ops = ops  # the ops this channel carries
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._held = bytearray()  # received, not yet parsed
        self._ended: BaseException | None = None  # EOF (EOFError) or the socket's error, once seen
        self._waiter: asyncio.Future[None] | None = None
        self._watching = False

    def close(self) -> None:
        if self._watching:
            self._watching = False
            self._loop.remove_reader(self._fd)

    async def next(self) -> tuple[protocol.Header, bytes] | None:
        """The next request's header and meta; None when the client closed the channel between requests.
        ProtocolError for anything but one of the reader's ops within the protocol's limits (flags as the op
        defines them, `protocol.unpack_header`; never INLINE), checked before its meta is read."""
        head = await self._take(protocol.HEADER_SIZE, allow_eof=True)
        if head is None:
            return None
        header = request_header(head, self._ops)
        meta = await self._take(header.meta_len) if header.meta_len else b""
        protocol.check_meta_end(header, meta or b"")
        return header, meta or b""

    async def _take(self, n: int, allow_eof: bool = False) -> bytes | None:
        held = self._held
        while len(held) < n:
            if self._ended is not None:
                if allow_eof and not held and isinstance(self._ended, EOFError):
                    return None
                raise ConnectionError(f"the client closed the channel mid-request ({self._ended!r})")
            if not self._watching:
                self._watching = True
                self._loop.add_reader(self._fd, self._readable)
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        taken = bytes(held[:n])
        del held[:n]
        return taken

    def _readable(self) -> None:
        """(The loop's reader callback.) One receive; the waiting parser woken."""
        try:
            chunk = self._sock.recv(self.READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self._ended, chunk = error, b""
        if chunk:
            self._held += chunk
        elif self._ended is None:
            self._ended = EOFError()
        if not chunk or len(self._held) >= self.READ_BYTES:
            self.close()  # (ended, or enough held: the parser resumes reading when it needs more)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


_NOT_ON_A_CHANNEL = int(protocol.Flags.INLINE)  # a UCX framing: never on a socket's channel


def request_header(head: bytes, ops: frozenset[int]) -> protocol.Header:
    """A request's header read off a channel that carries `ops`, checked before its meta is read: the protocol's
    checks (magic, version, every limit, flags as the op defines them: `protocol.unpack_header`), an op of `ops`, no
    data, no status, never INLINE. ProtocolError otherwise."""
    header = protocol.unpack_header(head)
    if header.op not in ops or header.data_len or header.status or header.flags & _NOT_ON_A_CHANNEL:
        raise protocol.ProtocolError(f"op {header.op} (data {header.data_len}, flags {header.flags:#x}) on this channel")
    return header


def take_request(held: bytearray, ops: frozenset[int]) -> tuple[protocol.Header, bytes] | None:
    """The first whole request in `held` (received bytes of a channel that carries `ops`), taken out of it; None while
    it is not whole. Its header is checked as soon as it is in (`request_header`), before its meta has come."""
    if len(held) < protocol.HEADER_SIZE:
        return None
    header = request_header(bytes(held[: protocol.HEADER_SIZE]), ops)
    end = protocol.HEADER_SIZE + header.meta_len
    if len(held) < end:
        return None
    meta = bytes(held[protocol.HEADER_SIZE : end])
    del held[:end]
    protocol.check_meta_end(header, meta)
    return header, meta


def pack_reply(
    op: int, request_id: int, meta: bytes = b"", count: int = 0, status: protocol.Status = protocol.Status.OK
) -> bytes:
    """A reply on a channel, whole: its header (`op` | REPLY, the request's id) and `meta`."""
    header = protocol.pack_header(
        op | protocol.REPLY,
        count=count,
        meta_len=len(meta),
        status=status,
        request_id=request_id,
        meta_end=protocol.end_byte(meta),
    )
    return header.tobytes() + bytes(meta)

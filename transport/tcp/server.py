"""The node's end of lookup channels (`transport.tcp.wire` has the protocol and the security model): the TCP
listener, the tokens offered to UCX connections, and each channel's lookups answered.

Contract:
* `LookupService(settings, answer)`: `answer(header, meta, prefix)` is the node's answer to an EXISTS whose meta is
  in hand (`transport.handler.RequestHandler.answer_now`). `start(host)` listens on `host` at the settings' port (any
  free one for 0; every interface for a wildcard host) and returns the port; nothing when the settings turn the
  channel off. `stop()` closes the listener and every channel and pending peer.
* `open(channel, conn, peer, prefix)` answers a LOOKUP_OPEN on UCX connection `conn` (tenant namespace `prefix`,
  peer IP address `peer`): a fresh token and the port, replacing the connection's unpresented one; port 0 when the
  listener is off. `forget(conn)` (the connection ended) drops its token and ends its channel.
* A TCP peer takes a pending place (MAX_PENDING, MAX_PENDING_PER_IP; none free: closed at once) until it has sent
  TOKEN_BYTES or HANDSHAKE_TIMEOUT_S has passed. A token is spent by its presentation; an unknown, expired one, or one
  presented from another IP address than its connection's peer, closes the socket (`refusals`, counted by
  `wire.LookupRefusal`; `stats()` for the node's metrics). A right one is answered ACCEPTED and the socket becomes
  the connection's channel, ending the connection's earlier one.
* A channel's requests (EXISTS only, `transport.stream_node.take_request`) are answered in order in the loop's callback
  that receives them (`_Answering`); anything malformed ends the channel (logged), as does the client's close.
* Runs on the node's event loop only (no lock).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ems.transport import protocol
from ems.transport.handler import WILDCARD_HOSTS, RequestChannel
from ems.transport.stream_node import pack_reply, take_request
from ems.transport.tcp import wire

log = logging.getLogger("ems.pool")

Answer = Callable[[protocol.Header, memoryview, bytes], bytes]


@dataclass(frozen=True)
class _Offer:
    conn: Any  # the UCX connection the token was given on
    prefix: bytes  # its tenant's namespace
    peer: str  # its peer's IP address
    expires_at: float


class LookupService:
    """Lookup channels of one node's UCX connections; see the module docstring."""

    def __init__(self, settings: wire.LookupSettings, answer: Answer) -> None:
        self.settings = settings
        self._answer = answer
        self.port = 0
        self.refusals: Counter[str] = Counter()  # `LookupRefusal` value -> TCP peers closed for it
        self._listener: socket.socket | None = None
        self._offers: dict[bytes, _Offer] = {}  # token -> its offer
        self._token_of: dict[Any, bytes] = {}  # connection -> its unpresented token
        self._channels: dict[Any, asyncio.Task] = {}  # connection -> its channel's task
        self._pending: Counter[str] = Counter()  # IP address -> peers that have not presented a token yet
        self._tasks: set[asyncio.Task] = set()  # every peer's task (pending or serving a channel)

    # ---- life cycle ----

    def start(self, host: str) -> int:
        """Listen (see the module docstring); the port, 0 when off. OSError when the port cannot be had."""
        if not self.settings.enabled or self._listener is not None:
            return self.port
        port = self.settings.port or 0
        if host == "::":  # (both families, as UCX's listener on "::")
            listener = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=512)
        else:
            bind = "0.0.0.0" if host in WILDCARD_HOSTS else host
            family = socket.AF_INET6 if ":" in bind else socket.AF_INET
            listener = socket.create_server((bind, port), family=family, backlog=512)
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        asyncio.get_running_loop().add_reader(listener.fileno(), self._accept)
        return self.port

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            asyncio.get_running_loop().remove_reader(listener.fileno())
            listener.close()
        for task in list(self._tasks):
            task.cancel()  # (each closes its socket, unwatched first)
        self._offers.clear()
        self._token_of.clear()

    def stats(self) -> wire.LookupStats:
        """(Any thread: reads only.) The channels open, the peers pending, the refusals by reason."""
        return wire.LookupStats(len(self._channels), sum(self._pending.values()), dict(self.refusals))

    # ---- offers, on a UCX connection ----

    async def open(self, channel: RequestChannel, conn: Any, peer: str, prefix: bytes) -> None:
        """Answer a LOOKUP_OPEN (see the module docstring)."""
        header = channel.header
        if header.meta_len or header.data_len or header.count:
            raise protocol.ProtocolError("LOOKUP_OPEN carries nothing")
        self._drop_offer(conn)
        self._sweep(time.monotonic())
        token, port = wire.NO_CHANNEL, 0
        if self._listener is not None:
            token, port = secrets.token_bytes(wire.TOKEN_BYTES), self.port
            self._offers[token] = _Offer(conn, prefix, peer, time.monotonic() + wire.TOKEN_TTL_S)
            self._token_of[conn] = token
        await channel.reply(protocol.Op.LOOKUP_OPEN, meta=wire.encode_open_reply(token, port))

    def forget(self, conn: Any) -> None:
        """The connection ended: its token is dropped and its channel ends."""
        self._drop_offer(conn)
        task = self._channels.pop(conn, None)
        if task is not None:
            task.cancel()

    def _drop_offer(self, conn: Any) -> None:
        token = self._token_of.pop(conn, None)
        if token is not None:
            self._offers.pop(token, None)

    def _sweep(self, now: float) -> None:
        """Forget the tokens past their time (so offers never outnumber live connections for long)."""
        for token, offer in [(t, o) for t, o in self._offers.items() if o.expires_at < now]:
            del self._offers[token]
            if self._token_of.get(offer.conn) == token:
                del self._token_of[offer.conn]

    # ---- TCP peers ----

    def _accept(self) -> None:
        """(The loop's reader callback on the listener.) Admit every peer waiting, or close it at once."""
        listener = self._listener
        while listener is not None:
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:  # (out of descriptors: the peer waits in the backlog)
                log.warning("lookup listener: accept failed: %r", error)
                return
            ip = str(address[0])
            if sum(self._pending.values()) >= wire.MAX_PENDING or self._pending[ip] >= wire.MAX_PENDING_PER_IP:
                self.refusals[wire.LookupRefusal.BUSY.value] += 1
                sock.close()
                continue
            self._pending[ip] += 1
            sock.setblocking(False)
            task = asyncio.ensure_future(self._admit(sock, ip))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _admit(self, sock: socket.socket, ip: str) -> None:
        """A TCP peer: its token, then, when right, its channel served until it ends."""
        conn: Any = None
        try:
            try:
                token = await asyncio.wait_for(_receive_exactly(sock, wire.TOKEN_BYTES), wire.HANDSHAKE_TIMEOUT_S)
            except (asyncio.TimeoutError, ConnectionError, OSError):
                self.refusals[wire.LookupRefusal.NO_TOKEN.value] += 1
                return
            finally:
                self._release_pending(ip)
            offer = self._offers.pop(token, None)  # spent, right or wrong
            if offer is None:
                self.refusals[wire.LookupRefusal.UNKNOWN_TOKEN.value] += 1  # (counted, not logged: junk is cheap to send)
                log.debug("lookup channel: an unknown token from %s", ip)
                return
            if self._token_of.get(offer.conn) == token:
                del self._token_of[offer.conn]
            if offer.expires_at < time.monotonic():
                self.refusals[wire.LookupRefusal.EXPIRED.value] += 1
                log.info("lookup channel: a token of %s presented after %s s", offer.peer, wire.TOKEN_TTL_S)
                return
            if not wire.same_address(ip, offer.peer):
                self.refusals[wire.LookupRefusal.OTHER_PEER.value] += 1
                log.warning("lookup channel: a token of %s presented from %s", offer.peer, ip)
                return
            conn = offer.conn
            earlier = self._channels.get(conn)
            if earlier is not None:
                earlier.cancel()
            current = asyncio.current_task()
            if current is not None:
                self._channels[conn] = current
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.get_running_loop().sock_sendall(sock, wire.ACCEPTED)
            await self._serve(sock, offer.prefix, offer.peer)
        except (ConnectionError, OSError) as error:
            log.info("lookup channel of %s ended: %r", ip, error)
        finally:
            if conn is not None and self._channels.get(conn) is asyncio.current_task():
                del self._channels[conn]
            sock.close()

    def _release_pending(self, ip: str) -> None:
        self._pending[ip] -= 1
        if self._pending[ip] <= 0:
            del self._pending[ip]

    async def _serve(self, sock: socket.socket, prefix: bytes, peer: str) -> None:
        """A channel's lookups until the client closes it or sends something malformed (`_Answering`)."""
        answering = _Answering(sock, lambda header, meta: self._answer(header, meta, prefix))
        try:
            await answering.ended
        except protocol.ProtocolError as error:
            self.refusals[wire.LookupRefusal.MALFORMED.value] += 1
            log.warning("closing the lookup channel of %s: malformed request: %s", peer, error)
        except (ConnectionError, OSError):
            raise
        except Exception:  # (a failure of the node's own: this channel ends, the node serves on)
            log.exception("closing the lookup channel of %s", peer)
        finally:
            answering.close()  # (before the socket closes: never a socket closed under the loop's watch)


class _Answering:
    """One channel's lookups answered in the loop's callbacks: each readiness of the socket is one receive, every
    request it completes is answered at once (no task, no loop turn of its own: a lookup costs one wake-up), and the
    replies go out in one send. While replies wait unsent, the socket is not read (the client's requests wait in its
    socket); so what the channel holds is one receive (READ_BYTES) plus one request being completed, and its replies.
    `ended` completes when the client closes the channel (None), or with the ProtocolError or OSError that ended it."""

    READ_BYTES = 64 << 10

    def __init__(self, sock: socket.socket, answer: Callable[[protocol.Header, memoryview], bytes]) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self._answer = answer
        self._loop = asyncio.get_running_loop()
        self._held = bytearray()  # received, not yet a whole request
        self._unsent = bytearray()  # replies not sent yet
        self.ended: asyncio.Future[None] = self._loop.create_future()
        self._watching: str | None = "read"
        self._loop.add_reader(self._fd, self._readable)

    def close(self) -> None:
        if self._watching == "read":
            self._loop.remove_reader(self._fd)
        elif self._watching == "write":
            self._loop.remove_writer(self._fd)
        self._watching = None

    def _end(self, error: BaseException | None) -> None:
        self.close()
        if not self.ended.done():
            if error is None:
                self.ended.set_result(None)
            else:
                self.ended.set_exception(error)

    def _readable(self) -> None:
        try:
            chunk = self._sock.recv(self.READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self._end(error)
            return
        if not chunk:
            self._end(None if not self._held else ConnectionError("the client closed the channel mid-request"))
            return
        held = self._held
        held += chunk
        try:
            while (request := take_request(held, wire.CHANNEL_OPS)) is not None:
                header, meta = request
                answer = self._answer(header, memoryview(meta))
                self._unsent += pack_reply(header.op, header.request_id, answer, header.count)
        except Exception as error:  # malformed (ProtocolError), or the answer failed: the channel ends
            self._end(error)
            return
        if self._unsent:
            self._send()

    def _send(self) -> None:
        try:
            sent = self._sock.send(self._unsent)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as error:
            self._end(error)
            return
        del self._unsent[:sent]
        if self._unsent and self._watching == "read":  # the client does not keep up: stop reading until it does
            self._loop.remove_reader(self._fd)
            self._loop.add_writer(self._fd, self._send)
            self._watching = "write"
        elif not self._unsent and self._watching == "write":
            self._loop.remove_writer(self._fd)
            self._loop.add_reader(self._fd, self._readable)
            self._watching = "read"


async def _receive_exactly(sock: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    got = bytearray()
    while len(got) < n:
        chunk = await loop.sock_recv(sock, n - len(got))
        if not chunk:
            raise ConnectionError("the peer closed before its token")
        got += chunk
    return bytes(got)

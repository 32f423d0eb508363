"""The pool-node server's session part: the listener, admission, the handshake, the watchdog and each connection's
requests, over UCX (`ems.transport.protocol`), beside its client `ems.transport.ucx.client`. What a request does to the store
and the in-flight budget is the handlers' (`transport.handler.RequestHandler`; `ems.pool.handlers.NodeHandlers` in a
node); this module only moves requests to and from them. The transport imports neither the store nor `ems.pool`:
the node assembly (`ems.pool.node`) hands the handlers in. `PoolServer` here is the listener, the life cycle and each
connection's loop (reading heads, dispatching requests to the handlers, answering refusals); its parts:
`transport.ucx.connections` (each connection's state, admission, the tags of live and ended connections, the
watchdog), `transport.ucx.handshake` (HELLO, CHALLENGE, AUTH) and `transport.ucx.channel` (one request's frames and
its reply). Everything runs on the node's one event loop: no lock.

Contract:
* One asyncio event loop serves every connection (UCX progress settings: `transport.ucx.config`). Each
  connection's heads are read by one coroutine; classic requests are served in order, inline requests (protocol
  docstring) concurrently, each in a task, up to MAX_REQUESTS_PER_CONNECTION at once, so concurrent calls of one
  client overlap. An inline EXISTS or PING whose meta came in its head is answered by the connection's coroutine
  itself, without a task (`_served_at_once`: nothing to receive, and its reply, a few bytes, is posted and as a
  rule complete at once).
* Handshake first (`protocol` docstring). With access keys configured, a client must prove one (HMAC over a
  fresh nonce) or is refused with AUTH_FAILED; without keys every client is accepted under the tenant it names,
  whose namespace (the handlers' `namespace`) every key of the connection is stored under.
* Every received frame has its length verified (`transport.ucx.frames`): a short frame can never leave a recycled
  buffer's old bytes (another tenant's value) in a stored value.
* A request the handlers refuse (`transport.handler.Refusal`: no room in the in-flight budget) is answered with
  BAD_REQUEST and its message, then the connection is closed (its data frames are left unread). Replies are sent in
  windows of SEND_WINDOW_BYTES.
* Timeouts (`SessionLimits`, of the node's `NodeLimits`): a connection must finish the handshake within
  `handshake_timeout_s`; once a request has started, every frame of it (in either direction) must complete within
  `stall_timeout_s` of the previous one of the same request (a deadline per request in flight). A connection that
  breaks either is aborted. An authenticated connection may stay idle between requests (clients keep one).
* Connections: at most `max_connections` in all and `max_connections_per_peer` per peer IP address; beyond that a
  new connection is aborted at once.
* Sockets UCX abandons on the listening port (junk instead of a UCX handshake) are released (`transport.ucx.sockets`),
  also when the node has no descriptor left.
* Messages nobody will receive (protocol docstring, "Tags") are discarded as they arrive (the loop's progress
  sweeper, `ConnectionTable.sweep_front`) and by the watchdog (`transport.ucx.unexpected`, in progress mode
  "loop"): every tag of a connection that ended (at once, and for UNREAD_LINGER_S more for what was still on the
  wire), messages on the tags of no live connection, and a connection that parks messages on tags it has no request
  for (before its handshake, any tag but its base tag; after it, a request id not in flight with no head waiting or
  arrived) is closed, after which its messages are discarded too.
* A malformed or oversized frame, or any transport error, closes that connection only.
* `stop()` closes the listener and every connection; the caller then lets the loop finish.
* Same-host clients may move value bytes through a shared-memory region of their connection (`shm`:
  `transport.shm.server`, owned by the handlers); off unless the node's settings enable it (`python -m ems.pool`
  does by default).
* Lookup channels (`transport.tcp`): a connection may ask (LOOKUP_OPEN) for a TCP socket of its own that carries
  its lookups (`lookups`, a `tcp.server.LookupService`, listening beside UCX from `start`); on unless `lookups`
  (`tcp.wire.LookupSettings`) turns it off. A connection's channel ends with it.
* With `metrics` (`SessionMetrics`; `ems.pool.metrics.NodeMetrics` in a node), each connection and refused
  handshake is counted once (and each request, by the handlers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ems.transport import protocol
from ems.transport.handler import WILDCARD_HOSTS, Refusal, RequestHandler, SessionLimits, SessionMetrics
from ems.transport.tcp.server import LookupService
from ems.transport.tcp.wire import LookupSettings
from ems.transport.ucx import progress as ucx_progress
from ems.transport.ucx.channel import Channel
from ems.transport.ucx.config import init_ucx
from ems.transport.ucx.connections import Closed, Connection, ConnectionTable, Stage, abort
from ems.transport.ucx.endpoint import install_safe_listener_exchange
from ems.transport.ucx.frames import head_layout, new_head_buffer, pack_meta_reply, recv_head
from ems.transport.ucx.handshake import handshake
from ems.transport.ucx.listener import BoundListener
from ems.transport.ucx.sockets import SocketReaper

log = logging.getLogger("ems.pool")

REAP_PERIOD_S = 1.0


class PoolServer:
    """Serves one node's handlers (`RequestHandler`); see the module docstring."""

    def __init__(
        self,
        handlers: RequestHandler,
        limits: SessionLimits,
        access_keys: dict[str, str] | None = None,
        metrics: SessionMetrics | None = None,
        lookups: LookupSettings | None = None,
    ) -> None:
        self.handlers = handlers
        self.metrics = metrics
        self.access_keys = dict(access_keys or {})
        self.limits = limits
        self._listener: Any = None
        self.connections = ConnectionTable(limits, handlers.memory_report, metrics)  # admission, tags, the watchdog
        self._tasks: list[asyncio.Task] = []
        self.port = 0
        # the connections' lookup channels (`transport.tcp`): on unless the settings turn them off
        self.lookups = LookupService(lookups or LookupSettings(), handlers.answer_now)

    # ---- life cycle ----

    async def start(self, port: int, host: str = "0.0.0.0") -> int:
        """Start listening on `host:port` (every interface for a wildcard host); returns the port. OSError when UCX
        cannot listen there."""
        init_ucx()  # before `import ucxx`: it puts UCX's environment in place
        import ucxx

        install_safe_listener_exchange()  # a client paused mid-connect must not corrupt this node's heap
        if host in WILDCARD_HOSTS:
            self._listener = ucxx.create_listener(self._serve, port=port, endpoint_error_handling=True)
        else:
            self._listener = BoundListener(host, port, self._serve)
        self.port = int(self._listener.port)
        driver = ucx_progress.driver()
        if driver is not None:
            from ucxx.core import _get_ctx

            self.connections.worker = _get_ctx().worker
            driver.sweeper = self.connections.sweep_front
        self._tasks = [asyncio.ensure_future(self.connections.watch()), asyncio.ensure_future(self._reaper())]
        self.handlers.start()
        self.lookups.start(host)  # (OSError when its port is taken: the caller stops the server)
        return self.port

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        driver = ucx_progress.driver()
        if driver is not None and driver.sweeper == self.connections.sweep_front:
            driver.sweeper = None
        self.lookups.stop()
        self.connections.abort_all()
        self.handlers.close()

    async def _reaper(self) -> None:
        reaper = SocketReaper(self.port)
        while True:
            await asyncio.sleep(REAP_PERIOD_S)
            closed = reaper.sweep()
            if closed:
                log.warning("closed %d sockets UCX abandoned on port %d (not UCX clients)", closed, self.port)

    # ---- one connection ----

    async def _serve(self, ep: Any) -> None:
        conn = self.connections.admit(ep)
        if conn is None:
            abort(ep)  # (its messages, if any, are on no live connection's tags: the watchdog discards them)
            return
        if self.metrics is not None:
            self.metrics.connections.inc()
            self.metrics.connections_opened.inc()
        try:
            tenant = await handshake(ep, self.access_keys, self.metrics)
            if tenant is None:
                return
            conn.stage = Stage.IDLE
            prefix = self.handlers.namespace(tenant)
            classic = -1  # the watchdog's key for the classic request being served (inline ones: positive serials)
            while not conn.aborted:
                await conn.slots.acquire()
                head = new_head_buffer()
                conn.head = head[0]  # the sweeps read which request's head arrived (`Connection.head_arrived`)
                try:
                    header, body = await recv_head(ep, buffer=head)
                except protocol.ProtocolError:
                    conn.slots.release()
                    raise
                except Exception as error:  # the peer left (or the endpoint was aborted)
                    conn.slots.release()
                    raise Closed() from error
                except BaseException:
                    conn.slots.release()
                    raise
                finally:
                    conn.head = None
                if header.inline:
                    # served concurrently: its other frames and its reply travel on its own tag
                    request_id = header.request_id
                    if request_id == 0 or request_id in conn.receiving:
                        conn.slots.release()
                        raise protocol.ProtocolError(f"request id {request_id} is the base tag or already in flight")
                    if _served_at_once(header):
                        # everything is in its head and its reply is a few bytes: answered here, its reply posted
                        # (complete at once as a rule), without a task and a loop turn of its own
                        try:
                            await self._answer_at_once(conn, header, body, prefix)
                        finally:
                            conn.slots.release()
                        continue
                    conn.receiving.add(request_id)
                    key = conn.new_key()
                    conn.requests[key] = time.monotonic() + self.limits.stall_timeout_s
                    channel = Channel(conn, header, body, key, self.limits.stall_timeout_s)
                    task = asyncio.ensure_future(self._serve_request(channel, prefix))
                    conn.tasks.add(task)
                    # let the request run up to its first wait (a small one: its reply is posted) before this loop
                    # prepares the next head's receive
                    await asyncio.sleep(0)
                    continue
                conn.requests[classic] = time.monotonic() + self.limits.stall_timeout_s
                try:
                    await self._serve_request(Channel(conn, header, body, classic, self.limits.stall_timeout_s), prefix)
                finally:
                    conn.slots.release()
        except Closed:
            log.debug("client left")
        except protocol.ProtocolError as error:
            log.warning("closing a connection from %s: malformed request: %s", conn.peer, error)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # any transport failure ends this connection only
            if conn.aborted:
                log.debug("connection from %s aborted: %r", conn.peer, error)
            else:
                log.info("closing a connection from %s: %r", conn.peer, error)
        finally:
            self.connections.release(conn)
            conn.aborted = True
            self.handlers.forget(conn)
            self.lookups.forget(conn)
            abort(ep)  # fails the UCX requests of the inline requests still in flight: their tasks end by themselves
            if conn.tasks:
                await asyncio.gather(*conn.tasks, return_exceptions=True)
            self.connections.forget_tags(conn)
            if self.metrics is not None:
                self.metrics.connections.dec()

    async def _answer_at_once(self, conn: Connection, header: protocol.Header, body: memoryview, prefix: bytes) -> None:
        """Answer a request `_served_at_once` allows: the handlers' reply meta, sent in one head on its tag. Its id
        is never in flight past this (the reply starts before the next head is read). A reply whose send does not
        complete at once has `stall_timeout_s`, like any frame."""
        meta = self.handlers.answer_now(header, body[: header.meta_len], prefix)
        sent = ucx_progress.send(conn.ep, pack_meta_reply(header.op, header.request_id, meta, header.count), header.request_id)
        if sent.done():
            sent.result()  # a failed send raises here, as awaiting it would
            return
        key = conn.new_key()
        conn.requests[key] = time.monotonic() + self.limits.stall_timeout_s
        try:
            await sent
        finally:
            conn.requests.pop(key, None)

    async def _open_lookups(self, channel: Channel, conn: Connection, prefix: bytes) -> None:
        """A LOOKUP_OPEN: the connection's lookup channel offered (`transport.tcp.server`), counted as a request."""
        started, ok = time.perf_counter(), False
        try:
            await self.lookups.open(channel, conn, conn.peer, prefix)
            ok = True
        finally:
            if self.metrics is not None:
                self.metrics.request("lookup_open", ok, time.perf_counter() - started)

    async def _serve_request(self, channel: Channel, prefix: bytes) -> None:
        """One request, start to reply. A refusal answers BAD_REQUEST and closes the connection; any other failure
        closes it too (an inline request's failure aborts the endpoint, which ends the connection's loop)."""
        conn = channel.conn
        inline = channel.header.inline
        try:
            try:
                if channel.header.op == _LOOKUP_OPEN:
                    await self._open_lookups(channel, conn, prefix)
                else:
                    await self.handlers.serve(channel, prefix)
            except Refusal as refusal:
                log.warning("refused a request from %s: %s", conn.peer, refusal)
                await channel.reply(channel.header.op, meta=str(refusal).encode(), status=protocol.Status.BAD_REQUEST)
                await asyncio.sleep(0.05)  # let the refusal reach the client before the endpoint closes
                raise Closed() from None
        except BaseException as error:
            if not inline:
                raise
            if not conn.aborted:
                if isinstance(error, protocol.ProtocolError):
                    log.warning("closing a connection from %s: malformed request: %s", conn.peer, error)
                elif not isinstance(error, (Closed, asyncio.CancelledError)):
                    log.info("closing a connection from %s: %r", conn.peer, error)
                conn.aborted = True
                abort(conn.ep)
        finally:
            conn.requests.pop(channel.key, None)
            channel.done_receiving()
            if inline:
                conn.slots.release()
                task = asyncio.current_task()
                if task is not None:
                    conn.tasks.discard(task)


# ---- helpers ----


_LOOKUP_OPEN = int(protocol.Op.LOOKUP_OPEN)
_AT_ONCE_OPS = frozenset((int(protocol.Op.EXISTS), int(protocol.Op.PING)))


def _served_at_once(header: protocol.Header) -> bool:
    """An inline request the connection's loop serves itself: an EXISTS or PING whose meta came in its head (no
    frame to wait for; the reply, flags, fits in a head; it waits only while the node's whole in-flight budget is
    taken). Anything else (data frames, a GET's value) gets a task, so one slow request never holds the connection's
    next head."""
    return header.op in _AT_ONCE_OPS and header.data_len == 0 and head_layout(header.meta_len, 0).meta_inline

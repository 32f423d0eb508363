"""The pool-node server's session part: the listener, admission, the handshake, the watchdog and each connection's
requests, over UCX (`ems.transport.protocol`), beside its client `ems.transport.ucx`. What a request does to the store
and the in-flight budget is `transport.node_handlers`' (`NodeHandlers`); this module only moves requests to and from
it. The transport does not import the store: the node assembly (`ems.pool.__main__`) hands one in.

Contract:
* One asyncio event loop serves every connection (UCX progress settings: `transport.ucx_config`). Each
  connection's heads are read by one coroutine; classic requests are served in order, inline requests (protocol
  docstring) concurrently, each in a task, up to MAX_REQUESTS_PER_CONNECTION at once, so concurrent calls of one
  client overlap. An inline EXISTS or PING whose meta came in its head is answered by the connection's coroutine
  itself, without a task (`_served_at_once`: nothing to receive, and its reply, a few bytes, is posted and as a
  rule complete at once).
* Handshake first (`protocol` docstring). With access keys configured, a client must prove one (HMAC over a
  fresh nonce) or is refused with AUTH_FAILED; without keys every client is accepted under the tenant it names,
  whose namespace (`node_handlers.tenant_prefix`) every key of the connection is stored under.
* Every received frame has its length verified (`transport.ucx_frames`): a short frame can never leave a recycled
  buffer's old bytes (another tenant's value) in a stored value.
* A request the handlers refuse (`node_handlers.Refusal`: no room in the in-flight budget) is answered with
  BAD_REQUEST and its message, then the connection is closed (its data frames are left unread). Replies are sent in
  windows of SEND_WINDOW_BYTES.
* Timeouts (`NodeLimits`): a connection must finish the handshake within `handshake_timeout_s`; once a request has
  started, every frame of it (in either direction) must complete within `stall_timeout_s` of the previous one of
  the same request (a deadline per request in flight). A connection that breaks either is aborted. An
  authenticated connection may stay idle between requests (clients keep one).
* Connections: at most `max_connections` in all and `max_connections_per_peer` per peer IP address; beyond that a
  new connection is aborted at once.
* Sockets UCX abandons on the listening port (junk instead of a UCX handshake) are released (`transport.ucx_sockets`),
  also when the node has no descriptor left.
* Messages nobody will receive (protocol docstring, "Tags") are discarded by the watchdog (`transport.ucx_unexpected`,
  in progress mode "loop"): every tag of a connection that ended (at once, and for UNREAD_LINGER_S more for what was
  still on the wire), messages on the tags of no live connection, and a connection that parks messages on tags it
  has no request for (before its handshake, any tag but its base tag; after it, a request id not in flight with no
  head waiting, seen so on two sweeps in a row) is closed, after which its messages are discarded too.
* A malformed or oversized frame, or any transport error, closes that connection only.
* `stop()` closes the listener and every connection; the caller then lets the loop finish.
* Same-host clients may move value bytes through a shared-memory region of their connection (`shm`:
  `transport.shm_server`); off unless `shm` enables it (`python -m ems.pool` does by default).
* With `metrics` (`ems.pool.metrics.NodeMetrics`), each connection and refused handshake is counted once (and each
  request, by the handlers).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ems.transport import protocol, ucx_progress
from ems.transport.node_budget import NodeLimits
from ems.transport.node_handlers import NodeHandlers, NodeStore, Refusal, tenant_prefix
from ems.transport.shm import ShmSettings
from ems.transport.ucx_config import init_ucx
from ems.transport.ucx_endpoint import connecting_tags, install_safe_listener_exchange, peer_host
from ems.transport.ucx_frames import new_canary, recv_all_into, recv_head, recv_header_frame, recv_meta, send_all
from ems.transport.ucx_listener import BoundListener
from ems.transport.ucx_sockets import SocketReaper
from ems.transport.ucx_unexpected import discard, oldest

if TYPE_CHECKING:
    from ems.pool.metrics import NodeMetrics

log = logging.getLogger("ems.pool")
T = TypeVar("T")  # what an awaited frame step gives

# a GET reply's data frames are posted this many bytes at a time (UCX holds per-send state for each posted frame)
SEND_WINDOW_BYTES = 32 << 20
WATCHDOG_PERIOD_S = 0.5
REAP_PERIOD_S = 1.0
WILDCARD_HOSTS = ("0.0.0.0", "::", "*", "")
# inline requests of one connection served at once; the connection's next head waits for a free slot
MAX_REQUESTS_PER_CONNECTION = 32
# how long the tags of a connection that ended are still swept for messages that were on the wire when it closed
UNREAD_LINGER_S = 5.0
CONNECTION_TAG_MASK = ucx_progress.CONNECTION_TAG_MASK
_FULL_TAG_MASK = (1 << 64) - 1


class _Closed(Exception):
    """The peer closed the connection (not an error worth a warning)."""


class _Stage(enum.Enum):
    HANDSHAKE = "handshake"
    IDLE = "idle"
    BUSY = "busy"


class Connection:
    """One client connection's state, as the watchdog sees it: a deadline per request in flight."""

    __slots__ = (
        "aborted",
        "base_tag",
        "deadline",
        "ep",
        "next_key",
        "peer",
        "receiving",
        "requests",
        "slots",
        "stage",
        "suspect",
        "tasks",
    )

    def __init__(self, ep: Any, peer: str, deadline: float, base_tag: int) -> None:
        self.ep = ep
        self.peer = peer
        self.stage = _Stage.HANDSHAKE
        self.deadline = deadline  # of the handshake
        self.aborted = False
        self.requests: dict[int, float] = {}  # request key (a serial of this connection) -> deadline of its next frame
        self.tasks: set[asyncio.Task] = set()  # inline requests being served
        self.slots = asyncio.Semaphore(MAX_REQUESTS_PER_CONNECTION)
        self.base_tag = base_tag  # the tag this node receives the connection's heads on (protocol docstring, "Tags")
        self.receiving: set[int] = set()  # inline request ids in flight: from the head until the reply starts
        self.next_key = 0
        self.suspect: int | None = None  # a tag the last sweep found parked with no request for it

    def new_key(self) -> int:
        self.next_key += 1
        return self.next_key

    def overdue(self, now: float) -> str | None:
        if self.stage == _Stage.HANDSHAKE:
            return "handshake" if now > self.deadline else None
        return "a request" if any(now > d for d in self.requests.values()) else None


class Channel:
    """Where one request's frames and reply travel: classic (base tag, in order) or inline (its own tag); the
    `node_handlers.RequestChannel` the handlers see."""

    __slots__ = ("body", "conn", "header", "key", "stall_s", "tag")

    def __init__(self, conn: Connection, header: protocol.Header, body: memoryview, key: int, stall_s: float) -> None:
        self.conn = conn
        self.header = header
        self.body = body  # the head's inline bytes
        self.tag = header.request_id if header.inline else None
        self.key = key
        self.stall_s = stall_s

    def done_receiving(self) -> None:
        """Every receive of this request has ended: its id is free for the client to reuse (protocol docstring)."""
        if self.tag is not None:
            self.conn.receiving.discard(self.tag)

    async def timed(self, step: Awaitable[T]) -> T:
        """One frame: when it completes, the next frame of this request has `stall_timeout_s` again."""
        result = await step
        self.conn.requests[self.key] = time.monotonic() + self.stall_s
        return result

    async def receive_frames(self, views: Sequence[memoryview]) -> None:
        """Receive the request's data frames into `views`, lengths verified; once every receive has ended (each
        frame that arrives gives the next `stall_timeout_s` again). On a failure the connection is aborted and the
        first error raised."""
        try:
            await recv_all_into(self.conn.ep, views, new_canary(), self.tag, self._frame_done)
        except BaseException:
            if not self.conn.aborted:
                self.conn.aborted = True
                _abort(self.conn.ep)
            raise

    def _frame_done(self) -> None:
        self.conn.requests[self.key] = time.monotonic() + self.stall_s

    async def meta(self) -> bytes:
        h = self.header
        if h.inline and protocol.head_layout(h.meta_len, h.data_len).meta_inline:
            return bytes(self.body[: h.meta_len])
        return await self.timed(recv_meta(self.conn.ep, h.meta_len, self.tag))

    def inline_data(self) -> memoryview | None:
        """The request's data when it came inline in the head, else None (it comes as frames)."""
        h = self.header
        if h.inline and protocol.head_layout(h.meta_len, h.data_len).data_inline:
            return self.body[h.meta_len : h.meta_len + h.data_len]
        return None

    async def reply(
        self,
        op: int,
        *,
        count: int = 0,
        meta: bytes = b"",
        data: Sequence[Any] = (),
        data_len: int = 0,
        status: protocol.Status = protocol.Status.OK,
    ) -> None:
        """Send the reply: inline on the request's tag (the data in the head when it fits, else frames in windows
        of SEND_WINDOW_BYTES), or classic on the base tag."""
        ep = self.conn.ep
        inline = self.header.inline
        self.done_receiving()
        header = protocol.pack_header(
            op | protocol.REPLY,
            count=count,
            meta_len=len(meta),
            data_len=data_len,
            status=status,
            flags=protocol.Flags.INLINE if inline else 0,
            request_id=self.header.request_id,
        )
        windows = _windows(list(data), SEND_WINDOW_BYTES)
        if inline:
            layout = protocol.head_layout(len(meta), data_len)
            head = protocol.pack_head(header, meta, data)
            first = [head] if layout.meta_inline else [head, meta]
            if layout.data_inline:
                windows = []
            elif windows:  # the head goes out with the first window of data (one wait less)
                first += windows.pop(0)
            await self.timed(send_all(ep, first, self.tag))
        else:
            await self.timed(send_all(ep, [header, meta]))
        for window in windows:
            await self.timed(send_all(ep, window, self.tag))


class PoolServer:
    """Serves one store (`NodeStore`); see the module docstring."""

    def __init__(
        self,
        store: NodeStore,
        access_keys: dict[str, str] | None = None,
        limits: NodeLimits | None = None,
        metrics: NodeMetrics | None = None,
        shm: ShmSettings | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.access_keys = dict(access_keys or {})
        self.limits = limits or NodeLimits.for_capacity(store.capacity_bytes)
        self.handlers = NodeHandlers(store, self.limits, metrics, shm)
        if metrics is not None:
            metrics.watch_shm(self.handlers.shm.stats)
        self._listener: Any = None
        self._connections: dict[Any, Connection] = {}
        self._by_tag: dict[int, Connection] = {}  # high bits of a live connection's base tag -> that connection
        self._ended_tags: dict[int, float] = {}  # high bits of ended connections' tags -> sweep them until then
        self._worker: Any = None  # the UCX worker, when this loop progresses it (mode "loop"): unread messages swept
        self._per_peer: Counter[str] = Counter()
        self._tasks: list[asyncio.Task] = []
        self.port = 0

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
        if ucx_progress.driver() is not None:
            from ucxx.core import _get_ctx

            self._worker = _get_ctx().worker
        self._tasks = [asyncio.ensure_future(self._watchdog()), asyncio.ensure_future(self._reaper())]
        self.handlers.shm.start()
        return self.port

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for ep in list(self._connections):
            _abort(ep)
        self._connections.clear()
        self._by_tag.clear()
        self._per_peer.clear()
        self.handlers.close()

    async def _watchdog(self) -> None:
        """Abort connections past their deadline (never cancelling a UCX request: the abort fails it); log the
        memory figures now and then (debug)."""
        next_report = time.monotonic()
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            now = time.monotonic()
            if now >= next_report and log.isEnabledFor(logging.DEBUG):
                next_report = now + 5.0
                stats = self.store.stats()
                log.debug(
                    "memory: store %d used + %d spare of %d, in flight %d (peak %d) of %d, %d connections",
                    stats.used_bytes,
                    stats.spare_bytes,
                    stats.capacity_bytes,
                    self.handlers.budget.used,
                    self.handlers.budget.peak,
                    self.handlers.budget.total,
                    len(self._connections),
                )
            for conn in list(self._connections.values()):
                stalled = conn.overdue(now)
                if stalled is not None and not conn.aborted:
                    log.warning("closing a connection from %s: stalled in %s", conn.peer, stalled)
                    conn.aborted = True
                    _abort(conn.ep)
            if self._worker is not None:
                try:
                    self._sweep_unread(now)
                except Exception:  # never lose the watchdog over one sweep
                    log.exception("sweeping unread messages failed")

    def _sweep_unread(self, now: float) -> None:
        """Discard the messages nobody will receive; close connections that park them (module docstring)."""
        worker = self._worker
        for high, until in list(self._ended_tags.items()):
            discard(worker, high, CONNECTION_TAG_MASK)
            if now > until:
                del self._ended_tags[high]
        loop_now = asyncio.get_running_loop().time()
        for high, until in list(connecting_tags.items()):  # set up long ago and never admitted: ended
            if loop_now > until:
                del connecting_tags[high]
                self._ended_tags.setdefault(high, now + UNREAD_LINGER_S)
        dropped = 0
        while True:  # oldest first: stop at the first message a live connection (or one being set up) may receive
            front = oldest(worker, 0, 0)
            if (
                front is None
                or (front[0] & CONNECTION_TAG_MASK) in self._by_tag
                or (front[0] & CONNECTION_TAG_MASK) in connecting_tags
            ):
                break
            dropped += discard(worker, front[0], _FULL_TAG_MASK)
        if dropped:
            log.info("discarded %d messages sent on the tags of no connection", dropped)
        for conn in list(self._connections.values()):
            if conn.aborted:
                continue
            first = oldest(worker, conn.base_tag, CONNECTION_TAG_MASK)
            parked = None if first is None or first[0] == conn.base_tag else first[0]
            if parked is not None and conn.stage == _Stage.HANDSHAKE:
                reason = "a message on a request tag before the handshake"
            elif (
                parked is not None
                and (parked ^ conn.base_tag) not in conn.receiving
                and oldest(worker, conn.base_tag, _FULL_TAG_MASK) is None
            ):
                if conn.suspect != parked:
                    conn.suspect = parked  # a head read this instant may not have registered its id yet
                    continue
                reason = f"messages for request {parked ^ conn.base_tag}, which is not in flight"
            else:
                conn.suspect = None
                continue
            log.warning("closing a connection from %s: %s", conn.peer, reason)
            conn.aborted = True
            _abort(conn.ep)

    def _forget_tags(self, conn: Connection) -> None:
        """The connection ended: discard what it left unread, now and for UNREAD_LINGER_S."""
        high = conn.base_tag & CONNECTION_TAG_MASK
        if self._by_tag.get(high) is conn:
            del self._by_tag[high]
            self._ended_tags[high] = time.monotonic() + UNREAD_LINGER_S
            if self._worker is not None:
                discard(self._worker, high, CONNECTION_TAG_MASK)

    async def _reaper(self) -> None:
        reaper = SocketReaper(self.port)
        while True:
            await asyncio.sleep(REAP_PERIOD_S)
            closed = reaper.sweep()
            if closed:
                log.warning("closed %d sockets UCX abandoned on port %d (not UCX clients)", closed, self.port)

    # ---- one connection ----

    def _admit(self, ep: Any) -> Connection | None:
        peer = peer_host(ep)
        base_tag = int(ep._tags["msg_recv"])
        high = base_tag & CONNECTION_TAG_MASK
        connecting_tags.pop(high, None)
        if high in self._by_tag or high in self._ended_tags:  # one in 2**32 per pair: the client reconnects
            log.info("refused a connection from %s: its tags collide with another connection's", peer)
            return None
        if len(self._connections) >= self.limits.max_connections:
            log.warning("refused a connection from %s: %d connections open", peer, len(self._connections))
            return None
        if self._per_peer[peer] >= self.limits.max_connections_per_peer:
            log.warning("refused a connection from %s: %d connections from it open", peer, self._per_peer[peer])
            return None
        conn = Connection(ep, peer, time.monotonic() + self.limits.handshake_timeout_s, base_tag)
        self._connections[ep] = conn
        self._by_tag[high] = conn
        self._per_peer[peer] += 1
        return conn

    async def _serve(self, ep: Any) -> None:
        conn = self._admit(ep)
        if conn is None:
            _abort(ep)  # (its messages, if any, are on no live connection's tags: the watchdog discards them)
            return
        if self.metrics is not None:
            self.metrics.connections.inc()
            self.metrics.connections_opened.inc()
        try:
            tenant = await self._handshake(ep)
            if tenant is None:
                return
            conn.stage = _Stage.IDLE
            prefix = tenant_prefix(tenant)
            classic = -1  # the watchdog's key for the classic request being served (inline ones: positive serials)
            while not conn.aborted:
                await conn.slots.acquire()
                try:
                    header, body = await recv_head(ep)
                except protocol.ProtocolError:
                    conn.slots.release()
                    raise
                except Exception as error:  # the peer left (or the endpoint was aborted)
                    conn.slots.release()
                    raise _Closed() from error
                except BaseException:
                    conn.slots.release()
                    raise
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
        except _Closed:
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
            if self._connections.pop(ep, None) is not None:
                self._per_peer[conn.peer] -= 1
                if self._per_peer[conn.peer] <= 0:
                    del self._per_peer[conn.peer]
            conn.aborted = True
            self.handlers.shm.forget(conn)
            _abort(ep)  # fails the UCX requests of the inline requests still in flight: their tasks end by themselves
            if conn.tasks:
                await asyncio.gather(*conn.tasks, return_exceptions=True)
            self._forget_tags(conn)
            if self.metrics is not None:
                self.metrics.connections.dec()

    async def _answer_at_once(self, conn: Connection, header: protocol.Header, body: memoryview, prefix: bytes) -> None:
        """Answer a request `_served_at_once` allows: the handlers' reply meta, sent in one head on its tag. Its id
        is never in flight past this (the reply starts before the next head is read). A reply whose send does not
        complete at once has `stall_timeout_s`, like any frame."""
        meta = self.handlers.answer_now(header, body[: header.meta_len], prefix)
        sent = ucx_progress.send(
            conn.ep, protocol.pack_meta_reply(header.op, header.request_id, meta, header.count), header.request_id
        )
        if sent.done():
            sent.result()  # a failed send raises here, as awaiting it would
            return
        key = conn.new_key()
        conn.requests[key] = time.monotonic() + self.limits.stall_timeout_s
        try:
            await sent
        finally:
            conn.requests.pop(key, None)

    async def _serve_request(self, channel: Channel, prefix: bytes) -> None:
        """One request, start to reply. A refusal answers BAD_REQUEST and closes the connection; any other failure
        closes it too (an inline request's failure aborts the endpoint, which ends the connection's loop)."""
        conn = channel.conn
        inline = channel.header.inline
        try:
            try:
                await self.handlers.serve(channel, prefix)
            except Refusal as refusal:
                log.warning("refused a request from %s: %s", conn.peer, refusal)
                await channel.reply(channel.header.op, meta=str(refusal).encode(), status=protocol.Status.BAD_REQUEST)
                await asyncio.sleep(0.05)  # let the refusal reach the client before the endpoint closes
                raise _Closed() from None
        except BaseException as error:
            if not inline:
                raise
            if not conn.aborted:
                if isinstance(error, protocol.ProtocolError):
                    log.warning("closing a connection from %s: malformed request: %s", conn.peer, error)
                elif not isinstance(error, (_Closed, asyncio.CancelledError)):
                    log.info("closing a connection from %s: %r", conn.peer, error)
                conn.aborted = True
                _abort(conn.ep)
        finally:
            conn.requests.pop(channel.key, None)
            channel.done_receiving()
            if inline:
                conn.slots.release()
                task = asyncio.current_task()
                if task is not None:
                    conn.tasks.discard(task)

    async def _handshake(self, ep: Any) -> str | None:
        try:
            hello = await _recv_header(ep)
        except protocol.VersionMismatch as mismatch:
            log.warning("refused a client: %s", mismatch)
            message = f"protocol version {mismatch.version} is not supported: this node speaks {protocol.VERSION}".encode()
            reply = protocol.pack_header(
                protocol.Op.HELLO | protocol.REPLY, status=protocol.Status.BAD_REQUEST, meta_len=len(message)
            )
            await send_all(ep, [reply, message])
            await asyncio.sleep(0.05)  # let the refusal reach the client before the endpoint closes
            return None
        if hello.op != protocol.Op.HELLO or hello.data_len or hello.meta_len > protocol.MAX_ID_BYTES:
            raise protocol.ProtocolError(f"expected HELLO, got op {hello.op}")
        access_id = protocol.check_access_id(await recv_meta(ep, hello.meta_len))
        nonce = os.urandom(protocol.NONCE_BYTES)
        flags = protocol.Flags.AUTH_REQUIRED if self.access_keys else protocol.Flags.NONE
        await send_all(ep, [protocol.pack_header(protocol.Op.CHALLENGE, meta_len=len(nonce), flags=flags), nonce])
        auth = await _recv_header(ep)
        if auth.op != protocol.Op.AUTH or auth.data_len or auth.meta_len not in (0, protocol.MAC_BYTES):
            raise protocol.ProtocolError(f"expected AUTH, got op {auth.op}")
        mac = await recv_meta(ep, auth.meta_len)
        if self.access_keys:
            key = self.access_keys.get(access_id)
            if not access_id or key is None or not protocol.check_mac(key, nonce, access_id, mac):
                reason = (
                    "this node requires an access_id and access_key" if not access_id else "unknown access_id or wrong access_key"
                )
                log.warning("refused a client (access_id %r): %s", access_id, reason)
                if self.metrics is not None:
                    self.metrics.auth_failures.inc()
                message = f"authentication failed: {reason}".encode()
                await send_all(
                    ep,
                    [
                        protocol.pack_header(
                            protocol.Op.AUTH | protocol.REPLY, status=protocol.Status.AUTH_FAILED, meta_len=len(message)
                        ),
                        message,
                    ],
                )
                await asyncio.sleep(0.05)  # let the refusal reach the client before the endpoint closes
                return None
        await send_all(ep, [protocol.pack_header(protocol.Op.AUTH | protocol.REPLY)])
        log.debug("client connected as tenant %r", access_id)
        return access_id


# ---- helpers ----


async def _recv_header(ep: Any) -> protocol.Header:
    try:
        frame = await recv_header_frame(ep)
    except protocol.ProtocolError:
        raise
    except Exception as error:
        raise _Closed() from error
    return protocol.unpack_header(frame)


_AT_ONCE_OPS = frozenset((int(protocol.Op.EXISTS), int(protocol.Op.PING)))


def _served_at_once(header: protocol.Header) -> bool:
    """An inline request the connection's loop serves itself: an EXISTS or PING whose meta came in its head (no
    frame to wait for; the reply, flags, fits in a head; it waits only while the node's whole in-flight budget is
    taken). Anything else (data frames, a GET's value) gets a task, so one slow request never holds the connection's
    next head."""
    return header.op in _AT_ONCE_OPS and header.data_len == 0 and protocol.head_layout(header.meta_len, 0).meta_inline


def _windows(frames: list, window_bytes: int) -> list[list]:
    """Consecutive groups of `frames` of at most `window_bytes` each (a larger frame alone)."""
    groups: list[list] = []
    current: list = []
    size = 0
    for frame in frames:
        nbytes = memoryview(frame).nbytes
        if current and size + nbytes > window_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(frame)
        size += nbytes
    if current:
        groups.append(current)
    return groups


def _abort(ep: Any) -> None:
    try:
        ep.abort(period=10**8)
    except Exception:  # already closed by the peer or by us
        pass
    ucx_progress.kick()  # the aborted requests' failures reach their tasks now

"""The pool-node server: a store (`NodeStore`; the node serves an `ems.store.KvStore`) served over UCX
(`ems.transport.protocol`), beside its client `ems.transport.ucx`. The transport does not import the store: the node
assembly (`ems.pool.__main__`) hands one in.

Contract:
* One asyncio event loop serves every connection (UCX progress settings: `transport.ucx_config`). Each
  connection's heads are read by one coroutine; classic requests are served in order, inline requests (protocol
  docstring) each in a task of their own, up to MAX_REQUESTS_PER_CONNECTION at once, so concurrent calls of one
  client overlap. Checksumming
  and storing PUTs of more than OFFLOAD_BYTES (4 MiB) runs in worker threads so one big request does not stall the
  others; smaller ones are checked on the loop (cheaper than the hop). A 1-key GET is answered without per-segment
  work (`_get_one`), from the store's buffer. A GET that the store says may wait for a disk (`may_block(keys)`,
  a node with a disk tier) is looked up in a worker thread.
* Handshake first (`protocol` docstring). With access keys configured, a client must prove one (HMAC over a
  fresh nonce) or is refused with AUTH_FAILED; without keys every client is accepted under the tenant it names.
* Every key is stored under its tenant's namespace (`tenant_prefix(access_id) + key`), so one tenant can never
  read, overwrite or test another's keys.
* Every received frame has its length verified (`transport.ucx_frames`): a short frame can never leave a recycled
  buffer's old bytes (another tenant's value) in a stored value.
* Memory (`NodeLimits`): the bytes of requests in flight (PUT meta and data being received and stored, GET replies
  being sent), all connections together, stay within `inflight_bytes`. A PUT that could never fit is refused before
  its data is received (status BAD_REQUEST with a message, then the connection is closed, since its data frames
  are left unread); one that must wait for room waits at most `stall_timeout_s`, then is refused the same way. A GET
  reply never exceeds MAX_DATA_BYTES nor the budget: the values beyond it are answered as misses (so loads stop
  there), and a key named many times is looked up once. Replies are sent in windows of SEND_WINDOW_BYTES.
* Timeouts: a connection must finish the handshake within `handshake_timeout_s`; once a request has started,
  every frame of it (in either direction) must complete within `stall_timeout_s` of the previous one of the same
  request (a deadline per request in flight). A connection
  that breaks either is aborted. An authenticated connection may stay idle between requests (clients keep one).
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
* With `metrics` (`ems.pool.metrics.NodeMetrics`), each request, connection and refused handshake is counted once.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import numpy as np

from ems.buffers import Buffer
from ems.transport import protocol, ucx_progress
from ems.transport.shm import ShmSettings, metric_name
from ems.transport.shm_server import ShmService
from ems.transport.ucx_config import init_ucx
from ems.transport.ucx_endpoint import connecting_tags, install_safe_listener_exchange, peer_host
from ems.transport.ucx_frames import new_canary, recv_head, recv_header_frame, recv_into, recv_meta, send_all
from ems.transport.ucx_listener import BoundListener
from ems.transport.ucx_sockets import SocketReaper
from ems.transport.ucx_unexpected import discard, oldest

if TYPE_CHECKING:
    from ems.pool.metrics import NodeMetrics

log = logging.getLogger("ems.pool")
T = TypeVar("T")  # what an awaited frame step gives

# PUTs with more data than this are checksummed and stored off the event loop. The hop to a worker thread and back
# costs more than checksumming a few MiB (XXH3 ~50 us per MiB here, the hop 100-300 us on 2 busy cores), so only
# requests that would hold the loop for longer than ~0.2 ms go there.
OFFLOAD_BYTES = 4 << 20
# a GET reply's data frames are posted this many bytes at a time (UCX holds per-send state for each posted frame)
SEND_WINDOW_BYTES = 32 << 20
WATCHDOG_PERIOD_S = 0.5
REAP_PERIOD_S = 1.0
MIN_INFLIGHT_BYTES = 64 << 20
WILDCARD_HOSTS = ("0.0.0.0", "::", "*", "")
# inline requests of one connection served at once; the connection's next head waits for a free slot
MAX_REQUESTS_PER_CONNECTION = 32
# how long the tags of a connection that ended are still swept for messages that were on the wire when it closed
UNREAD_LINGER_S = 5.0
CONNECTION_TAG_MASK = ucx_progress.CONNECTION_TAG_MASK
_FULL_TAG_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class NodeLimits:
    """What one node allows (`python -m ems.pool` options of the same names)."""

    inflight_bytes: int
    handshake_timeout_s: float = 10.0
    stall_timeout_s: float = 30.0
    max_connections: int = 1024
    max_connections_per_peer: int = 64

    @classmethod
    def for_capacity(cls, capacity_bytes: int, **overrides: Any) -> NodeLimits:
        """The defaults for a node of `capacity_bytes`: in-flight bytes equal to the capacity up to 4 GiB (so a GET
        of distinct keys always fits and a request of the protocol's largest size can be received), a quarter of it
        above 16 GiB, never under 64 MiB."""
        default = max(MIN_INFLIGHT_BYTES, min(capacity_bytes, max(capacity_bytes // 4, protocol.MAX_DATA_BYTES)))
        overrides.setdefault("inflight_bytes", default)
        return cls(**overrides)


def tenant_prefix(access_id: str) -> bytes:
    """The namespace of a tenant's keys: its id, length-prefixed so no two tenants' prefixes overlap."""
    raw = access_id.encode("ascii")
    return struct.pack("<H", len(raw)) + raw


class _Closed(Exception):
    """The peer closed the connection (not an error worth a warning)."""


class _Refusal(Exception):
    """A request the node answers with BAD_REQUEST and a message, then closes the connection."""


class _Stage(enum.Enum):
    HANDSHAKE = "handshake"
    IDLE = "idle"
    BUSY = "busy"


class _Connection:
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


class _Channel:
    """Where one request's frames and reply travel: classic (base tag, in order) or inline (its own tag)."""

    __slots__ = ("body", "conn", "header", "key", "server", "tag")

    def __init__(self, server: PoolServer, conn: _Connection, header: protocol.Header, body: memoryview, key: int) -> None:
        self.server = server
        self.conn = conn
        self.header = header
        self.body = body  # the head's inline bytes
        self.tag = header.request_id if header.inline else None
        self.key = key

    def done_receiving(self) -> None:
        """Every receive of this request has ended: its id is free for the client to reuse (protocol docstring)."""
        if self.tag is not None:
            self.conn.receiving.discard(self.tag)

    async def timed(self, step: Awaitable[T]) -> T:
        """One frame: when it completes, the next frame of this request has `stall_timeout_s` again."""
        result = await step
        self.conn.requests[self.key] = time.monotonic() + self.server.limits.stall_timeout_s
        return result

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


class ByteBudget:
    """Bytes of requests in flight, all connections together (used on the event loop only)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self.peak = 0
        self._freed = asyncio.Event()

    async def acquire(self, nbytes: int, timeout_s: float) -> bool:
        """Take `nbytes` (<= total), waiting up to `timeout_s` for others to release; False if it did not fit."""
        deadline = time.monotonic() + timeout_s
        while self.used + nbytes > self.total:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), left)
            except asyncio.TimeoutError:
                return False
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return True

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        self._freed.set()


class NodeStoreStats(Protocol):
    """The memory figures a node logs (`ems.store.StoreStats` has them)."""

    used_bytes: int
    spare_bytes: int
    capacity_bytes: int


class NodeStore(Protocol):
    """What the server needs of the store it serves (`ems.store.KvStore` is one); see that class for the contract."""

    @property
    def capacity_bytes(self) -> int: ...

    @staticmethod
    def charge_of(key_len: int, nbytes: int) -> int: ...

    def allocate(self, nbytes: int, reserve: int = 0) -> np.ndarray: ...

    def recycle(self, buffer: np.ndarray, reserved: int = 0) -> None: ...

    def put_owned(self, key: bytes, value: Buffer, reserved: int = 0) -> bool: ...

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]: ...

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...

    def stats(self) -> NodeStoreStats: ...


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
        self.budget = ByteBudget(self.limits.inflight_bytes)
        self._listener: Any = None
        self._connections: dict[Any, _Connection] = {}
        self._by_tag: dict[int, _Connection] = {}  # high bits of a live connection's base tag -> that connection
        self._ended_tags: dict[int, float] = {}  # high bits of ended connections' tags -> sweep them until then
        self._worker: Any = None  # the UCX worker, when this loop progresses it (mode "loop"): unread messages swept
        self._per_peer: Counter[str] = Counter()
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ems-pool-store")
        self._tasks: list[asyncio.Task] = []
        self.port = 0
        self.shm = ShmService(shm or ShmSettings(region_bytes=0), self)  # same-host shared memory; off by default

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
        self.shm.start()
        return self.port

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self.shm.stop()
        for ep in list(self._connections):
            _abort(ep)
        self._connections.clear()
        self._by_tag.clear()
        self._per_peer.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

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
                    self.budget.used,
                    self.budget.peak,
                    self.budget.total,
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

    def _forget_tags(self, conn: _Connection) -> None:
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

    def _admit(self, ep: Any) -> _Connection | None:
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
        conn = _Connection(ep, peer, time.monotonic() + self.limits.handshake_timeout_s, base_tag)
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
                    header, body = await _recv_head(ep)
                except BaseException:
                    conn.slots.release()
                    raise
                if header.inline:
                    # served concurrently: its other frames and its reply travel on its own tag
                    request_id = header.request_id
                    if request_id == 0 or request_id in conn.receiving:
                        conn.slots.release()
                        raise protocol.ProtocolError(f"request id {request_id} is the base tag or already in flight")
                    conn.receiving.add(request_id)
                    key = conn.new_key()
                    conn.requests[key] = time.monotonic() + self.limits.stall_timeout_s
                    task = asyncio.ensure_future(self._serve_request(_Channel(self, conn, header, body, key), prefix))
                    conn.tasks.add(task)
                    # let the request run up to its first wait (a small one: its reply is posted) before this loop
                    # prepares the next head's receive
                    await asyncio.sleep(0)
                    continue
                conn.requests[classic] = time.monotonic() + self.limits.stall_timeout_s
                try:
                    await self._serve_request(_Channel(self, conn, header, body, classic), prefix)
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
            self.shm.forget(conn)
            _abort(ep)  # fails the UCX requests of the inline requests still in flight: their tasks end by themselves
            if conn.tasks:
                await asyncio.gather(*conn.tasks, return_exceptions=True)
            self._forget_tags(conn)
            if self.metrics is not None:
                self.metrics.connections.dec()

    async def _serve_request(self, channel: _Channel, prefix: bytes) -> None:
        """One request, start to reply. A refusal answers BAD_REQUEST and closes the connection; any other failure
        closes it too (an inline request's failure aborts the endpoint, which ends the connection's loop)."""
        conn = channel.conn
        inline = channel.header.inline
        try:
            try:
                await self._dispatch(channel, prefix)
            except _Refusal as refusal:
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

    async def _dispatch(self, channel: _Channel, prefix: bytes) -> None:
        if self.metrics is None:
            await self._serve_op(channel, prefix)
            return
        header = channel.header
        started, ok, nbytes = time.perf_counter(), False, 0
        try:
            nbytes = await self._serve_op(channel, prefix)
            ok = True
        finally:
            name = metric_name(header.op)
            self.metrics.request(name, ok, time.perf_counter() - started, nbytes)

    async def _serve_op(self, channel: _Channel, prefix: bytes) -> int:
        """Serve one request's operation; returns the value bytes it moved (for the metrics)."""
        header = channel.header
        op = header.op
        if op == protocol.Op.PING:
            if header.meta_len or header.data_len or header.count:
                raise protocol.ProtocolError("PING carries nothing")
            await channel.reply(op)
        elif op == protocol.Op.PUT:
            await self._put(channel, prefix)
        elif op in (protocol.Op.GET, protocol.Op.EXISTS):
            if header.data_len:
                raise protocol.ProtocolError("GET/EXISTS carry no data")
            await self._take(header.meta_len)
            try:
                meta = await channel.meta()
                keys = _namespaced(prefix, protocol.decode_keys_meta(header.count, meta))
                del meta
                if op == protocol.Op.EXISTS:
                    flags = protocol.encode_flags(self.store.contains_many(keys))
                    await channel.reply(op, count=len(keys), meta=flags)
                    return 0
            finally:
                self.budget.release(header.meta_len)
            return await self._get(channel, keys)
        elif op in (protocol.Op.SHM_OPEN, protocol.Op.SHM_PUT, protocol.Op.SHM_GET):
            return await self.shm.serve(channel, prefix)
        else:
            raise protocol.ProtocolError(f"unexpected op {op} after the handshake")
        return header.data_len

    async def _take(self, nbytes: int) -> None:
        """Reserve `nbytes` of the in-flight budget for a request, or refuse it (`_Refusal`)."""
        if nbytes > self.budget.total:
            raise _Refusal(f"a request of {nbytes} bytes exceeds this node's in-flight limit of {self.budget.total} bytes")
        if not await self.budget.acquire(nbytes, self.limits.stall_timeout_s):
            raise _Refusal(f"node busy: no room for a request of {nbytes} bytes within {self.limits.stall_timeout_s} s")

    async def _put(self, channel: _Channel, prefix: bytes) -> None:
        header = channel.header
        charge = header.meta_len + header.data_len
        await self._take(charge)  # before anything of the request beyond its head is received
        try:
            meta = await channel.meta()
            request = protocol.decode_put_meta(header.count, header.data_len, meta)
            del meta
            keys = _namespaced(prefix, request.keys)
            # Receive into buffers recycled from evicted values where the store has them (no first-touch page
            # faults); every receive verifies its length, so a recycled buffer's old bytes can never be stored.
            # A value alone in its segment is stored as that buffer: room for it is reserved first, so a full
            # node's evictions hand their buffers straight to the next receive (steady-state recycling).
            sizes = request.segment_sizes
            lone = request.value_lens == sizes[request.plan]  # each value: alone in its segment
            reserves = np.zeros(sizes.size, dtype=np.int64)
            key_lens = np.fromiter((len(k) for k in keys), dtype=np.int64, count=len(keys))
            reserves[request.plan[lone]] = [
                self.store.charge_of(int(k), int(n)) for k, n in zip(key_lens[lone], request.value_lens[lone])
            ]
            reserves[reserves > self.store.capacity_bytes] = 0  # refused by `put_owned` anyway: nothing to reserve
            segments: list = []
            try:
                for size, reserve in zip(sizes.tolist(), reserves.tolist()):
                    segments.append(self.store.allocate(int(size), reserve=int(reserve)))
                await self._receive_put(channel, request, segments)
            except BaseException:
                for seg, reserve in zip(segments, reserves.tolist()):
                    self.store.recycle(seg, reserved=int(reserve))  # every receive into it has ended
                raise
            values = _split_values(segments, request.plan, request.value_offsets, request.value_lens, sizes)
            reserved = np.where(lone, reserves[request.plan], 0).tolist()
            for seg, reserve in zip(segments, reserves.tolist()):
                if reserve == 0:  # a packed segment: its values were copied out
                    self.store.recycle(seg)
            del segments
            if header.data_len > OFFLOAD_BYTES:
                loop = asyncio.get_running_loop()
                stored = await loop.run_in_executor(self._executor, self._store_all, keys, values, reserved)
            else:
                stored = self._store_all(keys, values, reserved)
            if self.metrics is not None and not all(stored):
                self.metrics.count_damaged(values, stored)
            del values
        finally:
            self.budget.release(charge)
        flags = protocol.encode_flags(stored)
        await channel.reply(protocol.Op.PUT, count=len(keys), meta=flags)

    def _store_all(self, keys: Sequence[bytes], values: Sequence[memoryview], reserved: Sequence[int]) -> list[bool]:
        """Store each value; `reserved[i]`: the bytes `allocate` reserved for it (released on every path)."""
        return [self.store.put_owned(k, v, reserved=r) for k, v, r in zip(keys, values, reserved)]

    async def _receive_put(self, channel: _Channel, request: protocol.PutRequest, segments: list) -> None:
        """Fill every byte of `segments` with the PUT's data: from the (verified) head when it came inline, else
        by length-verified receives on the request's tag. Returns only once every receive has ended (so a failed
        request's buffers can be recycled: UCX writes into none of them any more)."""
        inline = channel.inline_data()
        if inline is not None:
            starts = np.cumsum(request.segment_sizes) - request.segment_sizes
            for seg, start, size in zip(segments, starts.tolist(), request.segment_sizes.tolist()):
                seg[:] = np.frombuffer(inline, dtype=np.uint8, count=size, offset=start)
            return
        views = [memoryview(s) for s in segments]
        ends = (request.frame_offsets + request.frame_lens).tolist()
        canary = new_canary()
        outcomes = await asyncio.gather(
            *(
                channel.timed(recv_into(channel.conn.ep, views[s][a:b], canary, channel.tag))
                for s, a, b in zip(request.frame_segments.tolist(), request.frame_offsets.tolist(), ends)
            ),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                if not channel.conn.aborted:  # the others' receives would still be posted: end them all
                    channel.conn.aborted = True
                    _abort(channel.conn.ep)
                raise outcome

    async def _get(self, channel: _Channel, keys: Sequence[bytes]) -> int:
        if len(keys) == 1:
            return await self._get_one(channel, keys[0])
        conn = channel.conn
        unique = list(dict.fromkeys(keys))  # each key once
        found = dict(zip(unique, await self.lookup_values(unique)))
        values = [found[k] for k in keys]
        del found
        lens = np.fromiter((-1 if v is None else memoryview(v).nbytes for v in values), dtype=np.int64, count=len(values))
        # never more than the protocol or the budget allows in one reply: the values beyond are misses
        limit = min(protocol.MAX_DATA_BYTES, self.budget.total)
        running = np.cumsum(np.maximum(lens, 0))
        lens[(running > limit) & (lens >= 0)] = -1
        total = int(lens[lens > 0].sum())
        if not await self.budget.acquire(total, self.limits.stall_timeout_s):
            log.warning("GET from %s answered with misses: no room for %d reply bytes", conn.peer, total)
            lens[:] = -1
            total = 0
        try:
            present = np.nonzero(lens >= 0)[0]
            present_lens = lens[present]
            plan = protocol.segment_plan(present_lens)
            offsets, sizes = protocol.segment_bounds(present_lens, plan)
            frames: list = []
            counts = np.bincount(plan, minlength=sizes.size) if plan.size else np.zeros(0, np.int64)
            # one frame per segment: a lone value is sent from the store itself, packed small values are copied once
            for seg, n in enumerate(counts.tolist()):
                if n == 1 and int(sizes[seg]) >= protocol.SEGMENT_BYTES:
                    frames.append(values[int(present[np.searchsorted(plan, seg)])])
                    continue
                buf = np.empty(int(sizes[seg]), dtype=np.uint8)
                first = int(np.searchsorted(plan, seg))
                for j in range(first, first + n):
                    value = cast(Buffer, values[int(present[j])])  # present: the store found it
                    size = int(present_lens[j])
                    buf[int(offsets[j]) : int(offsets[j]) + size] = np.frombuffer(value, dtype=np.uint8)
                if buf.size:
                    frames.append(buf)
            del values
            meta = lens.astype("<i8").tobytes()
            await channel.reply(protocol.Op.GET, count=len(keys), meta=meta, data=frames, data_len=total)
        finally:
            self.budget.release(total)
        return total

    async def lookup_values(self, keys: list[bytes]) -> list[Buffer | None]:
        """The store's values of `keys`, looked up off the event loop when the store says the lookup may wait for a
        disk (a store with a disk tier has `may_block`)."""
        may_block = getattr(self.store, "may_block", None)
        if may_block is not None and may_block(keys):
            return await asyncio.get_running_loop().run_in_executor(self._executor, self.store.get_many, keys)
        return self.store.get_many(keys)

    async def _get_one(self, channel: _Channel, key: bytes) -> int:
        """`_get` of one key (the common 1-block load), without the per-segment numpy work; the same reply: the
        value's length (-1: a miss) and the value as the one data frame, sent from the store without a copy."""
        value = (await self.lookup_values([key]))[0]
        n = -1 if value is None else memoryview(value).nbytes
        if n > min(protocol.MAX_DATA_BYTES, self.budget.total):
            n = -1
        total = max(n, 0)
        if not await self.budget.acquire(total, self.limits.stall_timeout_s):
            log.warning("GET from %s answered with misses: no room for %d reply bytes", channel.conn.peer, total)
            n, total = -1, 0
        try:
            frames = [value] if n > 0 else []
            del value
            await channel.reply(protocol.Op.GET, count=1, meta=struct.pack("<q", n), data=frames, data_len=total)
        finally:
            self.budget.release(total)
        return total


# ---- helpers ----


def _namespaced(prefix: bytes, keys: Sequence[bytes]) -> list[bytes]:
    return [prefix + k for k in keys]


def _split_values(segments: list[np.ndarray], plan: np.ndarray, offsets: np.ndarray, lens: np.ndarray, sizes: np.ndarray) -> list:
    """Each value of a PUT: a value alone in its segment is stored as the receive buffer itself (so the store can
    recycle it once evicted); packed ones are copied out, so a small value never pins its whole segment in memory
    (the store charges only the value's bytes)."""
    out: list = []
    for seg, off, n in zip(plan.tolist(), offsets.tolist(), lens.tolist()):
        if n == int(sizes[seg]):
            out.append(segments[seg])
        else:
            out.append(bytes(memoryview(segments[seg])[off : off + n]))
    return out


async def _recv_header(ep: Any) -> protocol.Header:
    try:
        frame = await recv_header_frame(ep)
    except protocol.ProtocolError:
        raise
    except Exception as error:
        raise _Closed() from error
    return protocol.unpack_header(frame)


async def _recv_head(ep: Any) -> tuple[protocol.Header, memoryview]:
    try:
        return await recv_head(ep)
    except protocol.ProtocolError:
        raise
    except Exception as error:
        raise _Closed() from error


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

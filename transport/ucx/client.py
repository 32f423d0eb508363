"""The UCX client transport: a `NodeClient` for one remote pool node, on `ucxx`.

Contract:
* Every call runs on the calling thread (`transport.ucx.direct`): it posts its frames on the process's client UCX
  worker, whose C++ progress thread moves the bytes without the GIL, and waits for their completion itself. The
  calling thread waits until the call's `Deadline` at most; on timeout the call's requests are kept until UCX ends them and
  `TransportError(EMS_IO_TIMEOUT)` is raised. A request whose whole reply is one message, whose receive was posted
  before the request went out (an EXISTS or PING: `Reply.ONE_MESSAGE`), leaves the connection as it is: the kept
  receive takes the late reply, on the request's own tag, so it can never answer a later request, and the other
  calls in flight on the connection go on (a lookup's short timeout on a busy node used to abort the connection
  under every load, save and record read sharing it, and the backoff then failed them all for a while). Any other
  request's timeout aborts the endpoint (a reply's later frames would have no receive to take them). Lost
  connections, refused handshakes and malformed replies raise `EMS_IO_ERROR`.
* One connection per node, several requests in flight on it (inline framing): each request has
  a request id, its frames after the head and its whole reply travel on its own tag, so concurrent calls (async
  saves, TP ranks) overlap on one connection. An exists or any small request is one message each way. A GET posts
  every segment receive at once as soon as the reply head is in: its bytes never wait for the calling thread.
* `get_into` receives values straight into caller-provided buffers (a value alone in its segment is received in
  place, length-verified; small packed values are copied out of their segment), so a load allocates nothing.
* Lazy reconnect: a call on a dropped connection reconnects first (concurrent calls wait for one connect). After a
  failure the wire reported (connect refused or timed out, connection reset or lost, a malformed reply, a refused
  handshake), calls that would reconnect within `RECONNECT_BACKOFF_S` fail at once with the last error instead of
  hammering a dead node. A cancellation this client chose says nothing about the node and starts no back-off: an
  `abort()` (a caller stopped waiting: another node answered, a write has its copies elsewhere), `close()`, a
  request past its caller's deadline, a wait for another call's connect past it; nor do the failures of the calls
  in flight on a connection it aborted. A call still connecting (or waiting for another call's connect) when `abort()`
  comes fails as soon as the connection is made, without sending its request; the connect itself is never cut short
  (under continual hedging a connection must still get made) and serves the next calls. The next call after a
  cancellation reconnects at once. A failure, or a timeout of a request whose reply may have several frames, aborts
  the endpoint (the other requests in flight on it fail too, each by its own deadline at the latest, never with
  another request's answer).
* Same host: with a node on this host (and `shm` not OFF), values move through a shared-memory region of the
  connection (`transport.shm.client`, handed this node's connection, requests and failures as a `NodeLink`); any
  call it cannot serve goes over UCX as above.
* Authentication: the handshake proves `access_key` with HMAC-SHA256 over the node's nonce; the key never travels.
* `_call(request, deadline)` runs `request(exchange, request_id)` (a `ucx.direct.Exchange` on the connection) under
  those rules: the one way a request reaches the node (`shm.client` sends its SHM ops through it too, by its link).
"""

from __future__ import annotations

import enum
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from ems.buffers import Buffer, copy_bytes
from ems.errors import EmsErrorCode
from ems.records import Deadline
from ems.transport import metas, protocol
from ems.transport.base import AsPlaced, Ending, Failure, NodeClient, TransportError
from ems.transport.exists_holds import Hold, encode_exists_meta
from ems.transport.scratch import RECEIVE_SCRATCH
from ems.transport.shm.client import ShmBuffer, ShmClient, ShmMode
from ems.transport.shm.wire import is_local_address
from ems.transport.ucx.direct import Connection, DirectRuntime, Exchange, WaitTimeout, connect, futures_context
from ems.transport.ucx.frames import (
    HEAD_BYTES,
    check_frame,
    check_header_frame,
    frame_error,
    head_layout,
    new_head_buffer,
    new_header_frame,
    new_meta_frame,
    pack_head,
    parse_head,
    prepare_frame,
)

log = logging.getLogger(__name__)

RECONNECT_BACKOFF_S = 0.5
T = TypeVar("T")  # what a request answers


def resolve(address: str) -> tuple[str, int]:
    """ "host:port" → (IPv4 address, port); TransportError(EMS_IO_ERROR) when it cannot be resolved."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise TransportError(EmsErrorCode.EMS_IO_ERROR, f"{address}: not a host:port address")
    try:
        return socket.gethostbyname(host.strip("[]")), int(port)
    except OSError as error:
        raise TransportError(EmsErrorCode.EMS_IO_ERROR, f"{address}: cannot resolve {host!r}: {error}") from None


class _ConnectTimeout(Exception):
    """The connection was not made in time."""


class _CancelledWhileConnecting(Exception):
    """`abort()` came while the call was connecting: it sends nothing (the connection is kept for the next calls)."""


class _ConnectWaitTimeout(Exception):
    """The caller's deadline passed while another call was connecting (that call reports how its connect went)."""


class Reply(enum.Enum):
    """What a request's reply is, which decides what its timeout costs the connection (see the contract)."""

    ONE_MESSAGE = "one message"  # an inline head only, its receive posted up front: a timeout keeps the connection
    FRAMES = "frames"  # may bring frames received after the head: a timeout aborts the connection


class _BackingOff(TransportError):
    """A call that would reconnect within the back-off: the last failure's error, raised as it is."""


class _Refused(Exception):
    """The node answered with an error status (its message is in args[0])."""


class UcxNode(NodeClient):
    """A remote pool node over UCX; see the module docstring."""

    self_timed = True
    places_progressively = True  # (through shared memory only: see `get_into`)

    def __init__(
        self,
        address: str,
        *,
        access_id: str | None = None,
        access_key: str | None = None,
        connect_timeout_ms: int = 3000,
        shm: ShmMode | None = None,
    ) -> None:
        self.address = address
        self._ip, self._port = resolve(address)
        self._access_id = access_id or ""
        self._access_key = access_key
        self._connect_timeout_s = connect_timeout_ms / 1000.0
        self._runtime = DirectRuntime.get()
        self._conn: Connection | None = None
        self._connect_lock = threading.Lock()  # one connect at a time; the others wait for it
        self._id_lock = threading.Lock()  # the request ids and the current connection
        self._next_id = 0
        self._cancels = 0  # how many times `abort` / `close` ran: a call that saw it change while connecting is cancelled
        self._retry_at = 0.0
        self._last_error: TransportError | None = None
        self.last_failure = Failure.NONE
        wants_shm = (shm or ShmMode.AUTO) != ShmMode.OFF and is_local_address(self._ip)
        self.shm: ShmClient | None = ShmClient(_ShmLink(self)) if wants_shm else None

    # ---- NodeClient ----

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[Buffer]], deadline: Deadline | float) -> list[bool]:
        if not keys:
            return []
        deadline = Deadline.within(deadline)
        if self.shm is not None:
            stored = self.shm.put(keys, values, deadline)
            if stored is not None:
                return stored
        meta, frames, data_len = _build_put(keys, values)
        return self._call(lambda ex, rid: _put(ex, rid, meta, frames, data_len, len(keys)), deadline)

    def get(self, keys: Sequence[bytes], deadline: Deadline | float) -> list[Buffer | None]:
        if not keys:
            return []
        meta = metas.encode_keys_meta(keys)
        return self._call(lambda ex, rid: _get(ex, rid, meta, len(keys), None), deadline)

    def get_into(
        self, keys: Sequence[bytes], outs: Sequence[Buffer], deadline: Deadline | float, as_placed: AsPlaced | None = None
    ) -> list[bool]:
        """`NodeClient.get_into`; `as_placed` runs only where the values travel through this host's shared memory
        into buffers that lie in the region (`ShmClient.get_into`)."""
        if not keys:
            return []
        if len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} buffers")
        views = [_writable_bytes(o) for o in outs]
        deadline = Deadline.within(deadline)
        if self.shm is not None:
            placed = self.shm.get_into(keys, views, deadline, as_placed)
            if placed is not None:
                return placed
        meta = metas.encode_keys_meta(keys)
        return self._call(lambda ex, rid: _get(ex, rid, meta, len(keys), views), deadline)

    def exists(self, keys: Sequence[bytes], deadline: Deadline | float, hold: Hold | None = None) -> list[bool]:
        if not keys:
            return []
        meta = encode_exists_meta(metas.encode_keys_meta(keys), hold)
        flags = 0 if hold is None else hold.flags
        if self.shm is not None:  # a same-host node: over the region's channel, where there is one
            deadline = Deadline.within(deadline)
            held = self.shm.exists(meta, len(keys), flags, deadline)
            if held is not None:
                return held
        reply = Reply.ONE_MESSAGE if head_layout(len(keys), 0).meta_inline else Reply.FRAMES
        return self._call(lambda ex, rid: _exists(ex, rid, meta, len(keys), flags), deadline, reply)

    def ping(self, deadline: Deadline | float) -> bool:
        try:
            self._call(_ping, deadline, Reply.ONE_MESSAGE)
            return True
        except TransportError:
            return False

    def abort(self) -> None:
        """`NodeClient.abort`: drop the connection (its requests in flight fail; each call returns once UCX has
        completed its requests, or by its deadline); a cancellation, not a failure: the next call reconnects at
        once (no back-off)."""
        self._cancel()

    def close(self) -> None:
        self._cancel()
        if self.shm is not None:
            self.shm.close()

    def shm_buffer(self, nbytes: int) -> ShmBuffer | None:
        """`nbytes` of this connection's shared-memory region, which `put` / `get_into` move without a copy when
        the values lie in it; None when there is none yet (a call opens it), or no room in it."""
        return None if self.shm is None else self.shm.buffer(nbytes)

    def connect_now(self, deadline: Deadline | float) -> None:
        """Connect (and authenticate) now instead of on the first call; TransportError on failure. On the same
        host, also open the connection's shared-memory region now (the calls would open it on first use): its
        pages are then populated in the background before the first load needs them (`shm.PREFAULT_BYTES`),
        and that load stages in it from the start. A region that cannot be opened only leaves the calls on UCX."""
        limit = Deadline.within(deadline)
        self._call(lambda ex, rid: None, limit)
        if self.shm is not None:
            try:
                self.shm.region(limit)
            except TransportError as error:  # the connection was dropped: the next call reconnects, as after any failure
                log.info("%s: shared-memory region not opened at connect: %s", self.address, error.message())

    # ---- machinery ----

    def _call(self, request: Callable[[Exchange, int], T], limit: Deadline | float, reply: Reply = Reply.FRAMES) -> T:
        deadline = Deadline.within(limit).at
        timeout_s = max(0.0, deadline - time.monotonic())
        exchange: Exchange | None = None
        conn: Connection | None = None
        cancels = self._cancels
        try:
            with futures_context():
                conn = self._connection(deadline)
                if self._cancels != cancels:  # aborted while connecting: see the module docstring
                    raise _CancelledWhileConnecting()
                with self._id_lock:
                    self._next_id = self._next_id % protocol.MAX_REQUEST_ID + 1
                    rid = self._next_id
                exchange = Exchange(conn, deadline)
                result = request(exchange, rid)
            self.last_failure = Failure.NONE
            return result
        except WaitTimeout:
            message = f"no answer within {timeout_s:.3f} s"
            if reply is Reply.ONE_MESSAGE and exchange is not None:  # sent, its reply's receive kept: see the contract
                self.last_failure = Failure.TIMEOUT
                raise TransportError(EmsErrorCode.EMS_IO_TIMEOUT, f"{self.address}: {message}") from None
            raise self._fail(conn, EmsErrorCode.EMS_IO_TIMEOUT, message, ending=Ending.CANCELLED) from None
        except _BackingOff:
            raise  # (not a new failure: the back-off stays as it is)
        except _CancelledWhileConnecting:
            message = "aborted by this client while the call was connecting"
            raise self._fail(None, EmsErrorCode.EMS_IO_ERROR, message, Failure.CANCELLED, Ending.CANCELLED) from None
        except _ConnectWaitTimeout:
            message = f"not connected within {timeout_s:.3f} s (another call is connecting)"
            raise self._fail(None, EmsErrorCode.EMS_IO_TIMEOUT, message, ending=Ending.CANCELLED) from None
        except _ConnectTimeout:
            raise self._fail(conn, EmsErrorCode.EMS_IO_TIMEOUT, "connect timed out") from None
        except _Refused as error:
            raise self._fail(conn, EmsErrorCode.EMS_IO_ERROR, str(error), Failure.REFUSED) from None
        except protocol.ProtocolError as error:
            raise self._fail(conn, EmsErrorCode.EMS_IO_ERROR, f"malformed reply: {error}") from None
        except TransportError as error:
            raise self._fail(conn, error.status_code(), error.message()) from None
        except Exception as error:  # UCX errors: connection refused, reset, peer failure
            raise self._fail(conn, EmsErrorCode.EMS_IO_ERROR, f"connection failed: {error!r}") from None
        finally:
            if exchange is not None:
                exchange.release()

    def _check_backoff(self) -> None:
        now = time.monotonic()
        if now < self._retry_at and self._last_error is not None:
            raise _BackingOff(
                self._last_error.status_code(),
                f"{self._last_error.message()} (next reconnect attempt in {self._retry_at - now:.2f} s)",
            )

    def _connection(self, deadline: float) -> Connection:
        """The live connection, made now (once, by whichever caller gets there first) when there is none; within
        the back-off after a failure, the last error instead of a connect."""
        conn = self._conn
        if conn is not None:
            return conn
        self._check_backoff()
        if not self._connect_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise _ConnectWaitTimeout()
        try:
            conn = self._conn
            if conn is not None:
                return conn
            self._check_backoff()  # the connect this caller waited for failed
            conn = self._open(min(deadline, time.monotonic() + self._connect_timeout_s))
            with self._id_lock:
                self._conn = conn
            self._runtime.live.add(conn)
            return conn
        finally:
            self._connect_lock.release()

    def _open(self, deadline: float) -> Connection:
        try:
            conn = connect(self._runtime, self._ip, self._port, deadline)
        except WaitTimeout:
            raise _ConnectTimeout() from None
        ex = Exchange(conn, deadline)
        try:
            access_id = self._access_id.encode("ascii")
            hello_header = protocol.pack_header(protocol.Op.HELLO, meta_len=len(access_id), meta_end=protocol.end_byte(access_id))
            hello = [hello_header] + ([access_id] if access_id else [])
            ex.wait([ex.send(f) for f in hello])
            challenge = _recv_header(ex, protocol.Op.CHALLENGE)
            nonce = _recv_meta(ex, challenge)
            if len(nonce) != protocol.NONCE_BYTES:
                raise protocol.ProtocolError("bad challenge")
            if challenge.flags & protocol.Flags.AUTH_REQUIRED and self._access_key is None:
                raise _Refused(f"{self.address}: authentication failed: the node requires access_id and access_key")
            mac = protocol.auth_mac(self._access_key, nonce, self._access_id) if self._access_key is not None else b""
            auth_header = protocol.pack_header(protocol.Op.AUTH, meta_len=len(mac), meta_end=protocol.end_byte(mac))
            auth: list[Any] = [auth_header] + ([mac] if mac else [])
            ex.wait([ex.send(f) for f in auth])
            _recv_header(ex, protocol.Op.AUTH | protocol.REPLY)
            return conn
        except _Refused as error:
            conn.abort(Ending.FAILED)
            message = str(error)
            raise _Refused(message if message.startswith(self.address) else f"{self.address}: {message}") from None
        except WaitTimeout:
            conn.abort(Ending.FAILED)
            raise _ConnectTimeout() from None
        except BaseException:
            conn.abort(Ending.FAILED)
            raise
        finally:
            ex.release()

    def _fail(
        self,
        conn: Connection | None,
        code: EmsErrorCode,
        message: str,
        failure: Failure | None = None,
        ending: Ending = Ending.FAILED,
    ) -> TransportError:
        """Record a call's failure: drop its connection (a late reply must never answer a later request) and, for a
        failure the wire reported (`Ending.FAILED`), back off. A call that failed on a connection this client had
        already cancelled (`abort`, `close`, another call's deadline) failed because of that cancellation: no
        back-off either (the module docstring)."""
        if conn is not None and conn.ending is Ending.CANCELLED and ending is Ending.FAILED:
            ending = Ending.CANCELLED
            message = f"{message} (its connection was aborted by this client)"
            failure = failure or Failure.CANCELLED
        error = TransportError(code, message if message.startswith(self.address) else f"{self.address}: {message}")
        if conn is not None:
            self._drop(conn, ending)
        if ending is Ending.FAILED:
            self._retry_at = time.monotonic() + RECONNECT_BACKOFF_S
            self._last_error = error
        if failure is None:
            failure = Failure.TIMEOUT if code == EmsErrorCode.EMS_IO_TIMEOUT else Failure.UNREACHABLE
        self.last_failure = failure
        return error

    def _cancel(self) -> None:
        """`abort` / `close`: the calls in flight fail, a cancellation (the module docstring)."""
        with self._id_lock:
            self._cancels += 1
        self._drop(None, Ending.CANCELLED)

    def _drop(self, conn: Connection | None, ending: Ending) -> None:
        """Drop the current connection when it is `conn` (None: whatever it is); a newer one is left alone. A `conn`
        that failed before it became current is aborted all the same. `ending`: why (`Connection.ending`)."""
        with self._id_lock:
            if conn is None or conn is self._conn:
                conn, self._conn = self._conn, None
        if conn is not None:
            self._runtime.live.discard(conn)
            conn.abort(ending)


class _ShmLink:
    """What the node's `ShmClient` needs of it (`shm.opening.NodeLink`): its connection, inline requests on it through
    `_call`, and the record of a failed region channel's request (`_fail`)."""

    def __init__(self, node: UcxNode) -> None:
        self._node = node

    @property
    def address(self) -> str:
        return self._node.address

    def connection(self) -> Connection | None:
        return self._node._conn

    def request(self, op: int, count: int, meta: bytes, deadline: Deadline, on: Any = None) -> tuple[Any, bytes] | None:
        def run(ex: Exchange, rid: int) -> tuple[Any, bytes] | None:
            if on is not None and ex.conn is not on:
                return None
            reply, body = _request(ex, rid, op, count=count, meta=meta)
            return ex.conn, bytes(body[: reply.meta_len])

        return self._node._call(run, deadline)

    def fail(
        self, conn: Any, code: EmsErrorCode, message: str, failure: Failure | None = None, ending: Ending = Ending.FAILED
    ) -> TransportError:
        return self._node._fail(conn, code, message, failure, ending)

    def timed_out(self, message: str) -> TransportError:
        self._node.last_failure = Failure.TIMEOUT
        return TransportError(EmsErrorCode.EMS_IO_TIMEOUT, f"{self._node.address}: {message}")

    def close(self) -> None:
        self._node.close()


# ---- requests (run on the calling thread; see ucx.direct) ----


def _request(
    ex: Exchange,
    rid: int,
    op: int,
    *,
    count: int = 0,
    meta: bytes = b"",
    data: Sequence[Any] = (),
    data_len: int = 0,
    flags: int = 0,
) -> tuple[protocol.Header, memoryview]:
    """Send one inline request (head on the base tag, the rest on tag `rid`) and receive its reply's head (on tag
    `rid`): the reply header (status OK, the expected op) and its inline bytes; the reply's meta frame, when it did
    not fit inline, is received too and returned in place of the inline bytes."""
    header = protocol.pack_header(
        op,
        count=count,
        meta_len=len(meta),
        data_len=data_len,
        flags=protocol.Flags.INLINE | flags,
        request_id=rid,
        meta_end=protocol.end_byte(meta),
    )
    layout = head_layout(len(meta), data_len)
    head = pack_head(header, meta, data)
    frames = ([] if layout.meta_inline else [meta]) + ([] if layout.data_inline else list(data))
    # the reply's receive, the head and the rest of the request are all posted at once (different tags, so their
    # order does not matter); the reply is awaited while the rest goes out: a node that refuses the request before
    # receiving its data (too large for its in-flight budget) answers at once, and that answer must not wait
    # behind unsent data
    buf, canary = new_head_buffer()
    reply_recv = ex.recv(buf, rid)
    sends = [ex.send(head)] + [ex.send(f, rid) for f in frames if len(f)]
    try:
        ex.wait([reply_recv])
    except WaitTimeout:
        raise
    except Exception as error:
        raise frame_error(error, f"{HEAD_BYTES} bytes where a head was expected") from None
    reply, body = parse_head(buf, canary)
    if reply.status != protocol.Status.OK:
        text = bytes(body[: reply.meta_len]) if head_layout(reply.meta_len, 0).meta_inline else b""
        raise _Refused(text.decode("utf-8", "replace") or f"node answered status {reply.status}")
    if reply.op != op | protocol.REPLY or not reply.inline or reply.request_id != rid:
        raise protocol.ProtocolError(
            f"expected op {op | protocol.REPLY:#x} for request {rid}, got {reply.op:#x} ({reply.request_id})"
        )
    if not head_layout(reply.meta_len, reply.data_len).meta_inline:
        body = memoryview(_recv_meta(ex, reply, rid))
    ex.wait(sends)
    return reply, body


def _ping(ex: Exchange, rid: int) -> None:
    _request(ex, rid, protocol.Op.PING)


def _put(ex: Exchange, rid: int, meta: bytes, frames: list, data_len: int, count: int) -> list[bool]:
    reply, body = _request(ex, rid, protocol.Op.PUT, count=count, meta=meta, data=frames, data_len=data_len)
    return protocol.decode_flags(count, body[: reply.meta_len])


def _exists(ex: Exchange, rid: int, meta: bytes, count: int, flags: int = 0) -> list[bool]:
    reply, body = _request(ex, rid, protocol.Op.EXISTS, count=count, meta=meta, flags=flags)
    return protocol.decode_flags(count, body[: reply.meta_len])


def _recv_frames(ex: Exchange, views: Sequence[memoryview], ends: bytes, rid: int | None) -> None:
    """Receive one frame into each of `views` (all posted at once, one wait), each ending with the byte of `ends`
    beside it, each length-verified (ucx.frames)."""
    if len(ends) != len(views):
        raise protocol.ProtocolError(f"{len(ends)} end bytes for {len(views)} frames")
    posted = []
    for view, end in zip(views, ends):
        if view.nbytes:
            prepare_frame(view, end)
            posted.append(ex.recv(view, rid))
    try:
        ex.wait(posted)
    except WaitTimeout:
        raise
    except Exception as error:
        raise frame_error(error, "the bytes announced") from None
    for view, end in zip(views, ends):
        if view.nbytes:
            check_frame(view, end)


def _get(ex: Exchange, rid: int, meta: bytes, count: int, outs: list[memoryview] | None) -> list:
    """GET: the values (`outs` None: read-only views of fresh segments), or, with `outs`, whether each value was
    placed in its caller buffer (a value of another length than its buffer counts as a miss)."""
    reply, body = _request(ex, rid, protocol.Op.GET, count=count, meta=meta)
    lens, present, plan, ends = metas.decode_get_reply(count, reply.data_len, body[: reply.meta_len])
    inline = head_layout(reply.meta_len, reply.data_len).data_inline
    if outs is not None and count == 1 and not inline and 0 < int(lens[0]) == outs[0].nbytes:
        # the common 1-block load: one value, alone in its segment, received straight into its buffer
        _recv_frames(ex, outs, ends, rid)
        return [True]
    present_lens = lens[present]
    offsets, sizes = metas.segment_bounds(present_lens, plan)
    fits = (  # per present value: its caller buffer has its size (none without caller buffers)
        np.zeros(0, dtype=bool)
        if outs is None
        else np.fromiter((outs[i].nbytes for i in present.tolist()), dtype=np.int64, count=present.size) == present_lens
    )
    segments: list = []
    receiving: list[memoryview] = []
    receiving_ends = bytearray()
    scratch: list[np.ndarray] = []  # reusable receive buffers, given back once their values are copied out
    seg_start = 0
    counts = np.bincount(plan, minlength=sizes.size) if plan.size else np.zeros(0, np.int64)
    first = np.cumsum(counts) - counts
    for seg, size in enumerate(sizes.tolist()):
        if inline:
            segments.append(body[reply.meta_len + seg_start : reply.meta_len + seg_start + size])
        elif outs is not None and counts[seg] == 1 and fits[first[seg]] and size:
            target = outs[int(present[first[seg]])]
            segments.append(target)  # received in place
            receiving.append(target)
            receiving_ends.append(ends[seg])
        else:
            # a packed segment (values copied out below) in a reused buffer: a fresh one faults in page by page
            array = RECEIVE_SCRATCH.take(size) if outs is not None else np.empty(size, dtype=np.uint8)
            buf = memoryview(array)
            segments.append(buf)
            receiving.append(buf)
            receiving_ends.append(ends[seg])
            if outs is not None:
                scratch.append(array)
        seg_start += size
    if receiving:
        # every segment's receive posted at once: the transfer wakes this thread once, when it ends
        _recv_frames(ex, receiving, bytes(receiving_ends), rid)
    if outs is None:
        views = [s if isinstance(s, memoryview) and s.readonly else memoryview(s).toreadonly() for s in segments]
        out: list = [None] * count
        for i, seg, off, n in zip(present.tolist(), plan.tolist(), offsets.tolist(), present_lens.tolist()):
            out[i] = views[seg][off : off + n]
        return out
    placed = [False] * count
    for j, (i, seg, off, n) in enumerate(zip(present.tolist(), plan.tolist(), offsets.tolist(), present_lens.tolist())):
        if not fits[j]:
            continue
        if segments[seg] is not outs[i]:
            outs[i][:] = segments[seg][off : off + n]
        placed[i] = True
    RECEIVE_SCRATCH.give(scratch)  # only here: after a failure UCX may still write into them (kept with the request)
    return placed


def _writable_bytes(buffer: Buffer) -> memoryview:
    view = memoryview(buffer)
    if view.readonly:
        raise ValueError("get_into needs writable buffers")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _as_bytes(part: Buffer) -> memoryview:
    view = memoryview(part)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _build_put(keys: Sequence[bytes], values: Sequence[Sequence[Buffer]]) -> tuple[bytes, list, int]:
    """The PUT meta, its data frames and their byte count: a value big enough to be its own segment goes out part by
    part without a copy; small values are packed into one buffer per segment."""
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys but {len(values)} values")
    parts = [[_as_bytes(p) for p in parts] for parts in values]
    lens = np.fromiter((sum(p.nbytes for p in ps) for ps in parts), dtype=np.int64, count=len(parts))
    plan = metas.segment_plan(lens)
    offsets, sizes = metas.segment_bounds(lens, plan)
    frames: list = []
    frame_lens: list[int] = []
    packed = np.empty(0, dtype=np.uint8)  # replaced at each new segment, before any value is packed into it
    current = -1
    for i, seg in enumerate(plan.tolist()):
        if int(sizes[seg]) == int(lens[i]) and int(lens[i]) >= protocol.SEGMENT_BYTES:
            for p in parts[i]:
                if p.nbytes:
                    frames.append(p)
                    frame_lens.append(p.nbytes)
            continue
        if seg != current:
            current = seg
            packed = np.empty(int(sizes[seg]), dtype=np.uint8)
            if packed.size:
                frames.append(packed)
                frame_lens.append(packed.size)
        at = int(offsets[i])
        for p in parts[i]:
            copy_bytes(packed[at : at + p.nbytes], p)
            at += p.nbytes
    meta = metas.encode_put_meta(keys, lens, np.asarray(frame_lens, dtype=np.int64), protocol.end_bytes(frames))
    return meta, frames, int(lens.sum())


# ---- frames of the handshake (classic framing, on the base tag) ----


def _recv_header(ex: Exchange, expected_op: int) -> protocol.Header:
    frame = new_header_frame()
    try:
        ex.wait([ex.recv(frame)])
    except WaitTimeout:
        raise
    except Exception as error:
        raise frame_error(error, f"{protocol.HEADER_SIZE} bytes where a header was expected") from None
    check_header_frame(frame)
    header = protocol.unpack_header(frame)
    if header.status != protocol.Status.OK:
        message = _recv_meta(ex, header).decode("utf-8", "replace") if header.meta_len else ""
        raise _Refused(message or f"node answered status {header.status}")
    if header.op != expected_op:
        raise protocol.ProtocolError(f"expected op {expected_op:#x}, got {header.op:#x}")
    return header


def _recv_meta(ex: Exchange, header: protocol.Header, rid: int | None = None) -> bytes:
    """The meta frame of `header`: exactly `meta_len` bytes ending with `meta_end` (the limit checked first)."""
    frame = new_meta_frame(header)
    if frame is None:
        return b""
    _recv_frames(ex, [memoryview(frame)], bytes([header.meta_end]), rid)
    return bytes(frame)

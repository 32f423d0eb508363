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
* One connection per node, several requests in flight on it (inline framing, `ucx.frames`): each request has a
  request id, its frames after the head and its whole reply travel on its own tag, so concurrent calls (async saves,
  TP ranks) overlap on one connection; each request's frames: `ucx.client_requests`.
* Lazy reconnect (`ucx.connector`): a call on a dropped connection reconnects first (concurrent calls wait for one
  connect). After a
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
* Lookups across hosts (and on this host without shared memory) go over the connection's lookup channel, a TCP
  socket of their own (`transport.tcp`), once one is open: the first lookup of a connection opens it in the
  background and goes over UCX; `connect_now` opens it at once. Any lookup it cannot serve goes over UCX.
* Authentication: the handshake proves `access_key` with HMAC-SHA256 over the node's nonce; the key never travels
  (`client_requests.handshake`).
* `_call(request, deadline)` runs `request(exchange, request_id)` (a `ucx.direct.Exchange` on the connection) under
  those rules: the one way a request reaches the node (`shm.client` sends its SHM ops through it too, by its link).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ems.buffers import Buffer, writable_bytes
from ems.errors import EmsErrorCode
from ems.records import Deadline
from ems.transport import metas, protocol
from ems.transport.base import AsPlaced, Ending, Failure, NodeClient, TransportError
from ems.transport.exists_holds import Hold, encode_exists_meta
from ems.transport.shm.client import ShmBuffer, ShmClient, ShmMode
from ems.transport.shm.wire import is_local_address
from ems.transport.tcp.client import TcpLookups
from ems.transport.ucx import client_requests
from ems.transport.ucx.client_requests import Refused, Reply
from ems.transport.ucx.connector import BackingOff, Connector, ConnectTimeout, ConnectWaitTimeout
from ems.transport.ucx.direct import Connection, DirectRuntime, Exchange, WaitTimeout, futures_context
from ems.transport.ucx.frames import head_layout

log = logging.getLogger(__name__)

T = TypeVar("T")  # what a request answers


class _CancelledWhileConnecting(Exception):
    """`abort()` came while the call was connecting: it sends nothing (the connection is kept for the next calls)."""


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
        self._link = Connector(address, access_id or "", access_key, connect_timeout_ms / 1000.0, DirectRuntime.get())
        self._id_lock = threading.Lock()  # the request ids
        self._next_id = 0
        wants_shm = (shm or ShmMode.AUTO) != ShmMode.OFF and is_local_address(self._link.ip)
        self.shm: ShmClient | None = ShmClient(_NodeLink(self)) if wants_shm else None
        # lookups beside the connection on a TCP socket of their own, where no region's channel carries them
        self.lookups: TcpLookups | None = None if wants_shm else TcpLookups(_NodeLink(self))

    # ---- NodeClient ----

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[Buffer]], deadline: Deadline | float) -> list[bool]:
        if not keys:
            return []
        deadline = Deadline.within(deadline)
        if self.shm is not None:
            stored = self.shm.put(keys, values, deadline)
            if stored is not None:
                return stored
        meta, frames, data_len = client_requests.build_put(keys, values)
        return self._call(lambda ex, rid: client_requests.put(ex, rid, meta, frames, data_len, len(keys)), deadline)

    def get(self, keys: Sequence[bytes], deadline: Deadline | float) -> list[Buffer | None]:
        if not keys:
            return []
        meta = metas.encode_keys_meta(keys)
        return self._call(lambda ex, rid: client_requests.get(ex, rid, meta, len(keys), None), deadline)

    def get_into(
        self, keys: Sequence[bytes], outs: Sequence[Buffer], deadline: Deadline | float, as_placed: AsPlaced | None = None
    ) -> list[bool]:
        """`NodeClient.get_into`; `as_placed` runs only where the values travel through this host's shared memory
        into buffers that lie in the region (`ShmClient.get_into`)."""
        if not keys:
            return []
        if len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} buffers")
        views = [writable_bytes(o) for o in outs]
        deadline = Deadline.within(deadline)
        if self.shm is not None:
            placed = self.shm.get_into(keys, views, deadline, as_placed)
            if placed is not None:
                return placed
        meta = metas.encode_keys_meta(keys)
        return self._call(lambda ex, rid: client_requests.get(ex, rid, meta, len(keys), views), deadline)

    def exists(self, keys: Sequence[bytes], deadline: Deadline | float, hold: Hold | None = None) -> list[bool]:
        if not keys:
            return []
        meta = encode_exists_meta(metas.encode_keys_meta(keys), hold)
        flags = 0 if hold is None else hold.flags
        deadline = Deadline.within(deadline)
        if self.shm is not None:  # a same-host node: over the region's channel, where there is one
            held = self.shm.exists(meta, len(keys), flags, deadline)
            if held is not None:
                return held
        elif self.lookups is not None:  # over the connection's lookup channel, where there is one
            held = self.lookups.exists(meta, len(keys), flags, deadline)
            if held is not None:
                return held
        reply = Reply.ONE_MESSAGE if head_layout(len(keys), 0).meta_inline else Reply.FRAMES
        return self._call(lambda ex, rid: client_requests.exists(ex, rid, meta, len(keys), flags), deadline, reply)

    def ping(self, deadline: Deadline | float) -> bool:
        try:
            self._call(client_requests.ping, deadline, Reply.ONE_MESSAGE)
            return True
        except TransportError:
            return False

    def abort(self) -> None:
        """`NodeClient.abort`: drop the connection (its requests in flight fail; each call returns once UCX has
        completed its requests, or by its deadline); a cancellation, not a failure: the next call reconnects at
        once (no back-off)."""
        self._link.cancel()
        if self.lookups is not None:
            self.lookups.abort()

    def close(self) -> None:
        self._link.cancel()
        if self.shm is not None:
            self.shm.close()
        if self.lookups is not None:
            self.lookups.close()

    def shm_buffer(self, nbytes: int) -> ShmBuffer | None:
        """`nbytes` of this connection's shared-memory region, which `put` / `get_into` move without a copy when
        the values lie in it; None when there is none yet (a call opens it), or no room in it."""
        return None if self.shm is None else self.shm.buffer(nbytes)

    def connect_now(self, deadline: Deadline | float) -> None:
        """Connect (and authenticate) now instead of on the first call; TransportError on failure. On the same
        host, also open the connection's shared-memory region now (the calls would open it on first use): its
        pages are then populated in the background before the first load needs them (`shm.client.first_populate_bytes`),
        and that load stages in it from the start. A region that cannot be opened only leaves the calls on UCX."""
        limit = Deadline.within(deadline)
        self._call(lambda ex, rid: None, limit)
        if self.shm is not None:
            try:
                self.shm.region(limit)
            except TransportError as error:  # the connection was dropped: the next call reconnects, as after any failure
                log.info("%s: shared-memory region not opened at connect: %s", self.address, error.message())
        elif self.lookups is not None:
            try:
                self.lookups.open_now(limit)
            except TransportError as error:  # (as above)
                log.info("%s: lookup channel not opened at connect: %s", self.address, error.message())

    @property
    def last_failure(self) -> Failure:
        """What the last failed call ran into (`Failure.NONE` after a success)."""
        return self._link.last_failure

    # ---- machinery ----

    def _call(self, request: Callable[[Exchange, int], T], limit: Deadline | float, reply: Reply = Reply.FRAMES) -> T:
        deadline = Deadline.within(limit).at
        timeout_s = max(0.0, deadline - time.monotonic())
        exchange: Exchange | None = None
        conn: Connection | None = None
        link = self._link
        cancels = link.cancels
        try:
            with futures_context():
                conn = link.current or link.connect(deadline)
                if link.cancels != cancels:  # aborted while connecting: see the module docstring
                    raise _CancelledWhileConnecting()
                with self._id_lock:
                    self._next_id = self._next_id % protocol.MAX_REQUEST_ID + 1
                    rid = self._next_id
                exchange = Exchange(conn, deadline)
                result = request(exchange, rid)
            link.last_failure = Failure.NONE
            return result
        except WaitTimeout:
            message = f"no answer within {timeout_s:.3f} s"
            if reply is Reply.ONE_MESSAGE and exchange is not None:  # sent, its reply's receive kept: see the contract
                link.last_failure = Failure.TIMEOUT
                raise TransportError(EmsErrorCode.EMS_IO_TIMEOUT, f"{self.address}: {message}") from None
            raise link.fail(conn, EmsErrorCode.EMS_IO_TIMEOUT, message, ending=Ending.CANCELLED) from None
        except BackingOff:
            raise  # (not a new failure: the back-off stays as it is)
        except _CancelledWhileConnecting:
            message = "aborted by this client while the call was connecting"
            raise link.fail(None, EmsErrorCode.EMS_IO_ERROR, message, Failure.CANCELLED, Ending.CANCELLED) from None
        except ConnectWaitTimeout:
            message = f"not connected within {timeout_s:.3f} s (another call is connecting)"
            raise link.fail(None, EmsErrorCode.EMS_IO_TIMEOUT, message, ending=Ending.CANCELLED) from None
        except ConnectTimeout:
            raise link.fail(conn, EmsErrorCode.EMS_IO_TIMEOUT, "connect timed out") from None
        except Refused as error:
            raise link.fail(conn, EmsErrorCode.EMS_IO_ERROR, str(error), Failure.REFUSED) from None
        except protocol.ProtocolError as error:
            raise link.fail(conn, EmsErrorCode.EMS_IO_ERROR, f"malformed reply: {error}") from None
        except TransportError as error:
            raise link.fail(conn, error.status_code(), error.message()) from None
        except Exception as error:  # UCX errors: connection refused, reset, peer failure
            raise link.fail(conn, EmsErrorCode.EMS_IO_ERROR, f"connection failed: {error!r}") from None
        finally:
            if exchange is not None:
                exchange.release()


class _NodeLink:
    """What its `ShmClient` and `TcpLookups` need of a node client (`transport.base.NodeLink`): its connection, inline
    requests on it through `_call`, and the record of a failed request on a channel beside it (`Connector.fail`)."""

    def __init__(self, node: UcxNode) -> None:
        self._node = node

    @property
    def address(self) -> str:
        return self._node.address

    @property
    def ip(self) -> str:
        return self._node._link.ip

    def connection(self) -> Connection | None:
        return self._node._link.current

    def request(self, op: int, count: int, meta: bytes, deadline: Deadline, on: Any = None) -> tuple[Any, bytes] | None:
        def run(ex: Exchange, rid: int) -> tuple[Any, bytes] | None:
            if on is not None and ex.conn is not on:
                return None
            reply, body = client_requests.request(ex, rid, op, count=count, meta=meta)
            return ex.conn, bytes(body[: reply.meta_len])

        return self._node._call(run, deadline)

    def fail(
        self, conn: Any, code: EmsErrorCode, message: str, failure: Failure | None = None, ending: Ending = Ending.FAILED
    ) -> TransportError:
        return self._node._link.fail(conn, code, message, failure, ending)

    def timed_out(self, message: str) -> TransportError:
        self._node._link.last_failure = Failure.TIMEOUT
        return TransportError(EmsErrorCode.EMS_IO_TIMEOUT, f"{self._node.address}: {message}")

    def close(self) -> None:
        self._node.close()

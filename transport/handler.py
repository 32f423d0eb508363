"""What the wire layer asks of the node it serves: the handler protocol between `transport/` (sessions, frames,
shared-memory regions) and `ems.pool` (the node: tenant namespaces, the store, the in-flight budget, the handlers).

Contract:
* `transport/` depends on these protocols (and shared memory's `shm.host.ShmHost`) only, never on `ems.pool`
  (tests/transport/test_layering.py): the node assembly (`ems.pool.node`) builds an `ems.pool.handlers.NodeHandlers`,
  which is a `RequestHandler` and a `ShmHost`, and hands it to `transport.ucx.server.PoolServer`; the handlers own
  the node's `transport.shm.server.ShmService`, built over themselves.
* `RequestHandler` (what `PoolServer` calls, on the event loop): `namespace(access_id)` gives the prefix every key of
  an authenticated connection is stored under; `serve(channel, prefix)` answers one request start to reply and
  returns the value bytes it moved; `answer_now` answers an EXISTS or PING whose meta is in hand, without waiting;
  `start` / `forget(conn)` / `close` bracket the node's life and each connection's end (its shared-memory region);
  `memory_report()` is one line of memory figures for the debug log.
* A handler raises `Refusal` for a request the node will not take (no room in the in-flight budget): the session
  answers BAD_REQUEST with its message, then closes the connection (or the region's channel). A malformed request
  raises `protocol.ProtocolError` (that connection only is closed).
* `RequestChannel` is where one request's frames and reply travel (`ucx.server.Channel`, `shm.server.NodeChannel`).
* `SessionLimits` and `SessionMetrics` are the parts of the node's limits and metrics the sessions apply and count
  (`ems.pool.budget.NodeLimits`, `ems.pool.metrics.NodeMetrics` have them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ems.transport import protocol


class Refusal(Exception):
    """A request the node answers with BAD_REQUEST and a message, then closes the connection."""


class RequestChannel(Protocol):
    """Where one request's frames and reply travel (`transport.ucx.server.Channel`)."""

    header: protocol.Header
    conn: Any  # the connection (its `peer` and `aborted`; the key of its shared-memory region)

    async def meta(self) -> bytes:
        """The request's meta (inline in its head, or a frame of its own)."""
        ...

    def inline_data(self) -> memoryview | None:
        """The request's data when it came inline in its head, else None."""
        ...

    async def receive_frames(self, views: Sequence[memoryview], ends: bytes) -> None:
        """Receive the request's data frames, one into each view in order, each ending with the byte of `ends` beside
        it (lengths verified exactly: protocol docstring, "end bytes"); returns once every receive has ended, raising
        the first failure."""
        ...

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
        """Send the reply."""
        ...


class RequestHandler(Protocol):
    """What `transport.ucx.server.PoolServer` calls; see the module docstring."""

    def namespace(self, access_id: str) -> bytes:
        """The prefix of every key of a connection authenticated as `access_id`."""
        ...

    async def serve(self, channel: RequestChannel, prefix: bytes) -> int:
        """Serve one request, start to reply; the value bytes it moved. `Refusal`, `protocol.ProtocolError`."""
        ...

    def answer_now(self, header: protocol.Header, meta: memoryview, prefix: bytes) -> bytes:
        """The reply meta of an EXISTS or PING whose meta is in hand, answered without waiting."""
        ...

    def start(self) -> None:
        """The node serves from now on (called on the event loop)."""
        ...

    def forget(self, conn: Any) -> None:
        """The connection `conn` ended (on every path): what the node keeps for it goes."""
        ...

    def close(self) -> None:
        """The node stops."""
        ...

    def memory_report(self) -> str:
        """The node's memory figures, one line for the debug log."""
        ...


class Count(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class Level(Count, Protocol):
    def dec(self, amount: float = 1) -> None: ...


class SessionMetrics(Protocol):
    """What the sessions count (`ems.pool.metrics.NodeMetrics` has it)."""

    @property
    def connections(self) -> Level: ...

    @property
    def connections_opened(self) -> Count: ...

    @property
    def auth_failures(self) -> Count: ...

    @property
    def unread_discarded(self) -> Count:
        """Messages discarded unread: sent on tags nobody would receive (`transport.ucx.connections`)."""
        ...

    @property
    def unread_discarded_bytes(self) -> Count: ...

    @property
    def stray_closes(self) -> Count:
        """Connections closed for sending messages on tags they had no request for."""
        ...

    def request(self, op: str, ok: bool, seconds: float, nbytes: int = 0) -> None:
        """Count one request the sessions serve themselves (a LOOKUP_OPEN), as the handlers count theirs."""
        ...


WILDCARD_HOSTS = ("0.0.0.0", "::", "*", "")  # a node listening on every interface


class SessionLimits(Protocol):
    """The limits the sessions apply (`ems.pool.budget.NodeLimits` has them)."""

    @property
    def handshake_timeout_s(self) -> float: ...

    @property
    def stall_timeout_s(self) -> float: ...

    @property
    def max_connections(self) -> int: ...

    @property
    def max_connections_per_peer(self) -> int: ...

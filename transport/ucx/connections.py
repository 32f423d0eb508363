"""The pool-node server's connections over UCX (`transport.ucx.server`): each connection's state, admission, the
tags of live and ended connections, and the watchdog.

Contract:
* `ConnectionTable.admit(ep)` admits a new connection, or refuses it (None; the server aborts it at once): at most
  `max_connections` in all and `max_connections_per_peer` per peer IP address (`SessionLimits`), and never one whose
  tags collide with a live or lately ended connection's (one in 2**32 per pair: the client reconnects). A connection
  must finish its handshake within `handshake_timeout_s`. `release(conn)` ends its counts (the server calls it on
  every path); `forget_tags(conn)` discards what it left unread, now and for UNREAD_LINGER_S.
* `watch()` (a task for the node's life) is the watchdog: every WATCHDOG_PERIOD_S it aborts connections past their
  handshake deadline or whose request in flight waited more than `stall_timeout_s` for its next frame (never
  cancelling a UCX request: the abort fails it), and, in progress mode "loop" (`worker` set), discards the messages
  nobody will receive (`transport.ucx.unexpected`; `transport.ucx.server`'s docstring, "Messages nobody will
  receive"), closing a connection that parks messages on tags it has no request for. It logs the node's memory
  figures now and then (debug).
* `sweep_front()` (the loop's progress sweeper, `ucx.progress`; at most every SWEEP_FRONT_S) does the same for the
  oldest unread messages while they arrive: while the oldest is one nobody will receive it is discarded (and its
  connection closed when it has no request for it), so a flood of them never holds more of the node's memory than
  arrives between two sweeps. A message is one nobody will receive (`_stray`) when it is on the tags of no live
  connection, on a request tag before its connection's handshake, or on the tag of a request id that is not in
  flight while no head of that connection is waiting to be read (a client sends a request's head before its other
  frames, so these can never belong to a head still to come). Counted in `metrics` (`unread_discarded`,
  `unread_discarded_bytes`, `stray_closes`).
* No lock: everything here runs on the node's one event loop. `Connection.requests` (the deadline of each request's
  next frame) is written by the request's channel (`transport.ucx.channel`) and read by the watchdog.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ems.transport import protocol
from ems.transport.handler import SessionLimits, SessionMetrics
from ems.transport.ucx import progress as ucx_progress
from ems.transport.ucx.endpoint import connecting_tags, peer_host
from ems.transport.ucx.frames import head_request_id
from ems.transport.ucx.unexpected import Discarded, discard, oldest

log = logging.getLogger("ems.pool")

WATCHDOG_PERIOD_S = 0.5
SWEEP_FRONT_S = 0.001  # the progress sweeper's period at most: a check of the oldest unread message when it runs
# inline requests of one connection served at once; the connection's next head waits for a free slot
MAX_REQUESTS_PER_CONNECTION = 32
# how long the tags of a connection that ended are still swept for messages that were on the wire when it closed
UNREAD_LINGER_S = 5.0
CONNECTION_TAG_MASK = protocol.CONNECTION_TAG_MASK
_FULL_TAG_MASK = (1 << 64) - 1


class Closed(Exception):
    """The peer closed the connection (not an error worth a warning)."""


class Stage(enum.Enum):
    """Where a connection is: before its handshake, between requests, or serving one."""

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
        "head",
        "next_key",
        "peer",
        "receiving",
        "requests",
        "slots",
        "stage",
        "tasks",
    )

    def __init__(self, ep: Any, peer: str, deadline: float, base_tag: int) -> None:
        self.ep = ep
        self.peer = peer
        self.stage = Stage.HANDSHAKE
        self.deadline = deadline  # of the handshake
        self.aborted = False
        self.requests: dict[int, float] = {}  # request key (a serial of this connection) -> deadline of its next frame
        self.tasks: set[asyncio.Task] = set()  # inline requests being served
        self.slots = asyncio.Semaphore(MAX_REQUESTS_PER_CONNECTION)
        self.base_tag = base_tag  # the tag this node receives the connection's heads on (protocol docstring, "Tags")
        self.receiving: set[int] = set()  # inline request ids in flight: from the head until the reply starts
        self.next_key = 0
        self.head: bytearray | None = None  # the buffer of the head receive posted now (read when it has arrived)

    def new_key(self) -> int:
        self.next_key += 1
        return self.next_key

    def head_arrived(self) -> int | None:
        """The request id of the inline head received and not read yet (its buffer filled: `ucx.frames`), if any."""
        return None if self.head is None else head_request_id(self.head)

    def overdue(self, now: float) -> str | None:
        if self.stage == Stage.HANDSHAKE:
            return "handshake" if now > self.deadline else None
        return "a request" if any(now > d for d in self.requests.values()) else None


class ConnectionTable:
    """The node's connections: admission, the tag registry, the watchdog; see the module docstring."""

    def __init__(self, limits: SessionLimits, memory_report: Callable[[], str], metrics: SessionMetrics | None = None) -> None:
        self.limits = limits
        self.metrics = metrics
        self._next_front_sweep = 0.0
        self._unlogged_drops = 0  # messages of no connection discarded since the watchdog last logged them
        self._refuse_at_admit: set[int] = set()  # high bits of connections being set up that sent stray messages
        self._memory_report = memory_report  # the handlers' memory figures, for the debug log
        self._connections: dict[Any, Connection] = {}
        self._by_tag: dict[int, Connection] = {}  # high bits of a live connection's base tag -> that connection
        self._ended_tags: dict[int, float] = {}  # high bits of ended connections' tags -> sweep them until then
        self.worker: Any = None  # the UCX worker, when the loop progresses it (mode "loop"): unread messages swept
        self._per_peer: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._connections)

    def admit(self, ep: Any) -> Connection | None:
        """A new connection's state, or None when it is refused (its tags collide, or a connection limit is reached)."""
        peer = peer_host(ep)
        base_tag = int(ep._tags["msg_recv"])
        high = base_tag & CONNECTION_TAG_MASK
        connecting_tags.pop(high, None)
        if high in self._refuse_at_admit:  # (`sweep_front`: its messages are discarded already)
            self._refuse_at_admit.discard(high)
            self._ended_tags.setdefault(high, time.monotonic() + UNREAD_LINGER_S)
            log.warning("refused a connection from %s: a message on a request tag before the handshake", peer)
            return None
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

    def release(self, conn: Connection) -> None:
        """The connection ended: it no longer counts against the limits."""
        if self._connections.pop(conn.ep, None) is not None:
            self._per_peer[conn.peer] -= 1
            if self._per_peer[conn.peer] <= 0:
                del self._per_peer[conn.peer]

    def abort_all(self) -> None:
        """The node stops: abort every connection."""
        for ep in list(self._connections):
            abort(ep)
        self._connections.clear()
        self._by_tag.clear()
        self._per_peer.clear()

    async def watch(self) -> None:
        """Abort connections past their deadline (never cancelling a UCX request: the abort fails it); log the
        memory figures now and then (debug)."""
        next_report = time.monotonic()
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            now = time.monotonic()
            if now >= next_report and log.isEnabledFor(logging.DEBUG):
                next_report = now + 5.0
                log.debug("memory: %s, %d connections", self._memory_report(), len(self._connections))
            for conn in list(self._connections.values()):
                stalled = conn.overdue(now)
                if stalled is not None and not conn.aborted:
                    log.warning("closing a connection from %s: stalled in %s", conn.peer, stalled)
                    conn.aborted = True
                    abort(conn.ep)
            if self.worker is not None:
                try:
                    self._sweep_unread(now)
                except Exception:  # never lose the watchdog over one sweep
                    log.exception("sweeping unread messages failed")

    def _discarded(self, done: Discarded) -> int:
        if done.messages and self.metrics is not None:
            self.metrics.unread_discarded.inc(done.messages)
            self.metrics.unread_discarded_bytes.inc(done.nbytes)
        return done.messages

    def _stray(self, conn: Connection, tag: int) -> str | None:
        """Why the unread message on `tag` of `conn` is one nobody will receive, or None (it may be received)."""
        if tag == conn.base_tag:
            return None  # a head (or a classic frame) waiting for its turn
        if conn.stage == Stage.HANDSHAKE:
            return "a message on a request tag before the handshake"
        request_id = tag ^ conn.base_tag
        if request_id in conn.receiving or request_id == conn.head_arrived():
            return None
        if oldest(self.worker, conn.base_tag, _FULL_TAG_MASK) is not None:
            return None  # a head waits (the connection's request slots are taken): these may be its frames
        return f"messages for request {request_id}, which is not in flight"

    def _close_stray(self, conn: Connection, reason: str) -> None:
        """Close `conn` for messages nobody will receive, and discard every unread message of its tags now."""
        log.warning("closing a connection from %s: %s", conn.peer, reason)
        conn.aborted = True
        abort(conn.ep)
        if self.metrics is not None:
            self.metrics.stray_closes.inc()
        high = conn.base_tag & CONNECTION_TAG_MASK
        self._ended_tags.setdefault(high, time.monotonic() + UNREAD_LINGER_S)
        self._discarded(discard(self.worker, high, CONNECTION_TAG_MASK))

    def sweep_front(self) -> None:
        """Discard the oldest unread messages while nobody will receive them (module docstring); at most every
        SWEEP_FRONT_S, and one probe when nothing waits unread."""
        now = time.monotonic()
        if now < self._next_front_sweep:
            return
        self._next_front_sweep = now + SWEEP_FRONT_S
        worker = self.worker
        dropped = 0
        try:
            while True:
                front = oldest(worker, 0, 0)
                if front is None:
                    break
                high = front[0] & CONNECTION_TAG_MASK
                owner = self._by_tag.get(high)
                connecting = connecting_tags.get(high) if owner is None else None
                if connecting is not None and front[0] == connecting.base_tag and high not in self._refuse_at_admit:
                    break  # a connection being set up: its head waits for it
                if connecting is not None:  # a request tag before the handshake: refused when it is admitted
                    if high not in self._refuse_at_admit:
                        self._refuse_at_admit.add(high)
                        if self.metrics is not None:
                            self.metrics.stray_closes.inc()
                    if self._discarded(discard(worker, high, CONNECTION_TAG_MASK)) == 0:
                        break  # (UCX took it meanwhile)
                    continue
                if owner is None or owner.aborted:
                    gone = self._discarded(discard(worker, high, CONNECTION_TAG_MASK))
                    if gone == 0:
                        break  # (UCX took it meanwhile)
                    dropped += gone
                    continue
                reason = self._stray(owner, front[0])
                if reason is None:
                    break
                self._close_stray(owner, reason)
        except Exception:  # never lose the loop's progress over one sweep
            log.exception("sweeping unread messages failed")
        self._unlogged_drops += dropped

    def _sweep_unread(self, now: float) -> None:
        """Discard the messages nobody will receive; close connections that park them (module docstring)."""
        worker = self.worker
        for high, until in list(self._ended_tags.items()):
            self._discarded(discard(worker, high, CONNECTION_TAG_MASK))
            if now > until:
                del self._ended_tags[high]
        loop_now = asyncio.get_running_loop().time()
        for high, connecting in list(connecting_tags.items()):  # set up long ago and never admitted: ended
            if loop_now > connecting.until:
                del connecting_tags[high]
                self._refuse_at_admit.discard(high)
                self._ended_tags.setdefault(high, now + UNREAD_LINGER_S)
        self._next_front_sweep = 0.0
        self.sweep_front()  # the oldest messages, then each connection's own below
        if self._unlogged_drops:  # once per watchdog period: a flood discarded as it arrives is one line
            log.info("discarded %d messages sent on the tags of no connection", self._unlogged_drops)
            self._unlogged_drops = 0
        for conn in list(self._connections.values()):
            if conn.aborted:
                continue
            first = oldest(worker, conn.base_tag, CONNECTION_TAG_MASK)
            reason = None if first is None else self._stray(conn, first[0])
            if reason is not None:
                self._close_stray(conn, reason)

    def forget_tags(self, conn: Connection) -> None:
        """The connection ended: discard what it left unread, now and for UNREAD_LINGER_S."""
        high = conn.base_tag & CONNECTION_TAG_MASK
        if self._by_tag.get(high) is conn:
            del self._by_tag[high]
            self._ended_tags[high] = time.monotonic() + UNREAD_LINGER_S
            if self.worker is not None:
                self._discarded(discard(self.worker, high, CONNECTION_TAG_MASK))


def abort(ep: Any) -> None:
    try:
        ep.abort(period=10**8)
    except Exception:  # already closed by the peer or by us
        pass
    ucx_progress.kick()  # the aborted requests' failures reach their tasks now

"""The client's end of a node connection's lookup channel (`transport.tcp.wire` has the protocol and the security
model).

Contract:
* `TcpLookups(link)` serves the lookups of one node client (handed what it needs of it: `transport.base.NodeLink`).
  `exists(meta, count, flags, deadline)` asks over the channel of the link's current connection and returns the
  flags of the keys held, or None when there is no channel to take now (none open yet, every slot taken, or the
  channel belongs to an earlier connection): the caller asks over its connection. A lookup never waits for a
  channel to open: the first one on a connection starts the opening on a thread of its own (LOOKUP_OPEN, the TCP
  connect, the token) and goes over the connection; `open_now(deadline)` opens it on the calling thread (a node
  client's `connect_now`).
* A timeout between frames raises the link's timeout (the channel serves on; its late reply is dropped); a timeout
  mid-frame raises it too and drops the channel. A channel that fails otherwise (the node closed it, a socket
  error, an error status, a malformed reply) is dropped, logged, and the lookup answers None (the caller asks over
  its connection, within the same deadline). After a failed opening or a dropped channel the next opening waits
  RETRY_FIRST_S, doubling up to RETRY_MAX_S; a node that offers no channel is asked again after RETRY_MAX_S.
* `abort()` (the node client's, which drops its connection) fails the lookups in flight on the channel at once, as
  cancelled (no back-off), and closes it; `close()` closes it for good (the node client is closing).
* Thread-safe: callers in flight share the channel (`transport.stream.ClientChannel`, CHANNEL_IN_FLIGHT slots).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from ems.errors import EmsErrorCode
from ems.records import Deadline
from ems.transport import protocol
from ems.transport.base import Ending, Failure, NodeLink, TransportError
from ems.transport.stream import ChannelClosed, ChannelRefused, ChannelTimeout, ClientChannel
from ems.transport.tcp import wire

log = logging.getLogger("ems.transport")

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0
OPEN_TIMEOUT_S = 5.0  # an opening on its own thread gives up after this long


class TcpLookups:
    """The lookup channel of one node client; see the module docstring."""

    def __init__(self, link: NodeLink) -> None:
        self.link = link
        self._lock = threading.Lock()  # guards everything below
        self._channel: ClientChannel | None = None
        self._conn: Any = None  # the connection the channel belongs to
        self._opening = False
        self._retry_at = 0.0
        self._retry_s = RETRY_FIRST_S
        self._closed = False
        self._aborts = 0  # `abort()` calls so far: a lookup in flight across one fails as cancelled

    @property
    def channel(self) -> ClientChannel | None:
        """The open channel of the link's current connection, if any."""
        channel = self._channel
        if channel is None or channel.spent or self._conn is not self.link.connection():
            return None
        return channel

    def exists(self, meta: bytes, count: int, flags: int, deadline: Deadline) -> list[bool] | None:
        channel = self.channel
        if channel is None:
            self._open_in_background()
            return None
        if not channel.slots.acquire(blocking=False):
            return None
        aborts = self._aborts
        try:
            reply = channel.request(protocol.Op.EXISTS, count, meta, deadline.at, None, flags, keep_on_timeout=True)
        except ChannelTimeout as timeout:
            if timeout.mid_frame:
                self._drop(channel, "a lookup timed out mid-frame")
            raise self.link.timed_out("no answer within the call's deadline") from None
        except (ChannelClosed, ChannelRefused, OSError, protocol.ProtocolError) as lost:
            if self._aborts != aborts:  # (the caller stopped waiting: this lookup fails, as one over UCX would)
                message = "aborted by this client"
                raise self.link.fail(None, EmsErrorCode.EMS_IO_ERROR, message, Failure.CANCELLED, Ending.CANCELLED) from None
            self._drop(channel, f"lost: {lost!r}")
            return None
        finally:
            channel.slots.release()
        try:
            return protocol.decode_flags(count, reply)
        except protocol.ProtocolError as malformed:
            self._drop(channel, f"a malformed reply: {malformed}")
            return None

    def open_now(self, deadline: Deadline) -> bool:
        """Open the current connection's channel on this thread unless one is open or opening; whether one is open.
        A TransportError of the LOOKUP_OPEN request (the connection failed) is raised."""
        if self.channel is not None:
            return True
        with self._lock:
            if self._opening or self._closed:
                return False
            self._opening = True
        try:
            return self._open(deadline)
        finally:
            with self._lock:
                self._opening = False

    def abort(self) -> None:
        """The node client's `abort()`: the lookups in flight fail now (as cancelled, no back-off) and the channel
        closes (it belonged to the connection the node client drops); the next lookup opens another."""
        with self._lock:
            self._aborts += 1
            channel, self._channel, self._conn = self._channel, None, None
        if channel is not None:
            channel.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channel, self._channel, self._conn = self._channel, None, None
        if channel is not None:
            channel.close()

    # ---- machinery ----

    def _open_in_background(self) -> None:
        with self._lock:
            if self._opening or self._closed or time.monotonic() < self._retry_at:
                return
            if self.link.connection() is None:
                return  # (not connected: the call connects over its medium first)
            self._opening = True
        threading.Thread(target=self._open_off_thread, name="ems-lookup-open", daemon=True).start()

    def _open_off_thread(self) -> None:
        try:
            self._open(Deadline.within(OPEN_TIMEOUT_S))
        except TransportError as error:  # (the connection failed: its calls see it)
            log.info("%s: no lookup channel: %s", self.link.address, error.message())
        except Exception:
            log.exception("%s: opening the lookup channel failed", self.link.address)
        finally:
            with self._lock:
                self._opening = False

    def _open(self, deadline: Deadline) -> bool:
        """LOOKUP_OPEN on the current connection, the TCP connect, the token; the channel kept on success."""
        conn = self.link.connection()
        if conn is None:
            return False
        sent = self.link.request(protocol.Op.LOOKUP_OPEN, 0, b"", deadline, on=conn)
        if sent is None:
            return False  # (the connection changed meanwhile)
        try:
            token, port = wire.decode_open_reply(sent[1])
        except protocol.ProtocolError as malformed:
            raise self.link.fail(conn, EmsErrorCode.EMS_IO_ERROR, f"malformed reply: {malformed}") from None
        if port == 0:
            self._retry_later(RETRY_MAX_S, "the node offers no lookup channel")
            return False
        sock: socket.socket | None = None
        try:
            sock = socket.create_connection((self.link.ip, port), timeout=max(0.001, deadline.left()))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(0.001, deadline.left()))
            sock.sendall(token)
            if sock.recv(1) != wire.ACCEPTED:
                raise ConnectionError("the node closed the socket instead of accepting the token")
            channel = ClientChannel(sock, wire.CHANNEL_IN_FLIGHT)
        except OSError as error:
            if sock is not None:
                sock.close()
            self._back_off(f"{error!r}")
            return False
        with self._lock:
            if self._closed or self.link.connection() is not conn:
                channel.close()
                return False
            earlier, self._channel, self._conn = self._channel, channel, conn
            self._retry_s = RETRY_FIRST_S
        if earlier is not None:
            earlier.close()
        return True

    def _retry_later(self, after_s: float, why: str) -> None:
        log.info("%s: no lookup channel (%s); asking again in %.0f s", self.link.address, why, after_s)
        with self._lock:
            self._retry_at = time.monotonic() + after_s

    def _back_off(self, why: str) -> None:
        """The next opening waits the current back-off, which doubles (up to RETRY_MAX_S) for the one after."""
        with self._lock:
            after_s = self._retry_s
            self._retry_s = min(2 * after_s, RETRY_MAX_S)
        self._retry_later(after_s, why)

    def _drop(self, channel: ClientChannel, why: str) -> None:
        log.info("%s: lookup channel dropped: %s", self.link.address, why)
        with self._lock:
            if self._channel is channel:
                self._channel, self._conn = None, None
        self._back_off(why)
        channel.close()

"""One UCX node client's connection (`ucx.client.UcxNode`): made when a call needs one, authenticated, and after a
failure dropped and backed off.

Contract:
* `resolve(address)`: "host:port" to (IPv4 address, port); `TransportError(EMS_IO_ERROR)` when it cannot be.
* `connect(runtime, ip, port, deadline)` returns a `ucx.direct.Connection` (error handling on) once ucxx's peer-info
  exchange is done, or raises (`WaitTimeout` past `deadline`); a connect that fails or times out closes its endpoint
  and keeps the exchange's buffers until UCX has finished with them.
* `Connector.connect(deadline)` is what a call runs when it finds no `current` connection: one caller connects (the
  endpoint, then the handshake, `client_requests.handshake`) within `connect_timeout_s`, the others wait for it
  (`ConnectWaitTimeout` past their deadline); the connection made becomes `current` and serves every later call.
  Within `RECONNECT_BACKOFF_S` after a failure the wire reported, it raises the last error instead (`BackingOff`),
  so a dead node is not hammered. `ConnectTimeout` and `client_requests.Refused` report a connect that failed.
* `fail(conn, code, message, failure, ending)` records a call's failure: `conn` dropped (a late reply must never
  answer a later request) and, for a failure the wire reported (`Ending.FAILED`), the back-off started; a call that
  failed on a connection this client had cancelled failed because of that cancellation (no back-off). It sets
  `last_failure` and returns the error to raise. `cancel()` (`abort`, `close`) drops the current connection as a
  cancellation and counts it in `cancels`, so a call that sees the count change while connecting is cancelled.
* Locks: `_connect_lock`, one connect at a time; `_lock` guards `current` and `cancels`.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

from ems.errors import EmsErrorCode
from ems.transport.base import Ending, Failure, TransportError
from ems.transport.ucx import client_requests
from ems.transport.ucx.client_worker import ucxx_names
from ems.transport.ucx.direct import ABORT_PERIOD_NS, Connection, DirectRuntime, Exchange, Posted, WaitTimeout

RECONNECT_BACKOFF_S = 0.5
_PEER_INFO = struct.Struct("QQ")


def resolve(address: str) -> tuple[str, int]:
    """ "host:port" → (IPv4 address, port); TransportError(EMS_IO_ERROR) when it cannot be resolved."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise TransportError(EmsErrorCode.EMS_IO_ERROR, f"{address}: not a host:port address")
    try:
        return socket.gethostbyname(host.strip("[]")), int(port)
    except OSError as error:
        raise TransportError(EmsErrorCode.EMS_IO_ERROR, f"{address}: cannot resolve {host!r}: {error}") from None


class ConnectTimeout(Exception):
    """The connection was not made in time."""


class ConnectWaitTimeout(Exception):
    """The caller's deadline passed while another call was connecting (that call reports how its connect went)."""


class BackingOff(TransportError):
    """A call that would reconnect within the back-off: the last failure's error, raised as it is."""


def connect(runtime: DirectRuntime, ip: str, port: int, deadline: float) -> Connection:
    """An endpoint to `ip:port` after ucxx's peer-info exchange (the client side: receive the listener's tag, then
    send ours); WaitTimeout at `deadline`, ConnectionError on a bad exchange."""
    names = ucxx_names()
    endpoint = names["api"].UCXEndpoint.create(runtime.worker, ip, port, True)
    msg_tag = names["hash"]("msg_tag", os.urandom(16), endpoint.handle)
    mine = bytearray(_PEER_INFO.pack(msg_tag, names["hash"](msg_tag)))
    peer = bytearray(_PEER_INFO.size)
    posted: list[Posted] = []
    try:
        peer_array = names["Array"](peer)
        posted.append(Posted(endpoint.stream_recv(peer_array), peer_array, peer))
        runtime.wait(posted[-1:], deadline)
        mine_array = names["Array"](mine)
        posted.append(Posted(endpoint.stream_send(mine_array), mine_array, mine))
        runtime.wait(posted[-1:], deadline)
    except BaseException:
        try:
            endpoint.close_blocking(period=ABORT_PERIOD_NS, max_attempts=1)
        except Exception:  # already failed: nothing more to release
            pass
        runtime.bury(posted)
        raise
    peer_tag, checksum = _PEER_INFO.unpack(peer)
    if names["hash"](peer_tag) != checksum:
        endpoint.close_blocking(period=ABORT_PERIOD_NS, max_attempts=1)
        raise ConnectionError("UCX peer-info checksum mismatch")
    return Connection(runtime, endpoint, peer_tag, msg_tag)


class Connector:
    """One node client's connection; see the module docstring."""

    def __init__(
        self, address: str, access_id: str, access_key: str | None, connect_timeout_s: float, runtime: DirectRuntime
    ) -> None:
        self.address = address
        self.ip, self.port = resolve(address)
        self.runtime = runtime
        self.current: Connection | None = None
        self.cancels = 0  # how many times `cancel` ran: a call that saw it change while connecting is cancelled
        self.last_failure = Failure.NONE
        self._access_id = access_id
        self._access_key = access_key
        self._connect_timeout_s = connect_timeout_s
        self._connect_lock = threading.Lock()  # one connect at a time; the others wait for it
        self._lock = threading.Lock()  # `current` and `cancels`
        self._retry_at = 0.0
        self._last_error: TransportError | None = None

    def connect(self, deadline: float) -> Connection:
        """The live connection, made now (once, by whichever caller gets there first) when there is none; within
        the back-off after a failure, the last error instead of a connect."""
        conn = self.current
        if conn is not None:
            return conn
        self._check_backoff()
        if not self._connect_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise ConnectWaitTimeout()
        try:
            conn = self.current
            if conn is not None:
                return conn
            self._check_backoff()  # the connect this caller waited for failed
            conn = self._open(min(deadline, time.monotonic() + self._connect_timeout_s))
            with self._lock:
                self.current = conn
            self.runtime.live.add(conn)
            return conn
        finally:
            self._connect_lock.release()

    def fail(
        self,
        conn: Connection | None,
        code: EmsErrorCode,
        message: str,
        failure: Failure | None = None,
        ending: Ending = Ending.FAILED,
    ) -> TransportError:
        """Record a call's failure; the error to raise (see the module docstring)."""
        if conn is not None and conn.ending is Ending.CANCELLED and ending is Ending.FAILED:
            ending = Ending.CANCELLED
            message = f"{message} (its connection was aborted by this client)"
            failure = failure or Failure.CANCELLED
        error = TransportError(code, message if message.startswith(self.address) else f"{self.address}: {message}")
        if conn is not None:
            self.drop(conn, ending)
        if ending is Ending.FAILED:
            self._retry_at = time.monotonic() + RECONNECT_BACKOFF_S
            self._last_error = error
        if failure is None:
            failure = Failure.TIMEOUT if code == EmsErrorCode.EMS_IO_TIMEOUT else Failure.UNREACHABLE
        self.last_failure = failure
        return error

    def cancel(self) -> None:
        """`abort` / `close`: the calls in flight fail, a cancellation (the module docstring)."""
        with self._lock:
            self.cancels += 1
        self.drop(None, Ending.CANCELLED)

    def drop(self, conn: Connection | None, ending: Ending) -> None:
        """Drop the current connection when it is `conn` (None: whatever it is); a newer one is left alone. A `conn`
        that failed before it became current is aborted all the same. `ending`: why (`Connection.ending`)."""
        with self._lock:
            if conn is None or conn is self.current:
                conn, self.current = self.current, None
        if conn is not None:
            self.runtime.live.discard(conn)
            conn.abort(ending)

    def _check_backoff(self) -> None:
        now = time.monotonic()
        if now < self._retry_at and self._last_error is not None:
            raise BackingOff(
                self._last_error.status_code(),
                f"{self._last_error.message()} (next reconnect attempt in {self._retry_at - now:.2f} s)",
            )

    def _open(self, deadline: float) -> Connection:
        try:
            conn = connect(self.runtime, self.ip, self.port, deadline)
        except WaitTimeout:
            raise ConnectTimeout() from None
        ex = Exchange(conn, deadline)
        try:
            client_requests.handshake(ex, self.address, self._access_id, self._access_key)
            return conn
        except client_requests.Refused as error:
            conn.abort(Ending.FAILED)
            message = str(error)
            raise client_requests.Refused(message if message.startswith(self.address) else f"{self.address}: {message}") from None
        except WaitTimeout:
            conn.abort(Ending.FAILED)
            raise ConnectTimeout() from None
        except BaseException:
            conn.abort(Ending.FAILED)
            raise
        finally:
            ex.release()

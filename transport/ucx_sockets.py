"""Reaping TCP connections that UCX abandoned on a pool node's listening port (Linux `/proc`).

Contract: `SocketReaper(port).sweep()`, called every few seconds, finds this process's sockets whose local port is
`port` and that sit in CLOSE_WAIT (the peer has closed) in two sweeps in a row. It shuts such a socket down
(`shutdown(SHUT_RDWR)` on a duplicate descriptor: the peer sees the connection end, UCX's event handler sees a
hang-up); a socket UCX still holds at the next sweep is closed. Returns how many it
closed. Off Linux (no `/proc/net/tcp`) it does nothing.

Why: UCX 1.21's sockaddr connection manager reads the first ~2 KB a client sends on the listening port and, when
that is not a UCX connection request, stops watching the socket without closing it: a raw TCP connection that sent
~3 KB of junk stayed in CLOSE_WAIT forever, holding a descriptor, until the node ran out of them (measured: not even
a hang-up makes UCX look at it again). UCX's own connection sockets never stay in CLOSE_WAIT for long (endpoint
error handling reports the closed peer), so a socket found so by two sweeps seconds apart is one UCX has dropped.
(Unread bytes are no such sign: after a burst of junk connections UCX accepts real ones slowly, for seconds.)

Caveat: UCX still records the descriptor number in its abandoned connection object and closes that number when the
listener is destroyed (at node shutdown), by then perhaps reused. A node closes its listener only to exit, after
every connection has been aborted, so that late close can only hit a descriptor that is being torn down anyway.
"""

from __future__ import annotations

import os
import socket
from typing import Optional

_CLOSE_WAIT = "08"
_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def _abandoned_inodes(port: int) -> set[str]:
    """Socket inodes (any process) on local port `port` in CLOSE_WAIT."""
    inodes: set[str] = set()
    suffix = f":{port:04X}"
    for table in _TCP_TABLES:
        try:
            with open(table, encoding="ascii") as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) <= 9 or not fields[1].endswith(suffix):
                        continue
                    if fields[3] == _CLOSE_WAIT:
                        inodes.add(fields[9])
        except OSError:
            continue
    return inodes


def _own_socket_fds() -> dict[str, int]:
    """{socket inode: descriptor} of this process."""
    out: dict[str, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[target[8:-1]] = int(name)
    return out


class SocketReaper:
    """See the module docstring."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._suspects: set[str] = set()
        self._shut: dict[str, int] = {}  # inode -> descriptor, shut down at the previous sweep
        self.reaped = 0

    def sweep(self) -> int:
        fds = _own_socket_fds()
        closed = 0
        for inode, fd in self._shut.items():
            # UCX did not release it: the descriptor still names that socket (checked just before, so a number UCX
            # released and something else reused is never closed)
            if fds.get(inode) == fd and _names(fd, inode):
                try:
                    os.close(fd)
                    closed += 1
                except OSError:
                    pass
        self._shut = {}
        found = _abandoned_inodes(self.port)
        stale, self._suspects = found & self._suspects, found - self._suspects
        for inode in stale:
            fd = fds.get(inode)
            if fd is not None and _shutdown(fd):
                self._shut[inode] = fd
        self.reaped += closed
        return closed


def _names(fd: int, inode: str) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == f"socket:[{inode}]"
    except OSError:
        return False


def _shutdown(fd: int) -> bool:
    dup: Optional[int] = None
    try:
        dup = os.dup(fd)
        sock = socket.socket(fileno=dup)
        dup = None  # owned by `sock` now
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()  # closes only the duplicate
        return True
    except OSError:
        return False
    finally:
        if dup is not None:
            os.close(dup)

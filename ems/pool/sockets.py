"""Reaping TCP connections that UCX abandoned on a pool node's listening port (Linux `/proc`).

Contract: `SocketReaper(port).sweep()` finds this process's sockets whose local port is `port` and that sit in
CLOSE_WAIT (the peer has closed) or ESTABLISHED with unread bytes queued, in two sweeps in a row, and shuts them
down (`shutdown(SHUT_RDWR)` on a duplicate of the descriptor). It never closes a descriptor
it does not own: UCX still holds the descriptor, sees the hang-up and releases it itself. Returns how many it shut
down. Off Linux (no `/proc/net/tcp`) it does nothing.

Why: UCX 1.21's sockaddr connection manager reads the first ~2 KB a client sends on the listening port and, when
that is not a UCX connection request, stops reading the socket without closing it: a raw TCP connection that sent
~3 KB of junk stayed in CLOSE_WAIT forever, holding a descriptor, until the node ran out of them. UCX's own
connection sockets never stay in CLOSE_WAIT for long (endpoint error handling reports the closed peer) nor keep
unread bytes, so a socket found so by two sweeps seconds apart is one UCX has dropped.
"""

from __future__ import annotations

import os
import socket
from typing import Optional

_CLOSE_WAIT = "08"
_ESTABLISHED = "01"
_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def _abandoned_inodes(port: int) -> set[str]:
    """Socket inodes (any process) on local port `port` in CLOSE_WAIT, or ESTABLISHED with unread bytes."""
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
                    unread = int(fields[4].partition(":")[2] or "0", 16)
                    if fields[3] == _CLOSE_WAIT or (fields[3] == _ESTABLISHED and unread > 0):
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
        self.reaped = 0

    def sweep(self) -> int:
        found = _abandoned_inodes(self.port)
        stale, self._suspects = found & self._suspects, found - self._suspects
        if not stale:
            return 0
        fds = _own_socket_fds()
        count = 0
        for inode in stale:
            fd = fds.get(inode)
            if fd is not None and _shutdown(fd):
                count += 1
        self.reaped += count
        return count


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

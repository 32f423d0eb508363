"""Releasing TCP connections that UCX abandoned on a pool node's listening port (Linux).

Contract: `SocketReaper(port).sweep()`, called every few seconds, finds this process's TCP sockets whose local port
is `port` and that sit in CLOSE_WAIT (the peer has closed) on two sweeps in a row, and releases each: UCX's event
handler for its descriptor is removed first (`ucs_async_remove_handler`), then the descriptor is closed. Returns
how many it released. A sweep opens no descriptor of its own (each socket is inspected through the descriptor the
process already holds), so it works, and frees descriptors, when the process has none left. Off Linux, or without
UCX loaded, it does nothing.

Why: UCX's sockaddr connection manager reads the first ~2 KB a client sends on the listening port and, when that is
not a UCX connection request, stops reading the socket without closing it: a raw TCP connection that sent ~3 KB of
junk stayed in CLOSE_WAIT forever, holding a descriptor, until the node ran out of them (a hang-up does not make UCX
look at it again). UCX's own connection sockets never stay in CLOSE_WAIT for long (endpoint error handling reports
the closed peer), so a socket found so by two sweeps seconds apart is one UCX has dropped.
* No spare descriptor needed: at the descriptor limit, the earlier reaper (listing /proc, reading /proc/net/tcp,
  `dup` to shut a socket down) could open nothing, found nothing, and the node stayed locked out for good.
* The event handler goes first: UCX keeps its handler registered under the descriptor's number. Closing the number
  under it let the next accepted connection reuse the number, UCX then refused to register a second handler for it
  and dropped that connection, so a real client failed right after a burst of junk connections.

Caveat: UCX's abandoned connection object still records the number and closes it when the node's UCX context is
destroyed (at exit), by then perhaps reused; at exit every connection is being torn down anyway.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import socket
import stat
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("ems.pool")

_TCP_CLOSE_WAIT = 8  # tcpi_state (include/net/tcp_states.h)
_TCP_INFO = getattr(socket, "TCP_INFO", 11)
_remove_handler: list[Any] = []  # ucs_async_remove_handler, once looked up


def _ucs_remove_handler() -> Any | None:
    """`ucs_async_remove_handler(int id, int sync)` of the libucs this process loaded, or None."""
    if not _remove_handler:
        function = None
        try:
            with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
                path = next((line.split(None, 5)[-1].strip() for line in maps if "/libucs.so" in line), None)
            if path is not None:
                function = ctypes.CDLL(path).ucs_async_remove_handler
                function.argtypes = [ctypes.c_int, ctypes.c_int]
                function.restype = ctypes.c_int
        except OSError:  # no descriptor to read the maps with: look again at the next sweep
            return None
        _remove_handler.append(function)
    return _remove_handler[0]


def _descriptors() -> Iterator[int]:
    """This process's descriptors: from /proc when it can be listed, else every number below the limit."""
    try:
        names = os.listdir("/proc/self/fd")
        yield from (int(n) for n in names)
    except OSError:  # typically EMFILE: no descriptor left to list the directory with
        yield from range(resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def _socket_inode(fd: int) -> int | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_ino if stat.S_ISSOCK(st.st_mode) else None


def _close_wait_on(fd: int, port: int) -> bool:
    """Whether descriptor `fd` is a TCP socket on local port `port` in CLOSE_WAIT (no new descriptor is opened)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return False
        if sock.getsockname()[1] != port:
            return False
        return sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 8)[0] == _TCP_CLOSE_WAIT
    except OSError:
        return False
    finally:
        sock.detach()  # the descriptor stays open: it is UCX's


def abandoned_sockets(port: int) -> dict[int, int]:
    """{descriptor: socket inode} of this process's TCP sockets on local port `port` in CLOSE_WAIT."""
    found: dict[int, int] = {}
    for fd in _descriptors():
        inode = _socket_inode(fd)
        if inode is not None and _close_wait_on(fd, port):
            found[fd] = inode
    return found


class SocketReaper:
    """See the module docstring."""

    def __init__(self, port: int) -> None:
        self.port = port
        _ucs_remove_handler()  # looked up now, while a descriptor to read /proc/self/maps with is still free
        self._suspects: dict[int, int] = {}  # descriptor -> inode, in CLOSE_WAIT at the previous sweep
        self.reaped = 0

    def sweep(self) -> int:
        found = abandoned_sockets(self.port)
        log.debug("reaper: %d sockets in CLOSE_WAIT on port %d", len(found), self.port)
        stale = {fd: inode for fd, inode in found.items() if self._suspects.get(fd) == inode}
        self._suspects = {fd: inode for fd, inode in found.items() if fd not in stale}
        released = sum(1 for fd, inode in stale.items() if _release(fd, inode))
        self.reaped += released
        return released


def _release(fd: int, inode: int) -> bool:
    """Remove UCX's event handler for `fd`, then close it (only while it still names socket `inode`)."""
    remove = _ucs_remove_handler()
    if remove is None or _socket_inode(fd) != inode:
        return False
    status = remove(fd, 1)  # 0: removed; -12 (no element): UCX had no handler for it
    if status not in (0, -12):
        log.info("UCX did not release descriptor %d (status %d): left open", fd, status)
        return False
    try:
        os.close(fd)
    except OSError:
        return False
    return True

"""`BoundListener`: a UCX listener bound to one address, for `python -m ems.pool --listen HOST:PORT`.

Contract: `BoundListener(host, port, serve)` (on the UCX event loop, after `init_ucx`) listens on exactly
`host:port` (an IPv4 or IPv6 address; port 0 picks one, then `.port` says which) and calls the coroutine
`serve(endpoint)` with a connected ucxx `Endpoint` for each client, like `ucxx.create_listener`. `close()` stops
listening. Raises `OSError` with UCX's reason when it cannot listen there.

Why: ucxx 0.52 (`ucxx.create_listener`, its C++ `Listener`) only takes a port and binds the wildcard address, so a
node asked to listen on 127.0.0.1 was reachable on every interface. Here the UCP listener is created through
`ucp_listener_create` with the requested address (ctypes, the libucp ucxx already loaded). Turning a connection
request into a ucxx endpoint still needs a ucxx listener object (`create_endpoint_from_conn_request` takes one), so
one is created on a free port as that factory and its listening socket is released at once (see
`_retire_listening_socket`): it never accepts a connection. The rest follows ucxx's own listener handler
(peer-info exchange, here the timeout-safe one of `ucx.endpoint`, then the `Endpoint`).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from ems.transport.ucx.ucxx_internals import loaded_library

log = logging.getLogger("ems.transport")

_FIELD_SOCK_ADDR = 1 << 0
_FIELD_CONN_HANDLER = 1 << 2
_ATTR_FIELD_SOCKADDR = 1 << 0
_LISTEN = "0A"
_CONN_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)


class _SockAddr(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_void_p), ("addrlen", ctypes.c_uint32)]


class _Handler(ctypes.Structure):
    _fields_ = [("cb", ctypes.c_void_p), ("arg", ctypes.c_void_p)]


class _ListenerParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("sockaddr", _SockAddr),
        ("accept_handler", _Handler),
        ("conn_handler", _Handler),
    ]


def _sockaddr(host: str, port: int) -> bytes:
    try:
        packed = socket.inet_pton(socket.AF_INET, host)
        return struct.pack("<H", socket.AF_INET) + struct.pack(">H", port) + packed + bytes(8)
    except OSError:
        packed = socket.inet_pton(socket.AF_INET6, host)  # OSError when it is neither
        return struct.pack("<H", socket.AF_INET6) + struct.pack(">HI", port, 0) + packed + struct.pack("<I", 0)


def _retire_listening_socket(port: int) -> bool:
    """Close this process's listening TCP socket on `port` (the factory's) under UCX: its descriptor number is made
    to point at /dev/null (`dup2`), so the socket itself is released (the port is no longer open) while the number
    UCX holds stays valid and its own later close of it harmless. The socket leaves UCX's epoll set with it, so UCX
    never hears of it again (shutting it down instead made UCX spin on failing accept() calls)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if fields[1].endswith(f":{port:04X}") and fields[3] == _LISTEN:
                        inodes.add(fields[9])
        except OSError:
            continue
    done = False
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            placeholder = os.open(os.devnull, os.O_RDONLY)
            try:
                os.dup2(placeholder, int(name))
                done = True
            finally:
                os.close(placeholder)
    return done


def _drop(endpoint: Any, *args: Any) -> None:
    """The factory's own listener callback: it never listens, but should anything arrive, hang up."""
    try:
        endpoint.close_blocking(period=10**8, max_attempts=1)
    except Exception:  # already gone
        pass


class BoundListener:
    """See the module docstring."""

    def __init__(self, host: str, port: int, serve: Callable[[Any], Awaitable[None]], connect_timeout_s: float = 5.0) -> None:
        import ucxx._lib.libucxx as ucx_api
        from ucxx.core import _get_ctx

        self._ctx = _get_ctx()
        self._ctx.continuous_ucx_progress()
        self._loop = asyncio.get_running_loop()
        self._serve = serve
        self._connect_timeout_s = connect_timeout_s
        self._tasks: set = set()
        self._handle: Any = None
        self._ucp = loaded_library("libucp")
        status_string = loaded_library("libucs").ucs_status_string
        status_string.argtypes = [ctypes.c_int]
        status_string.restype = ctypes.c_char_p
        self._ucp.ucp_listener_create.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._ucp.ucp_listener_create.restype = ctypes.c_int
        self._ucp.ucp_listener_query.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._ucp.ucp_listener_query.restype = ctypes.c_int
        self._ucp.ucp_listener_destroy.argtypes = [ctypes.c_void_p]
        self._ucp.ucp_listener_reject.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._factory = ucx_api.UCXListener.create(
            worker=self._ctx.worker, port=0, cb_func=_drop, cb_args=(), deliver_endpoint=True
        )
        if not _retire_listening_socket(int(self._factory.port)):
            raise OSError("could not close the factory listener's socket")
        self._callback = _CONN_CALLBACK(self._on_conn_request)  # kept alive as long as the listener
        address = ctypes.create_string_buffer(_sockaddr(host, port))
        params = _ListenerParams()
        params.field_mask = _FIELD_SOCK_ADDR | _FIELD_CONN_HANDLER
        params.sockaddr.addr = ctypes.cast(address, ctypes.c_void_p)
        params.sockaddr.addrlen = len(address.raw) - 1
        params.conn_handler.cb = ctypes.cast(self._callback, ctypes.c_void_p)
        handle = ctypes.c_void_p()
        status = self._ucp.ucp_listener_create(
            ctypes.c_void_p(self._ctx.worker.handle), ctypes.byref(params), ctypes.byref(handle)
        )
        if status != 0:
            reason = status_string(status).decode()
            raise OSError(f"UCX cannot listen on {host}:{port}: {reason}")
        self._handle = handle
        attr = ctypes.create_string_buffer(8 + 128)
        ctypes.c_uint64.from_buffer(attr).value = _ATTR_FIELD_SOCKADDR
        if self._ucp.ucp_listener_query(self._handle, attr) != 0:
            self.close()
            raise OSError("UCX cannot say which port it listens on")
        self.port = struct.unpack(">H", attr.raw[8 + 2 : 8 + 4])[0]

    # ---- connection requests: on UCX's progress thread, then on the event loop ----

    def _on_conn_request(self, conn_request: int, arg: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._accept, conn_request)
        except RuntimeError:  # the loop is closed: the node is exiting
            pass

    def _accept(self, conn_request: int) -> None:
        if self._handle is None:
            return
        try:
            endpoint = self._factory.create_endpoint_from_conn_request(conn_request, True)
        except Exception as error:  # a request UCX could not complete
            log.info("a connection request failed: %r", error)
            return
        task = asyncio.ensure_future(self._connect(endpoint))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self, endpoint: Any) -> None:
        from ucxx._lib_async.endpoint import Endpoint
        from ucxx._lib_async.utils import hash64bits

        from ems.transport.ucx.endpoint import exchange_peer_info

        msg_tag = hash64bits("msg_tag", os.urandom(16), endpoint.handle)
        try:
            peer = await exchange_peer_info(endpoint, msg_tag, listener=True, connect_timeout=self._connect_timeout_s)
        except Exception as error:  # the peer left or stalled mid-connect: exchange_peer_info closed it
            log.debug("a connection ended before its peer-info exchange: %r", error)
            return
        ep = Endpoint(endpoint=endpoint, ctx=self._ctx, tags={"msg_send": peer["msg_tag"], "msg_recv": msg_tag})
        try:
            await self._serve(ep)
        except Exception:  # the server's own handler logs what it must
            log.exception("uncaught error serving a connection")

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self._ucp.ucp_listener_destroy(handle)
        for task in list(self._tasks):
            task.cancel()

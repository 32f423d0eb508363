"""`create_endpoint`: ucxx's client connect, made safe to time out.

Contract: `await create_endpoint(ip, port, timeout_s)` returns a `ucxx` Endpoint (error handling on) or raises
(`TimeoutError` when the peer does not finish the exchange in time). Unlike `ucxx.create_endpoint` (0.52), a timeout
never frees a buffer that UCX may still write: ucxx's peer-info exchange wraps a posted stream receive in
`asyncio.wait_for` and drops its buffer on timeout, so a node that was merely paused (SIGSTOP) later answers into
freed memory and corrupts the client's heap. Here the UCX endpoint is closed first (which cancels the receive) and
the exchange buffers are kept in `_GRAVEYARD` until UCX reports their requests finished.

`install_safe_listener_exchange()` applies the same fix to the listening side (a pool node), whose ucxx listener
handler uses the same exchange: a client paused mid-connect would otherwise make the node's heap corrupt later. It
replaces `ucxx._lib_async.listener.exchange_peer_info` (the name that module calls) with `exchange_peer_info` below.
On the listening side, the tag a connection being set up will receive on is recorded in `connecting_tags` from the
start of the exchange (for CONNECTING_TAG_S), so a node does not discard the first messages of a connection it has
not admitted yet as messages of no connection (`ucx.server`, protocol docstring "Tags").
"""

from __future__ import annotations

import asyncio
import os
import struct
from typing import Any, NamedTuple

_FMT = "QQ"
_GRAVEYARD: list[tuple[Any, ...]] = []  # (ucx endpoint, request, buffers...) of abandoned connects
_GRAVEYARD_LIMIT = 4096
CONNECTING_TAG_S = 30.0  # how long a connection's tag counts as being set up (its exchange is bounded far below)
TAG_HIGH_MASK = 0xFFFF_FFFF_0000_0000  # = ucx.progress.CONNECTION_TAG_MASK


class Connecting(NamedTuple):
    """A connection being set up on the listening side: the tag it will receive its heads on, and until when it
    counts as being set up."""

    base_tag: int
    until: float


connecting_tags: dict[int, Connecting] = {}  # high bits of the tag of a connection being set up -> that connection


def _bury(*objects: Any) -> None:
    """Keep `objects` alive while UCX may still use them; forget the oldest entries whose requests completed."""
    _GRAVEYARD.append(objects)
    if len(_GRAVEYARD) > _GRAVEYARD_LIMIT // 2:
        _GRAVEYARD[:] = [g for g in _GRAVEYARD if not _request_done(g[1])]
    if len(_GRAVEYARD) > _GRAVEYARD_LIMIT:
        del _GRAVEYARD[: len(_GRAVEYARD) - _GRAVEYARD_LIMIT]  # never grows without bound, even if UCX never answers


def _waiter(request: Any) -> asyncio.Future[Any]:
    """A task waiting on `request` whose late failure (after we gave up on it) is consumed, not logged."""
    from ems.transport.ucx import progress as ucx_progress

    task: asyncio.Future[Any] = asyncio.ensure_future(ucx_progress.wait(request))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


def _request_done(request: Any) -> bool:
    try:
        return bool(request.completed)
    except Exception:  # older ucxx: assume it may still be in use
        return False


async def exchange_peer_info(endpoint: Any, msg_tag: int, listener: bool, connect_timeout: float = 5.0) -> dict:
    """ucxx's peer-info exchange (same signature and result), closing the endpoint and keeping the buffers alive
    when it fails or times out, so UCX never writes into freed memory."""
    from ucxx._lib.arr import Array
    from ucxx._lib_async.utils import hash64bits

    if listener:
        connecting_tags[msg_tag & TAG_HIGH_MASK] = Connecting(msg_tag, asyncio.get_running_loop().time() + CONNECTING_TAG_S)
    my_info = struct.pack(_FMT, msg_tag, hash64bits(msg_tag))
    peer_info = bytearray(len(my_info))
    my_arr, peer_arr = Array(my_info), Array(peer_info)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + connect_timeout
    request = None
    steps = ("send", "recv") if listener else ("recv", "send")
    try:
        for step in steps:
            request = endpoint.stream_send(my_arr) if step == "send" else endpoint.stream_recv(peer_arr)
            await asyncio.wait_for(asyncio.shield(_waiter(request)), max(0.0, deadline - loop.time()))
    except BaseException:
        try:
            endpoint.close_blocking(period=10**8, max_attempts=1)
        except Exception:  # already failed: nothing more to release
            pass
        _bury(endpoint, request, my_info, peer_info, my_arr, peer_arr)
        raise
    peer_tag, checksum = struct.unpack(_FMT, peer_info)
    if hash64bits(peer_tag) != checksum:
        raise RuntimeError("UCX peer-info checksum mismatch")
    return {"msg_tag": peer_tag, "checksum": checksum}


def install_safe_listener_exchange() -> None:
    import ucxx._lib_async.listener as listener_module

    listener_module.exchange_peer_info = exchange_peer_info


async def create_endpoint(ip: str, port: int, timeout_s: float) -> Any:
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib_async.endpoint import Endpoint
    from ucxx._lib_async.utils import hash64bits
    from ucxx.core import _get_ctx

    ctx = _get_ctx()
    ctx.continuous_ucx_progress()
    ucx_ep = ucx_api.UCXEndpoint.create(ctx.worker, ip, port, True)
    if not ctx.progress_mode.startswith("thread"):
        ctx.worker.progress()
    msg_tag = hash64bits("msg_tag", os.urandom(16), ucx_ep.handle)
    try:
        peer = await exchange_peer_info(ucx_ep, msg_tag, listener=False, connect_timeout=timeout_s)
    except RuntimeError:
        ucx_ep.close_blocking(period=10**8, max_attempts=1)
        raise ConnectionError("UCX peer-info checksum mismatch") from None
    return Endpoint(endpoint=ucx_ep, ctx=ctx, tags={"msg_send": peer["msg_tag"], "msg_recv": msg_tag})


# ---- the peer of an endpoint (ucp_ep_query through ctypes: ucxx 0.52 does not expose it) ----

_EP_ATTR_FIELD_REMOTE_SOCKADDR = 1 << 2
_EP_ATTR_REMOTE_OFFSET = 8 + 32 + 128  # field_mask u64, name[UCP_ENTITY_NAME_MAX], local sockaddr_storage
_ucp_ep_query: Any = None


def _load_ep_query() -> Any:
    global _ucp_ep_query
    if _ucp_ep_query is None:
        import ctypes

        from ems.transport.ucx.ucxx_internals import loaded_library

        query = loaded_library("libucp").ucp_ep_query
        query.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        query.restype = ctypes.c_int
        _ucp_ep_query = query
    return _ucp_ep_query


def peer_host(ep: Any) -> str:
    """The IP address of the peer of a ucxx Endpoint ("?" when UCX cannot say)."""
    import ctypes
    import socket

    try:
        query = _load_ep_query()
        attr = ctypes.create_string_buffer(1024)
        ctypes.c_uint64.from_buffer(attr).value = _EP_ATTR_FIELD_REMOTE_SOCKADDR
        if query(ctypes.c_void_p(ep.ucp_endpoint), attr) != 0:
            return "?"
        raw = attr.raw[_EP_ATTR_REMOTE_OFFSET : _EP_ATTR_REMOTE_OFFSET + 128]
        family = int.from_bytes(raw[:2], "little")
        if family == socket.AF_INET:
            return socket.inet_ntop(socket.AF_INET, raw[4:8])
        if family == socket.AF_INET6:
            return socket.inet_ntop(socket.AF_INET6, raw[8:24])
    except (OSError, AttributeError, ValueError):
        pass
    return "?"

"""The UCX client transport: a `NodeClient` for one remote pool node, on `ucxx`.

Contract:
* One process-wide `UcxRuntime` thread runs an asyncio loop that drives UCX (`ucx_config`); every request is a
  coroutine submitted to it. The calling thread waits until the call's `Deadline` at most; on timeout the request is cancelled and
  the endpoint aborted (a late reply can never be read as the answer to a later request), and `TransportError
  (EMS_IO_TIMEOUT)` is raised. Lost connections, refused handshakes and malformed replies raise `EMS_IO_ERROR`.
* One connection per node, several requests in flight on it (protocol version 4, inline framing): each request has
  a request id, its frames after the head and its whole reply travel on its own tag, so concurrent calls (async
  saves, TP ranks) overlap on one connection. An exists or any small request is one message each way.
* `get_into` receives values straight into caller-provided buffers (a value alone in its segment is received in
  place, length-verified; small packed values are copied out of their segment), so a load allocates nothing.
* Lazy reconnect: a call on a dropped connection reconnects first (concurrent calls share one connect). After a
  failure, calls within `RECONNECT_BACKOFF_S` fail at once with the last error instead of hammering a dead node.
  A timeout or failure aborts the endpoint (the other requests in flight on it fail too).
* Same host: with a node on this host (and `shm` not OFF), values move through a shared-memory region of the
  connection (`transport.shm_client`); any call it cannot serve goes over UCX as above.
* Authentication: the handshake proves `access_key` with HMAC-SHA256 over the node's nonce; the key never travels.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import enum
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np

from ems.buffers import Buffer
from ems.deadline import Deadline
from ems.errors import EmsErrorCode
from ems.transport import protocol, ucx_progress
from ems.transport.base import NodeClient, TransportError
from ems.transport.shm import is_local_address
from ems.transport.shm_client import ShmBuffer, ShmClient, ShmMode
from ems.transport.ucx_config import CLIENT_PROGRESS_MODE, init_ucx
from ems.transport.ucx_endpoint import create_endpoint
from ems.transport.ucx_frames import new_canary, recv_head, recv_header_frame, recv_into, send_all
from ems.transport.ucx_frames import recv_meta as _recv_meta

RECONNECT_BACKOFF_S = 0.5
ABORT_PERIOD_NS = 10**8  # how long aborting an endpoint may wait for UCX (never long: the peer may hang)
T = TypeVar("T")  # what a request answers


class UcxRuntime:
    """The process-wide UCX event loop thread (created on first use)."""

    _instance: UcxRuntime | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []

        def start() -> None:
            # ucxx binds its notifier thread to the *running* loop, so it must be initialised from inside it
            try:
                init_ucx(CLIENT_PROGRESS_MODE)
            except BaseException as error:  # reported to the creating thread
                failure.append(error)
                self.loop.stop()
            finally:
                ready.set()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(start)
            self.loop.run_forever()

        self.live: set = set()  # endpoints in use, aborted at exit
        self.thread = threading.Thread(target=run, name="ems-ucx", daemon=True)
        self.thread.start()
        ready.wait()
        if failure:
            raise TransportError(EmsErrorCode.EMS_IO_ERROR, f"UCX failed to start: {failure[0]!r}")
        # ucxx's notifier thread is not a daemon: stop it before the interpreter joins threads at exit, or the
        # process never exits (threading's own exit hook runs before `atexit`)
        register = getattr(threading, "_register_atexit", atexit.register)
        register(self.shutdown)

    def shutdown(self) -> None:
        """Abort every endpoint and stop the loop thread, before the interpreter tears objects down (UCX callbacks
        into half-destroyed Python objects crash the process)."""
        if not self.thread.is_alive():
            return

        def stop() -> None:
            for ep in list(self.live):
                _abort(ep)
            self.live.clear()
            try:
                import ucxx

                ucxx.stop_notifier_thread()
            except Exception:  # nothing to stop
                pass
            self.loop.stop()

        self.loop.call_soon_threadsafe(stop)
        self.thread.join(5.0)

    @classmethod
    def get(cls) -> UcxRuntime:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = UcxRuntime()
            return cls._instance

    def start(self, coro: Coroutine[Any, Any, Any]) -> _Waiter:
        """Run `coro` on the loop; the calling thread waits on the returned `_Waiter` (cheaper than
        `asyncio.run_coroutine_threadsafe`: no concurrent Future, one lock)."""
        waiter = _Waiter()
        self.loop.call_soon_threadsafe(waiter.begin, self.loop, coro)
        return waiter

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)


def resolve(address: str) -> tuple[str, int]:
    """ "host:port" → (IPv4 address, port); TransportError(EMS_IO_ERROR) when it cannot be resolved."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise TransportError(EmsErrorCode.EMS_IO_ERROR, f"{address}: not a host:port address")
    try:
        return socket.gethostbyname(host.strip("[]")), int(port)
    except OSError as error:
        raise TransportError(EmsErrorCode.EMS_IO_ERROR, f"{address}: cannot resolve {host!r}: {error}") from None


class _Waiter:
    """A calling thread's wait for one coroutine on the UCX loop: a lock released by the task's done callback."""

    __slots__ = ("lock", "task")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.task: asyncio.Task | None = None

    def begin(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> None:
        self.task = loop.create_task(coro)
        self.task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        if not task.cancelled():
            task.exception()  # retrieved: a caller that gave up (timeout) is not told again in the log
        self.lock.release()

    def result(self, timeout_s: float) -> Any:
        """The coroutine's result (or its exception, raised); concurrent.futures.TimeoutError when it takes longer."""
        if not self.lock.acquire(timeout=max(0.0, timeout_s)):
            raise concurrent.futures.TimeoutError()
        if self.task is None:  # the lock is released only by `_done`, after `begin`
            raise RuntimeError("a waiter released before it began")
        return self.task.result()


class _Call:
    """One request's shared state between the calling thread and the UCX loop."""

    __slots__ = ("abandoned", "ep")

    def __init__(self) -> None:
        self.abandoned = False
        self.ep: Any = None  # the endpoint the request ran on (only that one is dropped when it fails)


class Failure(enum.Enum):
    """What the last failed call of a `UcxNode` ran into."""

    NONE = "none"
    UNREACHABLE = "unreachable"  # connection refused, reset or lost; malformed replies
    TIMEOUT = "timeout"
    REFUSED = "refused"  # the node answered with an error (authentication failed)


class _Refused(Exception):
    """The node answered with an error status (its message is in args[0])."""


class UcxNode(NodeClient):
    """A remote pool node over UCX; see the module docstring."""

    self_timed = True

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
        self._ip, self._port = resolve(address)
        self._access_id = access_id or ""
        self._access_key = access_key
        self._connect_timeout_s = connect_timeout_ms / 1000.0
        self._runtime = UcxRuntime.get()
        self._ep: Any = None  # touched on the UCX loop only, like the two below
        self._connecting: asyncio.Future | None = None
        self._next_id = 0
        self._retry_at = 0.0
        self._last_error: TransportError | None = None
        self.last_failure = Failure.NONE
        wants_shm = (shm or ShmMode.AUTO) != ShmMode.OFF and is_local_address(self._ip)
        self.shm: ShmClient | None = ShmClient(self) if wants_shm else None

    # ---- NodeClient ----

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[Buffer]], deadline: Deadline | float) -> list[bool]:
        if not keys:
            return []
        deadline = Deadline.within(deadline)
        if self.shm is not None:
            stored = self.shm.put(keys, values, deadline)
            if stored is not None:
                return stored
        meta, frames, data_len = _build_put(keys, values)
        return self._call(lambda ep, rid: _put(ep, rid, meta, frames, data_len, len(keys)), deadline)

    def get(self, keys: Sequence[bytes], deadline: Deadline | float) -> list[Buffer | None]:
        if not keys:
            return []
        meta = protocol.encode_keys_meta(keys)
        return self._call(lambda ep, rid: _get(ep, rid, meta, len(keys), None), deadline)

    def get_into(self, keys: Sequence[bytes], outs: Sequence[Buffer], deadline: Deadline | float) -> list[bool]:
        if not keys:
            return []
        if len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} buffers")
        views = [_writable_bytes(o) for o in outs]
        deadline = Deadline.within(deadline)
        if self.shm is not None:
            placed = self.shm.get_into(keys, views, deadline)
            if placed is not None:
                return placed
        meta = protocol.encode_keys_meta(keys)
        return self._call(lambda ep, rid: _get(ep, rid, meta, len(keys), views), deadline)

    def exists(self, keys: Sequence[bytes], deadline: Deadline | float) -> list[bool]:
        if not keys:
            return []
        meta = protocol.encode_keys_meta(keys)
        return self._call(lambda ep, rid: _exists(ep, rid, meta, len(keys)), deadline)

    def ping(self, deadline: Deadline | float) -> bool:
        try:
            self._call(_ping, deadline)
            return True
        except TransportError:
            return False

    def close(self) -> None:
        self._drop()
        if self.shm is not None:
            self.shm.close()

    def shm_buffer(self, nbytes: int) -> ShmBuffer | None:
        """`nbytes` of this connection's shared-memory region, which `put` / `get_into` move without a copy when
        the values lie in it; None when there is none yet (a call opens it), or no room in it."""
        return None if self.shm is None else self.shm.buffer(nbytes)

    def connect_now(self, deadline: Deadline | float) -> None:
        """Connect (and authenticate) now instead of on the first call; TransportError on failure."""
        self._call(lambda ep, rid: _noop(), deadline)

    # ---- machinery ----

    def _call(self, request: Callable[[Any, int], Awaitable[T]], limit: Deadline | float) -> T:
        deadline = Deadline.within(limit).at
        timeout_s = max(0.0, deadline - time.monotonic())
        now = time.monotonic()
        if now < self._retry_at and self._last_error is not None:
            raise TransportError(
                self._last_error.status_code(),
                f"{self._last_error.message()} (next reconnect attempt in {self._retry_at - now:.2f} s)",
            )
        call = _Call()
        waiter = self._runtime.start(self._run(request, call))
        try:
            result: T = waiter.result(deadline - time.monotonic())
            self.last_failure = Failure.NONE
            return result
        except concurrent.futures.TimeoutError:
            # Never cancel a request UCX still works on: its buffers must outlive it. Mark the call abandoned
            # and abort the endpoint (in `_fail`); UCX then fails the request, which ends on its own.
            call.abandoned = True
            raise self._fail(call, EmsErrorCode.EMS_IO_TIMEOUT, f"no answer within {timeout_s:.3f} s") from None
        except _Refused as error:
            raise self._fail(call, EmsErrorCode.EMS_IO_ERROR, str(error), Failure.REFUSED) from None
        except protocol.ProtocolError as error:
            raise self._fail(call, EmsErrorCode.EMS_IO_ERROR, f"malformed reply: {error}") from None
        except TransportError as error:
            raise self._fail(call, error.status_code(), error.message()) from None
        except (asyncio.TimeoutError, TimeoutError):
            raise self._fail(call, EmsErrorCode.EMS_IO_TIMEOUT, "connect timed out") from None
        except Exception as error:  # UCX errors: connection refused, reset, peer failure
            raise self._fail(call, EmsErrorCode.EMS_IO_ERROR, f"connection failed: {error!r}") from None

    async def _run(self, request: Callable[[Any, int], Awaitable[Any]], call: _Call) -> Any:
        """On the UCX loop: connect if needed (one connect shared by concurrent calls), then run the request on
        the endpoint under a fresh request id (unless its caller gave up)."""
        if self._ep is None:
            if self._connecting is None:
                # create_endpoint bounds the connection exchange itself; the outer bound is a safety net only
                self._connecting = asyncio.ensure_future(asyncio.wait_for(self._open(), self._connect_timeout_s + 1.0))
                self._connecting.add_done_callback(self._connected)
            await asyncio.shield(self._connecting)
        ep = self._ep
        if ep is None:
            raise TransportError(EmsErrorCode.EMS_IO_ERROR, f"{self.address}: connection lost")
        call.ep = ep
        if call.abandoned:
            return None
        self._next_id = self._next_id % protocol.MAX_REQUEST_ID + 1
        return await request(ep, self._next_id)

    def _connected(self, connecting: asyncio.Future) -> None:
        self._connecting = None
        if not connecting.cancelled() and connecting.exception() is None:
            self._ep = connecting.result()
            self._runtime.live.add(self._ep)

    async def _open(self) -> Any:
        ep = await create_endpoint(self._ip, self._port, self._connect_timeout_s)
        try:
            access_id = self._access_id.encode("ascii")
            await _send_all(ep, [protocol.pack_header(protocol.Op.HELLO, meta_len=len(access_id)), access_id])
            challenge = await _recv_header(ep, protocol.Op.CHALLENGE)
            nonce = await _recv_meta(ep, challenge.meta_len)
            if len(nonce) != protocol.NONCE_BYTES:
                raise protocol.ProtocolError("bad challenge")
            if challenge.flags & protocol.Flags.AUTH_REQUIRED and self._access_key is None:
                raise _Refused(f"{self.address}: authentication failed: the node requires access_id and access_key")
            mac = protocol.auth_mac(self._access_key, nonce, self._access_id) if self._access_key is not None else b""
            await _send_all(ep, [protocol.pack_header(protocol.Op.AUTH, meta_len=len(mac)), mac])
            await _recv_header(ep, protocol.Op.AUTH | protocol.REPLY)
            return ep
        except _Refused as error:
            _abort(ep)
            message = str(error)
            raise _Refused(message if message.startswith(self.address) else f"{self.address}: {message}") from None
        except BaseException:
            _abort(ep)
            raise

    def _fail(self, call: _Call, code: EmsErrorCode, message: str, failure: Failure | None = None) -> TransportError:
        """Record a failure: drop the call's connection (a late reply must never answer a later request), back off."""
        error = TransportError(code, message if message.startswith(self.address) else f"{self.address}: {message}")
        self._runtime.call_soon(self._drop_on_loop, call.ep)
        self._retry_at = time.monotonic() + RECONNECT_BACKOFF_S
        self._last_error = error
        if failure is None:
            failure = Failure.TIMEOUT if code == EmsErrorCode.EMS_IO_TIMEOUT else Failure.UNREACHABLE
        self.last_failure = failure
        return error

    def _drop(self) -> None:
        self._runtime.call_soon(self._drop_on_loop, None)

    def _drop_on_loop(self, ep: Any) -> None:
        """Drop the current connection when it is `ep` (None: whatever it is); a newer one is left alone. An `ep`
        that failed before it became current is aborted all the same."""
        if ep is None or ep is self._ep:
            ep, self._ep = self._ep, None
        if ep is not None:
            self._runtime.live.discard(ep)
            _abort(ep)


# ---- requests (coroutines on the UCX loop) ----


async def _noop() -> None:
    return None


async def _request(
    ep: Any, rid: int, op: int, *, count: int = 0, meta: bytes = b"", data: Sequence[Any] = (), data_len: int = 0
) -> tuple[protocol.Header, memoryview]:
    """Send one inline request (head on the base tag, the rest on tag `rid`) and receive its reply's head (on tag
    `rid`): the reply header (status OK, the expected op) and its inline bytes; the reply's meta frame, when it did
    not fit inline, is received too and returned in place of the inline bytes."""
    header = protocol.pack_header(
        op, count=count, meta_len=len(meta), data_len=data_len, flags=protocol.Flags.INLINE, request_id=rid
    )
    layout = protocol.head_layout(len(meta), data_len)
    head = protocol.pack_head(header, meta, data)
    frames = ([] if layout.meta_inline else [meta]) + ([] if layout.data_inline else list(data))
    # the head, the rest of the request and the reply's receive are all posted at once (no wait for a send to
    # complete first: different tags, so their order does not matter); the reply is awaited while the rest goes
    # out: a node that refuses the request before receiving its data (too large for its in-flight budget) answers
    # at once, and that answer must not wait behind unsent data
    posted = [ucx_progress.send(ep, head)] + [ucx_progress.send(ep, f, rid) for f in frames if len(f)]
    sends = posted[0] if len(posted) == 1 else asyncio.gather(*posted)
    sends.add_done_callback(lambda t: t.cancelled() or t.exception())  # its failure is reported by the reply
    reply, body = await recv_head(ep, rid)
    if reply.status != protocol.Status.OK:
        text = bytes(body[: reply.meta_len]) if protocol.head_layout(reply.meta_len, 0).meta_inline else b""
        raise _Refused(text.decode("utf-8", "replace") or f"node answered status {reply.status}")
    if reply.op != op | protocol.REPLY or not reply.inline or reply.request_id != rid:
        raise protocol.ProtocolError(
            f"expected op {op | protocol.REPLY:#x} for request {rid}, got {reply.op:#x} ({reply.request_id})"
        )
    if not protocol.head_layout(reply.meta_len, reply.data_len).meta_inline:
        body = memoryview(await _recv_meta(ep, reply.meta_len, rid))
    await sends
    return reply, body


async def _ping(ep: Any, rid: int) -> None:
    await _request(ep, rid, protocol.Op.PING)


async def _put(ep: Any, rid: int, meta: bytes, frames: list, data_len: int, count: int) -> list[bool]:
    reply, body = await _request(ep, rid, protocol.Op.PUT, count=count, meta=meta, data=frames, data_len=data_len)
    return protocol.decode_flags(count, body[: reply.meta_len])


async def _exists(ep: Any, rid: int, meta: bytes, count: int) -> list[bool]:
    reply, body = await _request(ep, rid, protocol.Op.EXISTS, count=count, meta=meta)
    return protocol.decode_flags(count, body[: reply.meta_len])


async def _get(ep: Any, rid: int, meta: bytes, count: int, outs: list[memoryview] | None) -> list:
    """GET: the values (`outs` None: read-only views of fresh segments), or, with `outs`, whether each value was
    placed in its caller buffer (a value of another length than its buffer counts as a miss)."""
    reply, body = await _request(ep, rid, protocol.Op.GET, count=count, meta=meta)
    lens = protocol.decode_get_lens(count, reply.data_len, body[: reply.meta_len])
    inline = protocol.head_layout(reply.meta_len, reply.data_len).data_inline
    if outs is not None and count == 1 and not inline and 0 < int(lens[0]) == outs[0].nbytes:
        # the common 1-block load: one value, alone in its segment, received straight into its buffer
        await recv_into(ep, outs[0], new_canary(), rid)
        return [True]
    present = np.nonzero(lens >= 0)[0]
    present_lens = lens[present]
    plan = protocol.segment_plan(present_lens)
    offsets, sizes = protocol.segment_bounds(present_lens, plan)
    fits = (  # per present value: its caller buffer has its size (none without caller buffers)
        np.zeros(0, dtype=bool)
        if outs is None
        else np.fromiter((outs[i].nbytes for i in present.tolist()), dtype=np.int64, count=present.size) == present_lens
    )
    segments: list = []
    receives = []
    canary = new_canary()  # every segment's received length is verified (ucx_frames)
    seg_start = 0
    counts = np.bincount(plan, minlength=sizes.size) if plan.size else np.zeros(0, np.int64)
    first = np.cumsum(counts) - counts
    for seg, size in enumerate(sizes.tolist()):
        if inline:
            segments.append(body[reply.meta_len + seg_start : reply.meta_len + seg_start + size])
        elif outs is not None and counts[seg] == 1 and fits[first[seg]] and size:
            target = outs[int(present[first[seg]])]
            segments.append(target)  # received in place
            receives.append(recv_into(ep, target, canary, rid))
        else:
            buf = memoryview(np.empty(size, dtype=np.uint8))
            segments.append(buf)
            if size:
                receives.append(recv_into(ep, buf, canary, rid))
        seg_start += size
    if receives:
        await asyncio.gather(*receives)
    if outs is None:
        views = [s if isinstance(s, memoryview) and s.readonly else memoryview(s).toreadonly() for s in segments]
        out: list = [None] * count
        for i, seg, off, n in zip(present.tolist(), plan.tolist(), offsets.tolist(), present_lens.tolist()):
            out[i] = views[seg][off : off + n]
        return out
    placed = [False] * count
    for j, (i, seg, off, n) in enumerate(zip(present.tolist(), plan.tolist(), offsets.tolist(), present_lens.tolist())):
        if not fits[j]:
            continue
        if segments[seg] is not outs[i]:
            outs[i][:] = segments[seg][off : off + n]
        placed[i] = True
    return placed


def _writable_bytes(buffer: Buffer) -> memoryview:
    view = memoryview(buffer)
    if view.readonly:
        raise ValueError("get_into needs writable buffers")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _as_bytes(part: Buffer) -> memoryview:
    view = memoryview(part)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _build_put(keys: Sequence[bytes], values: Sequence[Sequence[Buffer]]) -> tuple[bytes, list, int]:
    """The PUT meta, its data frames and their byte count: a value big enough to be its own segment goes out part by
    part without a copy; small values are packed into one buffer per segment."""
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys but {len(values)} values")
    parts = [[_as_bytes(p) for p in parts] for parts in values]
    lens = np.fromiter((sum(p.nbytes for p in ps) for ps in parts), dtype=np.int64, count=len(parts))
    plan = protocol.segment_plan(lens)
    offsets, sizes = protocol.segment_bounds(lens, plan)
    frames: list = []
    frame_lens: list[int] = []
    packed = np.empty(0, dtype=np.uint8)  # replaced at each new segment, before any value is packed into it
    current = -1
    for i, seg in enumerate(plan.tolist()):
        if int(sizes[seg]) == int(lens[i]) and int(lens[i]) >= protocol.SEGMENT_BYTES:
            for p in parts[i]:
                if p.nbytes:
                    frames.append(p)
                    frame_lens.append(p.nbytes)
            continue
        if seg != current:
            current = seg
            packed = np.empty(int(sizes[seg]), dtype=np.uint8)
            if packed.size:
                frames.append(packed)
                frame_lens.append(packed.size)
        at = int(offsets[i])
        for p in parts[i]:
            packed[at : at + p.nbytes] = np.frombuffer(p, dtype=np.uint8)
            at += p.nbytes
    meta = protocol.encode_put_meta(keys, lens, np.asarray(frame_lens, dtype=np.int64))
    return meta, frames, int(lens.sum())


# ---- frames ----


async def _send_all(ep: Any, frames: list) -> None:
    await send_all(ep, frames)


async def _recv_header(ep: Any, expected_op: int) -> protocol.Header:
    header = protocol.unpack_header(await recv_header_frame(ep))
    if header.status != protocol.Status.OK:
        message = (await _recv_meta(ep, header.meta_len)).decode("utf-8", "replace") if header.meta_len else ""
        raise _Refused(message or f"node answered status {header.status}")
    if header.op != expected_op:
        raise protocol.ProtocolError(f"expected op {expected_op:#x}, got {header.op:#x}")
    return header


def _abort(ep: Any) -> None:
    try:
        ep.abort(period=ABORT_PERIOD_NS)
    except Exception:  # already closed
        pass
    ucx_progress.kick()  # the aborted requests' failures reach their callers now

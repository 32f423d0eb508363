"""The UCX client transport: a `NodeClient` for one remote pool node, on `ucxx`.

Contract:
* One process-wide `UcxRuntime` thread runs an asyncio loop that drives UCX (`ucx_config`); every request is a
  coroutine submitted to it. The calling thread waits at most `timeout_s`; on timeout the request is cancelled and
  the endpoint aborted (a late reply can never be read as the answer to a later request), and `TransportError
  (EMS_IO_TIMEOUT)` is raised. Lost connections, refused handshakes and malformed replies raise `EMS_IO_ERROR`.
* One connection per node, one request at a time on it (a lock; waiting for it counts against the timeout).
* Lazy reconnect: a call on a dropped connection reconnects first. After a failure, calls within
  `RECONNECT_BACKOFF_S` fail at once with the last error instead of hammering a dead node.
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
from typing import Any, Awaitable, Callable, Optional, Sequence

import numpy as np

from ems.errors import EmsErrorCode
from ems.transport import protocol as P
from ems.transport.base import NodeClient, TransportError
from ems.transport.ucx_config import init_ucx
from ems.transport.ucx_endpoint import create_endpoint
from ems.transport.ucx_frames import new_canary, recv_header_frame, recv_into, send_all
from ems.transport.ucx_frames import recv_meta as _recv_meta
from ems.value_format import Buffer

RECONNECT_BACKOFF_S = 0.5
ABORT_PERIOD_NS = 10**8  # how long aborting an endpoint may wait for UCX (never long: the peer may hang)


class UcxRuntime:
    """The process-wide UCX event loop thread (created on first use)."""

    _instance: Optional["UcxRuntime"] = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []

        def start() -> None:
            # ucxx binds its notifier thread to the *running* loop, so it must be initialised from inside it
            try:
                init_ucx()
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
    def get(cls) -> "UcxRuntime":
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = UcxRuntime()
            return cls._instance

    def submit(self, coro: Awaitable[Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)


def resolve(address: str) -> tuple[str, int]:
    """"host:port" → (IPv4 address, port); TransportError(EMS_IO_ERROR) when it cannot be resolved."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise TransportError(EmsErrorCode.EMS_IO_ERROR, f"{address}: not a host:port address")
    try:
        return socket.gethostbyname(host.strip("[]")), int(port)
    except OSError as error:
        raise TransportError(EmsErrorCode.EMS_IO_ERROR, f"{address}: cannot resolve {host!r}: {error}") from None


class _Call:
    """One request's shared state between the calling thread and the UCX loop."""

    __slots__ = ("abandoned",)

    def __init__(self) -> None:
        self.abandoned = False


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

    def __init__(
        self,
        address: str,
        *,
        access_id: Optional[str] = None,
        access_key: Optional[str] = None,
        connect_timeout_ms: int = 3000,
    ) -> None:
        self.address = address
        self._ip, self._port = resolve(address)
        self._access_id = access_id or ""
        self._access_key = access_key
        self._connect_timeout_s = connect_timeout_ms / 1000.0
        self._runtime = UcxRuntime.get()
        self._lock = threading.Lock()
        self._ep: Any = None
        self._retry_at = 0.0
        self._last_error: Optional[TransportError] = None
        self.last_failure = Failure.NONE

    # ---- NodeClient ----

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[Buffer]], timeout_s: float) -> list[bool]:
        if not keys:
            return []
        header, meta, chunks = _build_put(keys, values)
        return self._call(lambda ep: _put(ep, header, meta, chunks, len(keys)), timeout_s)

    def get(self, keys: Sequence[bytes], timeout_s: float) -> list[Optional[Buffer]]:
        if not keys:
            return []
        meta = P.encode_keys_meta(keys)
        header = P.pack_header(P.Op.GET, count=len(keys), meta_len=len(meta))
        return self._call(lambda ep: _get(ep, header, meta, len(keys)), timeout_s)

    def exists(self, keys: Sequence[bytes], timeout_s: float) -> list[bool]:
        if not keys:
            return []
        meta = P.encode_keys_meta(keys)
        header = P.pack_header(P.Op.EXISTS, count=len(keys), meta_len=len(meta))
        return self._call(lambda ep: _exists(ep, header, meta, len(keys)), timeout_s)

    def ping(self, timeout_s: float) -> bool:
        try:
            self._call(_ping, timeout_s)
            return True
        except TransportError:
            return False

    def close(self) -> None:
        with self._lock:
            self._drop()

    def connect_now(self, timeout_s: float) -> None:
        """Connect (and authenticate) now instead of on the first call; TransportError on failure."""
        self._call(lambda ep: _noop(), timeout_s)

    # ---- machinery ----

    def _call(self, request: Callable[[Any], Awaitable[Any]], timeout_s: float) -> Any:
        deadline = time.monotonic() + max(0.0, timeout_s)
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):
            raise TransportError(EmsErrorCode.EMS_IO_TIMEOUT, f"{self.address}: busy for {timeout_s:.3f} s")
        try:
            now = time.monotonic()
            if now < self._retry_at and self._last_error is not None:
                raise TransportError(
                    self._last_error.status_code(),
                    f"{self._last_error.message()} (next reconnect attempt in {self._retry_at - now:.2f} s)",
                )
            call = _Call()
            future = self._runtime.submit(self._run(request, call))
            try:
                result = future.result(timeout=max(0.0, deadline - time.monotonic()))
                self.last_failure = Failure.NONE
                return result
            except concurrent.futures.TimeoutError:
                # Never cancel a request UCX still works on: its buffers must outlive it. Mark the call abandoned
                # and abort the endpoint (in `_fail`); UCX then fails the request, which ends on its own.
                call.abandoned = True
                raise self._fail(EmsErrorCode.EMS_IO_TIMEOUT, f"no answer within {timeout_s:.3f} s") from None
            except _Refused as error:
                raise self._fail(EmsErrorCode.EMS_IO_ERROR, str(error), Failure.REFUSED) from None
            except P.ProtocolError as error:
                raise self._fail(EmsErrorCode.EMS_IO_ERROR, f"malformed reply: {error}") from None
            except TransportError as error:
                raise self._fail(error.status_code(), error.message()) from None
            except (asyncio.TimeoutError, TimeoutError):
                raise self._fail(EmsErrorCode.EMS_IO_TIMEOUT, "connect timed out") from None
            except Exception as error:  # UCX errors: connection refused, reset, peer failure
                raise self._fail(EmsErrorCode.EMS_IO_ERROR, f"connection failed: {error!r}") from None
        finally:
            self._lock.release()

    async def _run(self, request: Callable[[Any], Awaitable[Any]], call: "_Call") -> Any:
        """On the UCX loop: connect if needed, then run the request on the endpoint (unless its caller gave up)."""
        if self._ep is None:
            # create_endpoint bounds the connection exchange itself; the outer bound is a safety net only
            self._ep = await asyncio.wait_for(self._open(), self._connect_timeout_s + 1.0)
        if call.abandoned:
            return None
        self._runtime.live.add(self._ep)
        return await request(self._ep)

    async def _open(self) -> Any:
        ep = await create_endpoint(self._ip, self._port, self._connect_timeout_s)
        try:
            access_id = self._access_id.encode("ascii")
            await _send_all(ep, [P.pack_header(P.Op.HELLO, meta_len=len(access_id)), access_id])
            challenge = await _recv_header(ep, P.Op.CHALLENGE)
            nonce = await _recv_meta(ep, challenge.meta_len)
            if len(nonce) != P.NONCE_BYTES:
                raise P.ProtocolError("bad challenge")
            if challenge.flags & P.Flags.AUTH_REQUIRED and self._access_key is None:
                raise _Refused(f"{self.address}: authentication failed: the node requires access_id and access_key")
            mac = P.auth_mac(self._access_key, nonce, self._access_id) if self._access_key is not None else b""
            await _send_all(ep, [P.pack_header(P.Op.AUTH, meta_len=len(mac)), mac])
            await _recv_header(ep, P.Op.AUTH | P.REPLY)
            return ep
        except _Refused as error:
            _abort(ep)
            message = str(error)
            raise _Refused(message if message.startswith(self.address) else f"{self.address}: {message}") from None
        except BaseException:
            _abort(ep)
            raise

    def _fail(self, code: EmsErrorCode, message: str, failure: Optional[Failure] = None) -> TransportError:
        """Record a failure: drop the connection (a late reply must never answer a later request), back off."""
        error = TransportError(code, message if message.startswith(self.address) else f"{self.address}: {message}")
        self._drop()
        self._retry_at = time.monotonic() + RECONNECT_BACKOFF_S
        self._last_error = error
        if failure is None:
            failure = Failure.TIMEOUT if code == EmsErrorCode.EMS_IO_TIMEOUT else Failure.UNREACHABLE
        self.last_failure = failure
        return error

    def _drop(self) -> None:
        # `_ep` is only touched on the UCX loop; this runs after any cancellation already queued there
        self._runtime.call_soon(self._drop_on_loop)

    def _drop_on_loop(self) -> None:
        ep, self._ep = self._ep, None
        if ep is not None:
            self._runtime.live.discard(ep)
            _abort(ep)


# ---- requests (coroutines on the UCX loop) ----


async def _noop() -> None:
    return None


async def _ping(ep: Any) -> None:
    await ep.send(P.pack_header(P.Op.PING))
    await _recv_header(ep, P.Op.PING | P.REPLY)


async def _put(ep: Any, header: np.ndarray, meta: bytes, chunks: list, count: int) -> list[bool]:
    # the reply is awaited while the data goes out: a node that refuses the request before receiving its data
    # (too large for its in-flight budget) answers at once, and that answer must not wait behind unsent data
    sends = asyncio.ensure_future(_send_all(ep, [header, meta, *chunks]))
    sends.add_done_callback(lambda t: t.cancelled() or t.exception())  # its failure is reported by the reply
    reply = await _recv_header(ep, P.Op.PUT | P.REPLY)
    flags = P.decode_flags(count, await _recv_meta(ep, reply.meta_len))
    await sends
    return flags


async def _exists(ep: Any, header: np.ndarray, meta: bytes, count: int) -> list[bool]:
    await _send_all(ep, [header, meta])
    reply = await _recv_header(ep, P.Op.EXISTS | P.REPLY)
    return P.decode_flags(count, await _recv_meta(ep, reply.meta_len))


async def _get(ep: Any, header: np.ndarray, meta: bytes, count: int) -> list[Optional[Buffer]]:
    await _send_all(ep, [header, meta])
    reply = await _recv_header(ep, P.Op.GET | P.REPLY)
    lens = P.decode_get_lens(count, reply.data_len, await _recv_meta(ep, reply.meta_len))
    present = np.nonzero(lens >= 0)[0]
    present_lens = lens[present]
    plan = P.segment_plan(present_lens)
    offsets, sizes = P.segment_bounds(present_lens, plan)
    segments = [np.empty(int(s), dtype=np.uint8) for s in sizes.tolist()]
    canary = new_canary()  # every segment's received length is verified (ucx_frames)
    await asyncio.gather(*(recv_into(ep, memoryview(s), canary) for s in segments if s.size))
    views = [memoryview(s).toreadonly() for s in segments]
    out: list[Optional[Buffer]] = [None] * count
    for i, seg, off, n in zip(present.tolist(), plan.tolist(), offsets.tolist(), present_lens.tolist()):
        out[i] = views[seg][off : off + n]
    return out


def _as_bytes(part: Buffer) -> memoryview:
    view = memoryview(part)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _build_put(keys: Sequence[bytes], values: Sequence[Sequence[Buffer]]) -> tuple[np.ndarray, bytes, list]:
    """The PUT frames: a value big enough to be its own segment goes out part by part without a copy; small values
    are packed into one buffer per segment."""
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys but {len(values)} values")
    parts = [[_as_bytes(p) for p in parts] for parts in values]
    lens = np.fromiter((sum(p.nbytes for p in ps) for ps in parts), dtype=np.int64, count=len(parts))
    plan = P.segment_plan(lens)
    offsets, sizes = P.segment_bounds(lens, plan)
    chunks: list = []
    chunk_lens: list[int] = []
    packed: Optional[np.ndarray] = None
    current = -1
    for i, seg in enumerate(plan.tolist()):
        if int(sizes[seg]) == int(lens[i]) and int(lens[i]) >= P.SEGMENT_BYTES:
            for p in parts[i]:
                if p.nbytes:
                    chunks.append(p)
                    chunk_lens.append(p.nbytes)
            continue
        if seg != current:
            current = seg
            packed = np.empty(int(sizes[seg]), dtype=np.uint8)
            if packed.size:
                chunks.append(packed)
                chunk_lens.append(packed.size)
        at = int(offsets[i])
        for p in parts[i]:
            packed[at : at + p.nbytes] = np.frombuffer(p, dtype=np.uint8)  # type: ignore[index]
            at += p.nbytes
    meta = P.encode_put_meta(keys, lens, np.asarray(chunk_lens, dtype=np.int64))
    header = P.pack_header(P.Op.PUT, count=len(keys), meta_len=len(meta), data_len=int(lens.sum()))
    return header, meta, chunks


# ---- frames ----


async def _send_all(ep: Any, frames: list) -> None:
    await send_all(ep, frames)


async def _recv_header(ep: Any, expected_op: int) -> P.Header:
    header = P.unpack_header(await recv_header_frame(ep))
    if header.status != P.Status.OK:
        message = (await _recv_meta(ep, header.meta_len)).decode("utf-8", "replace") if header.meta_len else ""
        raise _Refused(message or f"node answered status {header.status}")
    if header.op != expected_op:
        raise P.ProtocolError(f"expected op {expected_op:#x}, got {header.op:#x}")
    return header


def _abort(ep: Any) -> None:
    try:
        ep.abort(period=ABORT_PERIOD_NS)
    except Exception:  # already closed
        pass

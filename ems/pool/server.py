"""The pool-node server: a `KvStore` served over UCX (`ems.transport.protocol`, version 1).

Contract:
* One asyncio event loop serves every connection (UCX progress settings: `transport.ucx_config`);
  each connection is served by one coroutine, requests in order, so many clients are served at once. Checksumming
  and storing large PUTs runs in worker threads so one big request does not stall the others.
* Handshake first (`protocol` docstring). With access keys configured, a client must prove one (HMAC over a
  fresh nonce) or is refused with AUTH_FAILED; without keys every client is accepted under the tenant it names.
* Every key is stored under its tenant's namespace (`tenant_prefix(access_id) + key`), so one tenant can never
  read, overwrite or test another's keys.
* A malformed or oversized frame, or any transport error, closes that connection only.
* `stop()` closes the listener and every connection; the caller then lets the loop finish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np

from ems.store import KvStore
from ems.transport import protocol as P
from ems.transport.ucx_config import init_ucx
from ems.transport.ucx_endpoint import install_safe_listener_exchange

log = logging.getLogger("ems.pool")

HANDSHAKE_TIMEOUT_S = 10.0
# PUTs with more data than this are checksummed and stored off the event loop
OFFLOAD_BYTES = 256 << 10


def tenant_prefix(access_id: str) -> bytes:
    """The namespace of a tenant's keys: its id, length-prefixed so no two tenants' prefixes overlap."""
    raw = access_id.encode("ascii")
    return struct.pack("<H", len(raw)) + raw


class _Closed(Exception):
    """The peer closed the connection (not an error worth a warning)."""


class PoolServer:
    """Serves one `KvStore`; see the module docstring."""

    def __init__(self, store: KvStore, access_keys: Optional[dict[str, str]] = None) -> None:
        self.store = store
        self.access_keys = dict(access_keys or {})
        self._listener = None
        self._endpoints: set = set()
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ems-pool-store")
        self.port = 0

    # ---- life cycle ----

    async def start(self, port: int) -> int:
        """Start listening (UCX listens on every interface); returns the port."""
        import ucxx

        init_ucx()
        install_safe_listener_exchange()  # a client paused mid-connect must not corrupt this node's heap
        self._listener = ucxx.create_listener(self._serve, port=port, endpoint_error_handling=True)
        self.port = int(self._listener.port)
        return self.port

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for ep in list(self._endpoints):
            _abort(ep)
        self._endpoints.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- one connection ----

    async def _serve(self, ep) -> None:
        self._endpoints.add(ep)
        try:
            tenant = await asyncio.wait_for(self._handshake(ep), HANDSHAKE_TIMEOUT_S)
            if tenant is None:
                return
            prefix = tenant_prefix(tenant)
            while True:
                header = await _recv_header(ep)
                await self._dispatch(ep, header, prefix)
        except _Closed:
            log.debug("client left")
        except P.ProtocolError as error:
            log.warning("closing a connection: malformed request: %s", error)
        except asyncio.TimeoutError:
            log.warning("closing a connection: no handshake within %.0f s", HANDSHAKE_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # any transport failure ends this connection only
            log.info("closing a connection: %r", error)
        finally:
            self._endpoints.discard(ep)
            _abort(ep)

    async def _handshake(self, ep) -> Optional[str]:
        hello = await _recv_header(ep)
        if hello.op != P.Op.HELLO or hello.data_len or hello.meta_len > P.MAX_ID_BYTES:
            raise P.ProtocolError(f"expected HELLO, got op {hello.op}")
        access_id = P.check_access_id(await _recv_meta(ep, hello.meta_len))
        nonce = os.urandom(P.NONCE_BYTES)
        flags = P.Flags.AUTH_REQUIRED if self.access_keys else P.Flags.NONE
        await _send_all(ep, [P.pack_header(P.Op.CHALLENGE, meta_len=len(nonce), flags=flags), nonce])
        auth = await _recv_header(ep)
        if auth.op != P.Op.AUTH or auth.data_len or auth.meta_len not in (0, P.MAC_BYTES):
            raise P.ProtocolError(f"expected AUTH, got op {auth.op}")
        mac = await _recv_meta(ep, auth.meta_len)
        if self.access_keys:
            key = self.access_keys.get(access_id)
            if not access_id or key is None or not P.check_mac(key, nonce, access_id, mac):
                reason = (
                    "this node requires an access_id and access_key"
                    if not access_id
                    else "unknown access_id or wrong access_key"
                )
                log.warning("refused a client (access_id %r): %s", access_id, reason)
                message = f"authentication failed: {reason}".encode()
                await _send_all(
                    ep,
                    [P.pack_header(P.Op.AUTH | P.REPLY, status=P.Status.AUTH_FAILED, meta_len=len(message)), message],
                )
                await asyncio.sleep(0.05)  # let the refusal reach the client before the endpoint closes
                return None
        await _send_all(ep, [P.pack_header(P.Op.AUTH | P.REPLY)])
        log.debug("client connected as tenant %r", access_id)
        return access_id

    async def _dispatch(self, ep, header: P.Header, prefix: bytes) -> None:
        op = header.op
        if op == P.Op.PING:
            if header.meta_len or header.data_len or header.count:
                raise P.ProtocolError("PING carries nothing")
            await _send_all(ep, [P.pack_header(P.Op.PING | P.REPLY)])
        elif op == P.Op.PUT:
            await self._put(ep, header, prefix)
        elif op in (P.Op.GET, P.Op.EXISTS):
            if header.data_len:
                raise P.ProtocolError("GET/EXISTS carry no data")
            meta = await _recv_meta(ep, header.meta_len)
            keys = _namespaced(prefix, P.decode_keys_meta(header.count, meta))
            if op == P.Op.EXISTS:
                flags = np.asarray(self.store.contains_many(keys), dtype=np.uint8).tobytes()
                await _send_all(ep, [P.pack_header(op | P.REPLY, count=len(keys), meta_len=len(flags)), flags])
            else:
                await self._get(ep, keys)
        else:
            raise P.ProtocolError(f"unexpected op {op} after the handshake")

    async def _put(self, ep, header: P.Header, prefix: bytes) -> None:
        meta = await _recv_meta(ep, header.meta_len)
        request = P.decode_put_meta(header.count, header.data_len, meta)
        # receive into buffers recycled from evicted values where the store has them (no first-touch page faults)
        segments = [self.store.allocate(int(size)) for size in request.segment_sizes.tolist()]
        views = [memoryview(s) for s in segments]
        ends = (request.chunk_offsets + request.chunk_lens).tolist()
        await asyncio.gather(
            *(
                ep.recv(views[s][a:b])
                for s, a, b in zip(request.chunk_segments.tolist(), request.chunk_offsets.tolist(), ends)
            )
        )
        keys = _namespaced(prefix, request.keys)
        values = _split_values(segments, request.plan, request.value_offsets, request.value_lens, request.segment_sizes)
        del views
        if header.data_len > OFFLOAD_BYTES:
            stored = await asyncio.get_running_loop().run_in_executor(self._executor, self._store_all, keys, values)
        else:
            stored = self._store_all(keys, values)
        flags = np.asarray(stored, dtype=np.uint8).tobytes()
        await _send_all(ep, [P.pack_header(P.Op.PUT | P.REPLY, count=len(keys), meta_len=len(flags)), flags])

    def _store_all(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> list[bool]:
        return [self.store.put_owned(k, v) for k, v in zip(keys, values)]

    async def _get(self, ep, keys: Sequence[bytes]) -> None:
        values = self.store.get_many(keys)
        lens = np.fromiter(
            (-1 if v is None else memoryview(v).nbytes for v in values), dtype=np.int64, count=len(values)
        )
        present = np.nonzero(lens >= 0)[0]
        present_lens = lens[present]
        plan = P.segment_plan(present_lens)
        offsets, sizes = P.segment_bounds(present_lens, plan)
        frames: list = []
        counts = np.bincount(plan, minlength=sizes.size) if plan.size else np.zeros(0, np.int64)
        # one frame per segment: a lone value is sent from the store itself, packed small values are copied once
        for seg, n in enumerate(counts.tolist()):
            if n == 1 and int(sizes[seg]) >= P.SEGMENT_BYTES:
                frames.append(values[int(present[np.searchsorted(plan, seg)])])
                continue
            buf = np.empty(int(sizes[seg]), dtype=np.uint8)
            first = int(np.searchsorted(plan, seg))
            for j in range(first, first + n):
                value = values[int(present[j])]
                size = int(present_lens[j])
                buf[int(offsets[j]) : int(offsets[j]) + size] = np.frombuffer(value, dtype=np.uint8)
            if buf.size:
                frames.append(buf)
        meta = lens.astype("<i8").tobytes()
        total = int(present_lens.sum())
        header = P.pack_header(P.Op.GET | P.REPLY, count=len(keys), meta_len=len(meta), data_len=total)
        await _send_all(ep, [header, meta, *frames])


# ---- helpers ----


def _namespaced(prefix: bytes, keys: Sequence[bytes]) -> list[bytes]:
    return [prefix + k for k in keys]


def _split_values(
    segments: list[np.ndarray], plan: np.ndarray, offsets: np.ndarray, lens: np.ndarray, sizes: np.ndarray
) -> list:
    """Each value of a PUT: a value alone in its segment is stored as the receive buffer itself (so the store can
    recycle it once evicted); packed ones are copied out, so a small value never pins its whole segment in memory
    (the store charges only the value's bytes)."""
    out: list = []
    for seg, off, n in zip(plan.tolist(), offsets.tolist(), lens.tolist()):
        if n == int(sizes[seg]):
            out.append(segments[seg])
        else:
            out.append(bytes(memoryview(segments[seg])[off : off + n]))
    return out


async def _recv_header(ep) -> P.Header:
    frame = np.empty(P.HEADER_SIZE, dtype=np.uint8)
    try:
        await ep.recv(frame)
    except Exception as error:
        if "truncat" in repr(error).lower() or "mismatch" in repr(error).lower():
            raise P.ProtocolError(f"frame of the wrong size where a header was expected: {error}") from None
        raise _Closed() from error
    return P.unpack_header(frame)


async def _recv_meta(ep, meta_len: int) -> bytes:
    if meta_len > P.MAX_META_BYTES:
        raise P.ProtocolError(f"meta frame of {meta_len} bytes, limit {P.MAX_META_BYTES}")
    if meta_len == 0:
        return b""
    frame = bytearray(meta_len)
    try:
        await ep.recv(frame)
    except Exception as error:
        if "truncat" in repr(error).lower() or "mismatch" in repr(error).lower():
            raise P.ProtocolError(f"meta frame of the wrong size: {error}") from None
        raise
    return bytes(frame)


async def _send_all(ep, frames: list) -> None:
    """Post every frame at once (UCX keeps their order on the endpoint) and wait for all."""
    frames = [f for f in frames if len(f)]
    if len(frames) == 1:
        await ep.send(frames[0])
    else:
        await asyncio.gather(*(ep.send(f) for f in frames))


def _abort(ep) -> None:
    try:
        ep.abort(period=10**8)
    except Exception:  # already closed by the peer or by us
        pass

"""The pool node's request handlers: PING, PUT, GET, EXISTS (and the shared-memory ops, `transport.shm.server`) over
the store it serves and the in-flight byte budget. The session part (`transport.ucx.server`: admission, handshake,
watchdog, one connection's requests) hands each authenticated request here as a `RequestChannel`; `NodeHandlers`
is the `transport.handler.RequestHandler` it serves through, and the `ShmHost` of the node's `ShmService`.

Contract:
* `NodeHandlers.serve(channel, prefix)` answers one request, start to reply, and returns the value bytes it moved.
  Keys are namespaced with the tenant's `prefix` (`tenant_prefix`, `NodeHandlers.namespace`) before the store sees
  them, so a tenant never reads, overwrites or tests another's keys.
* Memory: the bytes of requests in flight (PUT meta and data being received and stored, GET replies being sent),
  all connections together, stay within the budget (`NodeLimits.inflight_bytes`). A PUT that could never fit, or
  finds no room within `stall_timeout_s`, raises `Refusal` before its data is received (the session answers
  BAD_REQUEST with the message and closes the connection). A GET reply never exceeds the protocol's
  `WIRE_LIMITS.max_data_bytes` nor the budget: the values beyond are answered as misses (so loads stop there), and
  a key named many times is looked up once. A value alone in its segment (any size) is sent from the store's own
  buffer, so naming a value many times costs no copy; packed small values are copied once each into send buffers
  (`scratch`). A 1-key GET is answered without per-segment work (`_get_one`), from the store's buffer.
* A PUT's data is received into buffers recycled from evicted values where the store has them, every receive's
  length verified, and stored from them (`ems.pool.puts`, the store side of a PUT, UCX or shared memory).
  Checksumming and storing a PUT of more than OFFLOAD_BYTES runs on the worker threads (`executor`); smaller ones on
  the loop (cheaper than the hop). A GET the store says may wait for a disk (`may_block(keys)`) is looked up on a
  worker thread. Every buffer and budget byte is released on every path.
* The store a node serves, and how tenants' keys are stored in it: `ems.pool.node_store` (`NodeStore`,
  `tenant_prefix`).
* An EXISTS with a lease or a pin (`transport.exists_holds`) is answered by the store's `hold_many`: held *and* kept.
* A malformed request raises `protocol.ProtocolError` (the session closes that connection only); a refused one
  `transport.handler.Refusal`.
* With `metrics` (`ems.pool.metrics.NodeMetrics`), each request is counted once, with its outcome and bytes.
* Namespaces (`namespaces`, an `ems.pool.namespaces.NamespaceBook`): a PUT (UCX or shared memory) stores no value
  the book refuses under a namespace-record key (too large, or past its tenant's count: answered False, the other
  keys stored); every GET and EXISTS is counted per namespace (keys asked, found, bytes).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ems.buffers import Buffer
from ems.pool.budget import ByteBudget, NodeLimits
from ems.pool.namespaces import BookStore, NamespaceBook
from ems.pool.node_store import NodeStore, tenant_prefix
from ems.pool.puts import put_but, receive_values, store_copies
from ems.transport import metas, protocol
from ems.transport.exists_holds import decode_exists_meta
from ems.transport.handler import Refusal, RequestChannel
from ems.transport.scratch import ScratchBuffers
from ems.transport.shm import RangedRequest, ShmSettings, metric_name
from ems.transport.shm.server import ShmService

if TYPE_CHECKING:
    from ems.pool.metrics import NodeMetrics

log = logging.getLogger("ems.pool")

# PUTs with more data than this are checksummed and stored off the event loop. The hop to a worker thread and back
# costs more than checksumming a few MiB (XXH3 ~50 us per MiB here, the hop 100-300 us on 2 busy cores), so only
# requests that would hold the loop for longer than ~0.2 ms go there.
OFFLOAD_BYTES = 4 << 20
SEND_SCRATCH_BYTES = 64 << 20  # kept for a GET's packed segments (on top of the in-flight budget)
_PING, _PUT, _GET, _EXISTS = int(protocol.Op.PING), int(protocol.Op.PUT), int(protocol.Op.GET), int(protocol.Op.EXISTS)
_SHM_OPS = frozenset((int(protocol.Op.SHM_OPEN), int(protocol.Op.SHM_PUT), int(protocol.Op.SHM_GET)))
_MISS = struct.pack("<q", -1)


class NodeHandlers:
    """Serves requests over one store and one in-flight budget; see the module docstring."""

    def __init__(
        self,
        store: NodeStore,
        limits: NodeLimits,
        metrics: NodeMetrics | None = None,
        shm: ShmSettings | None = None,
    ) -> None:
        self.store = store
        self.limits = limits
        self.metrics = metrics
        self.namespaces = NamespaceBook(cast(BookStore, store))
        self.budget = ByteBudget(limits.inflight_bytes)
        self.send_scratch = ScratchBuffers(SEND_SCRATCH_BYTES)  # a GET's packed segments (transport/scratch.py)
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ems-pool-store")
        self.offload_bytes = OFFLOAD_BYTES
        self.shm = ShmService(shm or ShmSettings(region_bytes=0), self)  # same-host shared memory; off by default
        self._may_block = getattr(store, "may_block", None)  # a store with a disk tier (looked up once)
        # a GET reply's most data bytes: the protocol's and the budget's limits
        self.reply_limit = min(protocol.WIRE_LIMITS.max_data_bytes, self.budget.total)

    # ---- the node's life (`transport.handler.RequestHandler`) ----

    def namespace(self, access_id: str) -> bytes:
        return tenant_prefix(access_id)

    def start(self) -> None:
        self.shm.start()

    def forget(self, conn: Any) -> None:
        self.shm.forget(conn)

    def close(self) -> None:
        self.shm.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def memory_report(self) -> str:
        stats = self.store.stats()
        budget = self.budget
        return (
            f"store {stats.used_bytes} used + {stats.spare_bytes} spare of {stats.capacity_bytes}, "
            f"in flight {budget.used} (peak {budget.peak}) of {budget.total}"
        )

    async def serve(self, channel: RequestChannel, prefix: bytes) -> int:
        """Serve one request (see the module docstring); the value bytes it moved."""
        if self.metrics is None:
            return await self._serve_op(channel, prefix)
        started, ok, nbytes = time.perf_counter(), False, 0
        try:
            nbytes = await self._serve_op(channel, prefix)
            ok = True
        finally:
            self.metrics.request(metric_name(channel.header.op), ok, time.perf_counter() - started, nbytes)
        return nbytes

    def answer_now(self, header: protocol.Header, meta: memoryview, prefix: bytes) -> bytes:
        """The reply meta of an EXISTS or PING whose meta is in hand (`meta`), answered without waiting for
        anything (the session sends it; `ucx.server` serves such requests from the connection's loop): the flags of
        the keys held, or nothing. ProtocolError when malformed. The meta came in the request's head, whose buffer
        exists anyway, so no budget is taken for it."""
        started, ok = time.perf_counter(), False
        try:
            if header.op == _PING:
                if header.meta_len or header.data_len or header.count:
                    raise protocol.ProtocolError("PING carries nothing")
                reply = b""
            else:
                if header.op != _EXISTS or header.data_len:
                    raise protocol.ProtocolError(f"op {header.op} cannot be answered at once")
                reply = self._exists(header, meta, prefix)
            ok = True
            return reply
        finally:
            if self.metrics is not None:
                self.metrics.request(metric_name(header.op), ok, time.perf_counter() - started, 0)

    async def _serve_op(self, channel: RequestChannel, prefix: bytes) -> int:
        header = channel.header
        op = header.op
        if op in (_GET, _EXISTS):
            if header.data_len:
                raise protocol.ProtocolError("GET/EXISTS carry no data")
            await self.take(header.meta_len)
            try:
                if op == _EXISTS:
                    await channel.reply(op, count=header.count, meta=self._exists(header, await channel.meta(), prefix))
                    return 0
                keys = _namespaced(prefix, metas.decode_keys_meta(header.count, await channel.meta()))
            finally:
                self.budget.release(header.meta_len)
            if len(keys) == 1:
                return await self._get_one(channel, keys[0])
            return await self._get(channel, keys)
        if op == _PUT:
            await self._put(channel, prefix)
            return header.data_len
        if op == _PING:
            if header.meta_len or header.data_len or header.count:
                raise protocol.ProtocolError("PING carries nothing")
            await channel.reply(op)
            return 0
        if op in _SHM_OPS:
            return await self.shm.serve(channel, prefix)
        raise protocol.ProtocolError(f"unexpected op {op} after the handshake")

    def _exists(self, header: protocol.Header, meta: memoryview | bytes, prefix: bytes) -> bytes:
        """An EXISTS's reply meta: the keys held (and, where it asks, leased or pinned: `transport.exists_holds`)."""
        hold, keys_meta = decode_exists_meta(header.flags, meta)
        keys = _namespaced(prefix, metas.decode_keys_meta(header.count, keys_meta))
        flags = self.store.contains_many(keys) if hold is None else self.store.hold_many(keys, hold)
        self.namespaces.count_flags(keys, flags)
        return protocol.encode_flags(flags)

    async def take(self, nbytes: int) -> None:
        """Reserve `nbytes` of the in-flight budget for a request, or refuse it (`Refusal`)."""
        if self.budget.try_acquire(nbytes):
            return
        if nbytes > self.budget.total:
            raise Refusal(f"a request of {nbytes} bytes exceeds this node's in-flight limit of {self.budget.total} bytes")
        if not await self.budget.acquire(nbytes, self.limits.stall_deadline()):
            raise Refusal(f"node busy: no room for a request of {nbytes} bytes within {self.limits.stall_timeout_s} s")

    async def room(self, nbytes: int) -> bool:
        """Reserve `nbytes` of the budget for a reply, waiting up to `stall_timeout_s`; False: no room (answer misses)."""
        if self.budget.try_acquire(nbytes):
            return True
        return nbytes <= self.budget.total and await self.budget.acquire(nbytes, self.limits.stall_deadline())

    def release(self, nbytes: int) -> None:
        """Give back `nbytes` of the budget taken by `take` or `room`."""
        self.budget.release(nbytes)

    async def lookup_values(self, keys: list[bytes]) -> list[Buffer | None]:
        """The store's values of `keys`, looked up off the event loop when the store says the lookup may wait for a
        disk (a store with a disk tier has `may_block`); counted per namespace (`NamespaceBook.count`: every GET, UCX
        or shared memory, comes here)."""
        may_block = self._may_block
        if may_block is not None and may_block(keys):
            values = await asyncio.get_running_loop().run_in_executor(self.executor, self.store.get_many, keys)
        else:
            values = self.store.get_many(keys)
        # (a stored value is one-dimensional bytes: its len is its byte count, ~8x cheaper than memoryview's nbytes)
        self.namespaces.count(keys, [None if v is None else len(v) for v in values])
        return values

    async def offload(self, nbytes: int, fn: Any, *args: Any) -> Any:
        """`fn(*args)`: on a worker thread when it handles more than OFFLOAD_BYTES, else here on the loop."""
        if nbytes > OFFLOAD_BYTES:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        return fn(*args)

    # ---- copies between a shared-memory region and the store (`transport.shm.host.ShmHost`) ----

    def store_copies(self, array: np.ndarray, keys: list[bytes], request: RangedRequest) -> list[bool]:
        """Store each value of a shared-memory PUT, copied out of the region `array` (`ems.pool.puts.store_copies`)."""
        return store_copies(self.store, self.namespaces, self.metrics, array, keys, request)

    def read_into(self, values: Sequence[Buffer], outs: Sequence[Buffer], progress: int, signalled: int) -> None:
        """Copy each value into the buffer of `outs` beside it (`NodeStore.read_into`)."""
        self.store.read_into(values, outs, progress, signalled)

    # ---- PUT ----

    async def _put(self, channel: RequestChannel, prefix: bytes) -> None:
        header = channel.header
        charge = header.meta_len + header.data_len
        await self.take(charge)  # before anything of the request beyond its head is received
        try:
            request = metas.decode_put_meta(header.count, header.data_len, await channel.meta())
            keys = _namespaced(prefix, request.keys)
            refused = self.namespaces.refused(keys, request.value_lens)  # namespace records past their bounds
            values, reserved = await receive_values(self.store, channel, request, keys)
            if refused:
                stored = put_but(self.store, refused, keys, values, reserved)
            else:
                stored = await self.offload(header.data_len, self.store.put_owned_each, keys, values, reserved)
            if self.metrics is not None and not all(stored):
                self.metrics.count_damaged(values, stored)
            del values
        finally:
            self.budget.release(charge)
        await channel.reply(_PUT, count=len(keys), meta=protocol.encode_flags(stored))

    # ---- GET ----

    async def _get(self, channel: RequestChannel, keys: Sequence[bytes]) -> int:
        unique = list(dict.fromkeys(keys))  # each key once
        found = dict(zip(unique, await self.lookup_values(unique)))
        values = [found[k] for k in keys]
        del found
        lens = np.fromiter((-1 if v is None else memoryview(v).nbytes for v in values), dtype=np.int64, count=len(values))
        # never more than the protocol or the budget allows in one reply: the values beyond are misses
        running = np.cumsum(np.maximum(lens, 0))
        lens[(running > self.reply_limit) & (lens >= 0)] = -1
        total = int(lens[lens > 0].sum())
        if not await self.room(total):
            _no_room(channel, total)
            lens[:] = -1
            total = 0
        try:
            present = np.nonzero(lens >= 0)[0]
            present_lens = lens[present]
            plan = metas.segment_plan(present_lens)
            offsets, sizes = metas.segment_bounds(present_lens, plan)
            segments: list = []
            packed: list[np.ndarray] = []
            counts = np.bincount(plan, minlength=sizes.size) if plan.size else np.zeros(0, np.int64)
            # one frame per segment: a value alone in its segment, whatever its size, is sent from the store itself
            # (a key named many times costs no memory), packed small values are copied once
            for seg, n in enumerate(counts.tolist()):
                if n == 1:
                    segments.append(values[int(present[np.searchsorted(plan, seg)])])
                    continue
                buf = self.send_scratch.take(int(sizes[seg]))  # reused: a fresh buffer faults in page by page
                packed.append(buf)
                first = int(np.searchsorted(plan, seg))
                for j in range(first, first + n):
                    value = cast(Buffer, values[int(present[j])])  # present: the store found it
                    size = int(present_lens[j])
                    buf[int(offsets[j]) : int(offsets[j]) + size] = np.frombuffer(value, dtype=np.uint8)
                segments.append(buf)
            del values
            meta = metas.encode_get_reply(lens, segments)
            frames = [s for s in segments if memoryview(s).nbytes]
            del segments
            await channel.reply(_GET, count=len(keys), meta=meta, data=frames, data_len=total)
            self.send_scratch.give(packed)  # sent: only now (a reply that failed may still be read by UCX)
        finally:
            self.budget.release(total)
        return total

    async def _get_one(self, channel: RequestChannel, key: bytes) -> int:
        """`_get` of one key (the common 1-block load), without the per-segment numpy work; the same reply: the
        value's length (-1: a miss) and the value as the one data frame, sent from the store without a copy."""
        value = (await self.lookup_values([key]))[0]
        if value is None:
            await channel.reply(_GET, count=1, meta=_MISS)
            return 0
        n = memoryview(value).nbytes
        if n > self.reply_limit:
            n = -1
        total = max(n, 0)
        if not await self.room(total):
            _no_room(channel, total)
            n, total = -1, 0
        try:
            frames = [value] if n > 0 else []
            meta = struct.pack("<q", n) + (bytes([protocol.end_byte(value)]) if n >= 0 else b"")
            del value
            await channel.reply(_GET, count=1, meta=meta, data=frames, data_len=total)
        finally:
            self.budget.release(total)
        return total


# ---- helpers ----


def _no_room(channel: RequestChannel, total: int) -> None:
    log.warning("GET from %s answered with misses: no room for %d reply bytes", channel.conn.peer, total)


def _namespaced(prefix: bytes, keys: Sequence[bytes]) -> list[bytes]:
    return [prefix + k for k in keys]

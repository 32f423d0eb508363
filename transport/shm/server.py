"""The node's side of same-host shared memory (`transport.shm` has the protocol and the security model), in three
parts: this service (the requests: SHM_OPEN, SHM_PUT, SHM_GET, over UCX or a region's channel), the ledger of regions
(`transport.shm.regions`: limits, counting, reclaiming, copies) and the hand-over of descriptors
(`transport.shm.handover`: the Unix socket, its slots and peer credentials); and the node's end of a region's channel
(`NodeChannel`: one request read off it, `transport.stream_node.RequestReader` reading them, their replies written back
whole).

Contract:
* `ShmService(settings, handlers)` belongs to one node's handlers (`transport.shm.host.ShmHost`: its store, budget and
  worker threads; `ems.pool.handlers.NodeHandlers` in a node). `start()` listens on a fresh abstract Unix socket (a
  random name, so no other process can predict it or take it first); `stop()` closes it and reclaims every region.
* `serve(channel, prefix)` answers SHM_OPEN, SHM_PUT and SHM_GET of one authenticated connection (keys in the
  tenant's namespace `prefix`, as every request). SHM_OPEN makes the connection's region (a fresh sealed memfd),
  ending any earlier region of that connection, or answers size 0 (no region: the client uses UCX) when shared memory
  is off, or the node's total (`ShmSettings.total_bytes`) or the tenant's share (`tenant_bytes`) is taken. A data
  request on a connection whose region has not been handed over is malformed.
* Memory, whatever a client does (`shm.regions`): a region counts against the total and against its tenant's share
  from its SHM_OPEN until the node has **reclaimed** it. A region ends when its connection ends (`forget`, which the
  server calls on every path), when a later SHM_OPEN of the connection replaces it, when its token expires
  unpresented (TOKEN_TTL_S: at once, not when the connection ends) and when its token is spent by a refused attempt.
  Once no copy of the node's still runs over an ended region and its populate has stopped, the node punches its pages
  out of the memfd (`ems.buffers.remove_pages`), which frees them in every process that maps it, the client's too,
  then closes its own descriptor and mapping, and only then stops counting it. A client that keeps the descriptor
  maps a file without pages: what it touches again is memory of its own faulting, as in any memfd it could create
  itself, none of the node's. So the pages of all regions the node has made stay within `total_bytes` (and a tenant's
  within its share); the node populates a region only as far as its client asked, never past its size. Should the
  kernel refuse to punch (it never has), the region stays counted for good.
* Hand-over slots (`shm.handover`): a peer of the Unix socket is admitted only when an offered region waits for
  exactly its uid and pid (SO_PEERCRED, read at accept), at most MAX_HANDOVERS at once, and per uid no more at once
  than that uid has regions waiting (nor MAX_HANDOVERS_PER_UID); any other peer is closed at once, taking no slot. A
  process without a key can therefore hold no slot, and a tenant at most as many as it has regions (its share bounds
  those).
* Refusals are counted by reason (`ShmRefusal`, the ledger's `refusals`); `stats()` gives the regions and bytes
  counted and the pages their memfds hold (their allocated blocks, whoever faulted them), for the node's metrics.
  `stats()` may be called from any thread.
* Copies of more than the handlers' `offload_bytes` run on the handlers' worker threads; the node counts the copies
  running over each region (a region is reclaimed only once none runs) and keeps a reference to every value it
  copies, so the store never recycles a buffer under a copy. The bytes a request copies count against the node's
  in-flight budget like a UCX request's, with the same answers: a PUT that cannot get room is refused (BAD_REQUEST,
  the connection closed), a GET's values beyond the room are misses.
* Locks: the ledger's `_fds` guards a counted region's descriptor (`stats` reads them from any thread); everything
  else runs on the node's event loop. A region's channel sends one reply at a time (`sending`, an asyncio lock).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import socket
from typing import Any

import numpy as np

from ems.transport import protocol
from ems.transport.handler import Refusal, RequestChannel
from ems.transport.shm import wire
from ems.transport.shm.handover import Handover
from ems.transport.shm.host import ShmHost
from ems.transport.shm.regions import Region, RegionLedger, RegionState, ShmStats
from ems.transport.stream_node import RequestReader, pack_reply

log = logging.getLogger("ems.pool")


class ShmService:
    """Regions of one node's connections; see the module docstring."""

    def __init__(self, settings: wire.ShmSettings, handlers: ShmHost) -> None:
        self.settings = settings
        self.handlers = handlers
        self.name = b"\0ems-shm-%d-%s" % (os.getpid(), secrets.token_hex(12).encode())
        self.ledger = RegionLedger(settings, handlers)  # the regions, their limits and their reclaiming
        self.handover = Handover(self.ledger, self._serve_channel)  # the descriptors handed to clients

    # ---- life cycle ----

    def start(self) -> None:
        if self.settings.enabled:
            self.handover.start(self.name)

    def stop(self) -> None:
        self.handover.stop()
        self.ledger.reclaim_all()

    def forget(self, conn: Any) -> None:
        """The connection ended (or asks for a new region): its region ends, reclaimed once no copy uses it."""
        self.ledger.forget(conn)

    def stats(self) -> ShmStats:
        """(Any thread.) The regions and bytes counted, the pages their memfds hold, the refusals."""
        return self.ledger.stats()

    # ---- requests ----

    async def serve(self, channel: RequestChannel, prefix: bytes) -> int:
        """Serve one SHM_* request; the value bytes it moved. A request off a region's channel is served over that
        region (the channel names it); one over UCX over its connection's current region."""
        header = channel.header
        if header.data_len:
            raise protocol.ProtocolError("shared-memory requests carry no data frames")
        if header.op == protocol.Op.SHM_OPEN:
            await self._open(channel, wire.decode_open(await channel.meta()), prefix)
            return 0
        region = getattr(channel, "region", None) or self.ledger.regions.get(channel.conn)
        if region is None or region.state is not RegionState.HANDED or region.array is None:
            raise protocol.ProtocolError("a shared-memory request on a connection without a region")
        request = wire.decode_ranged(header.count, await channel.meta(), region.nbytes)
        keys = [prefix + k for k in request.keys]
        if header.op == protocol.Op.SHM_PUT:
            if request.progress is not None:
                raise protocol.ProtocolError("a shared-memory PUT with a progress word")
            return await self._put(channel, region, keys, request)
        return await self._get(channel, region, keys, request)

    async def _open(self, channel: RequestChannel, creds: tuple[int, int], prefix: bytes) -> None:
        conn = channel.conn
        region = None
        if self.handover.listening and not conn.aborted:  # else shared memory off (or the connection ending)
            region = self.ledger.offer(conn, creds, prefix, channel.header.count << 20)
        else:
            self.ledger.forget(conn)  # a connection has one region at a time: an earlier one ends (and is reclaimed)
        if region is None or region.token is None or region.array is None:
            reply = wire.OpenReply(b"\0" * wire.TOKEN_BYTES, 0, os.getpid(), self.name)
        else:
            reply = wire.OpenReply(region.token, region.array.nbytes, os.getpid(), self.name)
        await channel.reply(protocol.Op.SHM_OPEN, meta=wire.encode_open_reply(reply))

    async def _put(self, channel: RequestChannel, region: Region, keys: list[bytes], request: wire.RangedRequest) -> int:
        total = int(request.lens.sum())
        await self.handlers.take(total)  # as a UCX PUT: refused (and the connection closed) when it cannot fit
        try:
            stored = await self.ledger.copy(total, self.handlers.store_copies, region, keys, request)
        finally:
            self.handlers.release(total)
        await channel.reply(protocol.Op.SHM_PUT, count=len(keys), meta=protocol.encode_flags(stored))
        return total

    async def _get(self, channel: RequestChannel, region: Region, keys: list[bytes], request: wire.RangedRequest) -> int:
        values = await self.handlers.lookup_values(keys)  # off the event loop when it may read a disk
        lens = np.fromiter((-1 if v is None else memoryview(v).nbytes for v in values), dtype=np.int64, count=len(values))
        placed = (lens == request.lens) & (lens > 0)
        total = int(lens[placed].sum())
        if not await self.handlers.room(total):
            log.warning("shared-memory GET from %s answered with misses: no room for %d bytes", channel.conn.peer, total)
            lens[:] = -1
            placed[:] = False
            total = 0
        try:
            if total:
                chosen = [(v, o) for v, o, p in zip(values, request.offsets.tolist(), placed.tolist()) if p]
                # the request's leading placed values (the first len(chosen) of them when nothing is missing)
                leading = int(placed.argmin()) if not placed.all() else len(chosen)
                await self.ledger.copy(total, self._place, region, chosen, request.progress, leading)
        finally:
            self.handlers.release(total)
        del values
        await channel.reply(protocol.Op.SHM_GET, count=len(keys), meta=lens.astype("<i8").tobytes())
        return total

    def _place(self, array: np.ndarray, chosen: list[tuple[Any, int]], progress: int | None, leading: int) -> None:
        """Copy each chosen value into the region at its offset, in one call (`NodeStore.read_into`), publishing
        each of the first `leading` to the request's progress word as it lands, if it named one (`transport.shm`)."""
        values = [value for value, _ in chosen]
        outs = [array[offset : offset + memoryview(value).nbytes] for value, offset in chosen]
        address = 0 if progress is None else array.ctypes.data + progress
        self.handlers.read_into(values, outs, address, leading if progress is not None else 0)

    # ---- a region's channel ----

    async def _serve_channel(self, sock: socket.socket, region: Region) -> None:
        """Serve a region's channel until its client closes it, it sends something malformed, a request is
        refused, or the region's connection ends (`forget` cancels this task, which closes the socket: never a
        socket closed under a pending read). An EXISTS is answered here, between two reads (everything it needs is
        in hand and its reply is a few bytes: no task, no loop turn of its own); SHM_GET and SHM_PUT are served
        each as a task of its own, up to `CHANNEL_IN_FLIGHT` at once, and the next request is read only once a slot
        is free (back-pressure on the socket). Replies go out whole, one at a time. A request's task that ends the
        channel (refused, or failed) shuts the socket's reading side, which ends the pending read at once."""
        peer = region.conn.peer
        reader = RequestReader(sock, wire.CHANNEL_OPS)
        slots = asyncio.Semaphore(wire.CHANNEL_IN_FLIGHT)
        sending = asyncio.Lock()
        serving: dict[int, asyncio.Task] = {}  # request id → its task
        ending: list[BaseException | None] = []  # what ended the channel: a request's error, or None (refused)

        def finished(rid: int, task: asyncio.Task) -> None:
            serving.pop(rid, None)
            slots.release()
            if task.cancelled():
                return
            error = task.exception()  # (retrieved whether or not the channel has ended already: never re-raised here)
            if ending or (error is None and task.result() is not False):
                return
            ending.append(error)  # refused (False: the channel ends after its answer) or failed
            try:
                sock.shutdown(socket.SHUT_RD)  # the pending read ends (EOF) at once
            except OSError:
                pass  # (already shut: the client closed it)

        try:
            while region.state is RegionState.HANDED and not ending:
                await slots.acquire()
                if ending:  # (a request's task ended the channel while this waited for a slot ...)
                    break
                request = await reader.next()
                if ending:  # (... or while it waited for the next request: the read then ended at once)
                    break
                if request is None:
                    return
                header, meta = request
                if header.request_id in serving:
                    raise protocol.ProtocolError(f"request id {header.request_id} is already in flight on the channel")
                channel = NodeChannel(sock, header, region.conn, meta, sending, region)
                if header.op == _EXISTS:
                    try:
                        answer = self.handlers.answer_now(header, memoryview(meta), region.prefix)
                    finally:
                        slots.release()
                    await channel.reply(header.op, count=header.count, meta=answer)
                    continue
                task = asyncio.ensure_future(self._serve_one(channel, region))
                serving[header.request_id] = task
                task.add_done_callback(functools.partial(finished, header.request_id))
            if ending and ending[0] is not None:
                raise ending[0]  # a request's failure, handled below
        except protocol.ProtocolError as error:
            log.warning("closing the shared-memory channel of %s: malformed request: %s", peer, error)
        except (OSError, ConnectionError) as error:
            if region.state is RegionState.HANDED:
                log.info("shared-memory channel of %s ended: %r", peer, error)
        finally:
            reader.close()  # (first: nothing below may leave the socket watched, a cancellation during the gather included)
            for task in list(serving.values()):
                task.cancel()
            if serving:
                await asyncio.gather(*serving.values(), return_exceptions=True)
            sock.close()
            if region.channel is sock:
                region.channel = None

    async def _serve_one(self, channel: NodeChannel, region: Region) -> bool:
        """One request off a region's channel; False when it was refused (answered BAD_REQUEST: the channel ends)."""
        try:
            await self.handlers.serve(channel, region.prefix)
        except Refusal as refusal:
            log.warning("refused a shared-memory request from %s: %s", region.conn.peer, refusal)
            await channel.reply(channel.header.op, meta=str(refusal).encode(), status=protocol.Status.BAD_REQUEST)
            return False
        return True


_EXISTS = int(protocol.Op.EXISTS)


class NodeChannel:
    """The node's `RequestChannel` for one request read off a region's channel (`transport.handler.RequestChannel`)."""

    def __init__(
        self, sock: socket.socket, header: protocol.Header, conn: object, meta: bytes, sending: asyncio.Lock, region: object
    ) -> None:
        self.sock = sock
        self.header = header
        self.conn = conn
        self.region = region  # the region this channel belongs to (its requests are served over it, whatever comes later)
        self._meta = meta
        self._sending = sending  # the channel's: one reply's bytes at a time (requests are served at once)

    async def meta(self) -> bytes:
        return self._meta

    def inline_data(self) -> memoryview | None:
        return None

    async def receive_frames(self, views: object, ends: bytes) -> None:
        raise protocol.ProtocolError("shared-memory requests carry no data frames")

    async def reply(
        self,
        op: int,
        *,
        count: int = 0,
        meta: bytes = b"",
        data: object = (),
        data_len: int = 0,
        status: protocol.Status = protocol.Status.OK,
    ) -> None:
        if data or data_len:
            raise protocol.ProtocolError("a shared-memory reply carries no data frames")
        reply = pack_reply(op, self.header.request_id, meta, count, status)
        async with self._sending:
            await asyncio.get_running_loop().sock_sendall(self.sock, reply)

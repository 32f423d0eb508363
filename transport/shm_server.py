"""The node's side of same-host shared memory (`transport/shm.py` has the protocol and the security model).

Contract:
* `ShmService(settings, handlers)` belongs to one node's `NodeHandlers` (its store, budget and worker threads).
  `start()` listens on a fresh abstract Unix socket
  (a random name, so no other process can predict it or take it first); `stop()` closes it and every region.
* `serve(channel, prefix)` answers SHM_OPEN, SHM_PUT and SHM_GET of one authenticated connection (keys in the
  tenant's namespace `prefix`, as every request). SHM_OPEN makes the connection's region (a fresh sealed memfd),
  replacing any earlier one of that connection, or answers size 0 when shared memory is off or the node's total
  (`ShmSettings.total_bytes`) is taken. A data request on a connection without a region is malformed.
* `forget(conn)` drops a connection's region when the connection ends (the server calls it on every path): its
  pending token dies with it, and the memory goes once no copy still uses it (the client's mapping keeps its own
  reference to the pages until it unmaps).
* Copies of more than `node_handlers.OFFLOAD_BYTES` run on the handlers' worker threads; the node keeps a reference to every value
  it copies, so the store never recycles a buffer under a copy. The bytes a request copies count against the
  node's in-flight budget like a UCX request's, with the same answers: a PUT that cannot get room is refused
  (BAD_REQUEST, the connection closed), a GET's values beyond the room are misses.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ems.buffers import populate_in_background
from ems.transport import protocol, shm, shm_channel

if TYPE_CHECKING:
    from ems.transport.node_handlers import NodeHandlers, RequestChannel

log = logging.getLogger("ems.pool")

TOKEN_TTL_S = 10.0  # a token not presented within this long is void
HANDOVER_TIMEOUT_S = 2.0  # a Unix-socket peer must send its token within this long
MAX_HANDOVERS = 64  # Unix-socket peers served at once; more are closed at once


@dataclass(eq=False)
class _Region:
    conn: Any
    fd: int  # -1 once handed over (or closed)
    array: np.ndarray
    uid: int
    pid: int
    token: bytes | None
    expires: float
    closing: bool = False
    populate_bytes: int = 0  # what the client stated it populates (SHM_OPEN's count, in MiB)
    prefix: bytes = b""  # the connection's tenant namespace (its channel's requests are served under it)
    channel: socket.socket | None = None  # the hand-over socket, kept as the region's request channel ...
    channel_task: asyncio.Task | None = None  # ... and the task serving it

    def close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ShmService:
    """Regions of one node's connections; see the module docstring."""

    def __init__(self, settings: shm.ShmSettings, handlers: NodeHandlers) -> None:
        self.settings = settings
        self.handlers = handlers
        self.name = b"\0ems-shm-%d-%s" % (os.getpid(), secrets.token_hex(12).encode())
        self._regions: dict[Any, _Region] = {}  # connection -> its region
        self._tokens: dict[bytes, _Region] = {}
        self._bytes = 0
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._handovers: set[asyncio.Task] = set()
        self._channels: set[asyncio.Task] = set()  # one per region whose client kept its hand-over socket

    # ---- life cycle ----

    def start(self) -> None:
        if not self.settings.enabled:
            return
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(self.name)
            listener.listen(64)
            listener.setblocking(False)
        except OSError as error:
            listener.close()
            log.warning("shared memory off: cannot listen on a Unix socket: %s", error)
            return
        self._listener = listener
        self._accepting = asyncio.ensure_future(self._accept())

    def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        for task in list(self._handovers) + list(self._channels):
            task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for conn in list(self._regions):
            self.forget(conn)

    def forget(self, conn: Any) -> None:
        region = self._regions.pop(conn, None)
        if region is None:
            return
        if region.token is not None:
            self._tokens.pop(region.token, None)
            region.token = None
        region.close_fd()
        region.closing = True
        if region.channel_task is not None:  # (cancelled, it closes the socket: never closed under a pending read)
            region.channel_task.cancel()
        elif region.channel is not None:
            region.channel.close()
        region.channel = None
        self._bytes -= region.array.nbytes

    # ---- requests ----

    async def serve(self, channel: RequestChannel, prefix: bytes) -> int:
        """Serve one SHM_* request; the value bytes it moved."""
        header = channel.header
        if header.data_len:
            raise protocol.ProtocolError("shared-memory requests carry no data frames")
        if header.op == protocol.Op.SHM_OPEN:
            await self._open(channel, shm.decode_open(await channel.meta()), prefix)
            return 0
        region = self._regions.get(channel.conn)
        if region is None:
            raise protocol.ProtocolError("a shared-memory request on a connection without a region")
        request = shm.decode_ranged(header.count, await channel.meta(), region.array.nbytes)
        keys = [prefix + k for k in request.keys]
        if header.op == protocol.Op.SHM_PUT:
            if request.progress is not None:
                raise protocol.ProtocolError("a shared-memory PUT with a progress word")
            return await self._put(channel, region, keys, request)
        return await self._get(channel, region, keys, request)

    async def _open(self, channel: RequestChannel, creds: tuple[int, int], prefix: bytes) -> None:
        conn = channel.conn
        self.forget(conn)  # a connection has at most one region
        size = self.settings.region_bytes
        reply = shm.OpenReply(b"\0" * shm.TOKEN_BYTES, 0, os.getpid(), self.name)
        if self._listener is not None and self._bytes + size <= self.settings.total_bytes and not conn.aborted:
            try:
                fd = shm.create_region(size)
                array = shm.map_region(fd, os.fstat(fd).st_size)
            except OSError as error:
                log.warning("no shared-memory region for %s: %s", conn.peer, error)
            else:
                token = secrets.token_bytes(shm.TOKEN_BYTES)
                region = _Region(conn, fd, array, creds[0], creds[1], token, time.monotonic() + TOKEN_TTL_S)
                region.populate_bytes = channel.header.count << 20  # see shm.py; done once the client has mapped it
                region.prefix = prefix
                self._regions[conn] = region
                self._tokens[token] = region
                self._bytes += array.nbytes
                reply = shm.OpenReply(token, array.nbytes, os.getpid(), self.name)
        await channel.reply(protocol.Op.SHM_OPEN, meta=shm.encode_open_reply(reply))

    async def _put(self, channel: RequestChannel, region: _Region, keys: list[bytes], request: shm.RangedRequest) -> int:
        total = int(request.lens.sum())
        await self.handlers.take(total)  # as a UCX PUT: refused (and the connection closed) when it cannot fit
        try:
            stored = await self._copy(total, self._store, region, keys, request)
        finally:
            self.handlers.budget.release(total)
        await channel.reply(protocol.Op.SHM_PUT, count=len(keys), meta=protocol.encode_flags(stored))
        return total

    def _store(self, region: _Region, keys: list[bytes], request: shm.RangedRequest) -> list[bool]:
        """Copy each value out of the region into a buffer of the store's and store it, copy and check in one pass
        (`NodeStore.put_copied_each`: the copies are checked, never the region, which the client can still write)."""
        store = self.handlers.store
        fits: list[int] = []  # the values the store can hold at all
        buffers: list[np.ndarray] = []
        sources: list[np.ndarray] = []
        charges: list[int] = []
        try:
            for i, (key, offset, n) in enumerate(zip(keys, request.offsets.tolist(), request.lens.tolist())):
                charge = store.charge_of(len(key), n)
                if charge > store.capacity_bytes:
                    continue
                buffers.append(store.allocate(n, reserve=charge))
                charges.append(charge)
                sources.append(region.array[offset : offset + n])
                fits.append(i)
            verdicts = store.put_copied_each([keys[i] for i in fits], buffers, sources, charges)
        except BaseException:
            for buffer, charge in zip(buffers, charges):
                store.recycle(buffer, reserved=charge)
            raise
        stored = [False] * len(keys)
        for i, ok in zip(fits, verdicts):
            stored[i] = ok
        refused = [b for b, ok in zip(buffers, (stored[i] for i in fits)) if not ok]  # for the metrics: maybe damaged
        if refused and self.handlers.metrics is not None:
            self.handlers.metrics.count_damaged(refused, [False] * len(refused))
        return stored

    async def _get(self, channel: RequestChannel, region: _Region, keys: list[bytes], request: shm.RangedRequest) -> int:
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
                await self._copy(total, self._place, region, chosen, request.progress, leading)
        finally:
            self.handlers.budget.release(total)
        del values
        await channel.reply(protocol.Op.SHM_GET, count=len(keys), meta=lens.astype("<i8").tobytes())
        return total

    def _place(self, region: _Region, chosen: list[tuple[Any, int]], progress: int | None, leading: int) -> None:
        """Copy each chosen value into the region at its offset, in one call (`NodeStore.read_into`), publishing
        each of the first `leading` to the request's progress word as it lands, if it named one (`shm.py`)."""
        values = [value for value, _ in chosen]
        outs = [region.array[offset : offset + memoryview(value).nbytes] for value, offset in chosen]
        address = 0 if progress is None else region.array.ctypes.data + progress
        self.handlers.store.read_into(values, outs, address, leading if progress is not None else 0)

    async def _copy(self, nbytes: int, fn: Any, region: _Region, *args: Any) -> Any:
        """Run a copy over `region` on the loop (small) or a worker thread (large); the region's mapping is
        referenced until the copy has ended, whatever happens to the connection meanwhile."""
        return await self.handlers.offload(nbytes, fn, region, *args)

    # ---- handing the descriptor over ----

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        listener = self._listener
        while listener is not None:
            try:
                sock, _ = await loop.sock_accept(listener)
            except asyncio.CancelledError:
                raise
            except OSError as error:  # e.g. out of descriptors: wait, then accept again
                log.warning("shared-memory socket: %s", error)
                await asyncio.sleep(0.1)
                continue
            if len(self._handovers) >= MAX_HANDOVERS:
                sock.close()
                continue
            task = asyncio.ensure_future(self._hand_over(sock))
            self._handovers.add(task)
            task.add_done_callback(self._handovers.discard)

    async def _hand_over(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        kept = False  # the socket became the region's channel
        try:
            sock.setblocking(False)
            token = b""
            deadline = time.monotonic() + HANDOVER_TIMEOUT_S
            while len(token) < shm.TOKEN_BYTES:
                chunk = await asyncio.wait_for(
                    loop.sock_recv(sock, shm.TOKEN_BYTES - len(token)), max(0.0, deadline - time.monotonic())
                )
                if not chunk:
                    return
                token += chunk
            region = self._tokens.pop(token, None)  # spent by the first attempt, right or wrong
            pid, uid = shm.peer_credentials(sock)
            if region is not None:
                region.token = None
            reason = _refusal(region, pid, uid)
            if reason is not None or region is None:
                log.warning("refused a shared-memory mapping (pid %d, uid %d): %s", pid, uid, reason)
                sock.send(b"\0")
                return
            socket.send_fds(sock, [b"\1"], [region.fd])
            region.close_fd()  # the client has its own descriptor now; the node keeps its mapping
            # as much of the node's mapping as the client populates of its own (shm.py): only now that a client
            # holds the region, so that a connection which only asks for one commits no memory
            populate_in_background(region.array, region.populate_bytes, "ems-shm-prefault")
            # the socket stays open as the region's request channel (shm_channel.py)
            region.channel, kept = sock, True
            task = region.channel_task = asyncio.ensure_future(self._serve_channel(sock, region))
            self._channels.add(task)
            task.add_done_callback(self._channels.discard)
        except (OSError, asyncio.TimeoutError) as error:
            log.info("shared-memory hand-over failed: %r", error)
        finally:
            if not kept:
                sock.close()

    async def _serve_channel(self, sock: socket.socket, region: _Region) -> None:
        """Serve a region's channel until its client closes it, it sends something malformed, a request is
        refused, or the region's connection ends (`forget` cancels this task, which closes the socket: never a
        socket closed under a pending read). Up to `CHANNEL_IN_FLIGHT` requests are served at once, each as a
        task of its own; the next request is read only once a slot is free (back-pressure on the socket), and
        replies go out whole, one at a time."""
        peer = region.conn.peer
        slots = asyncio.Semaphore(shm_channel.CHANNEL_IN_FLIGHT)
        sending = asyncio.Lock()
        serving: dict[int, asyncio.Task] = {}  # request id → its task
        ended: asyncio.Future = asyncio.get_running_loop().create_future()  # a request's task ends the channel
        reading: asyncio.Future | None = None

        def finished(rid: int, task: asyncio.Task) -> None:
            serving.pop(rid, None)
            slots.release()
            if not task.cancelled() and task.exception() is not None and not ended.done():
                ended.set_exception(task.exception())  # type: ignore[arg-type]
            elif not task.cancelled() and task.result() is False and not ended.done():
                ended.set_result(None)  # refused: the channel ends after its answer

        try:
            while not region.closing and not ended.done():
                await slots.acquire()
                reading = asyncio.ensure_future(shm_channel.read_request(sock))
                await asyncio.wait([reading, ended], return_when=asyncio.FIRST_COMPLETED)
                if not reading.done():  # a request's task ended the channel meanwhile
                    reading.cancel()
                    break
                request = reading.result()
                if request is None:
                    return
                header, meta = request
                if header.request_id in serving:
                    raise protocol.ProtocolError(f"request id {header.request_id} is already in flight on the channel")
                channel = shm_channel.NodeChannel(sock, header, region.conn, meta, sending)
                task = asyncio.ensure_future(self._serve_one(channel, region))
                serving[header.request_id] = task
                task.add_done_callback(functools.partial(finished, header.request_id))
            if ended.done():
                ended.result()  # a request's failure, raised here
        except protocol.ProtocolError as error:
            log.warning("closing the shared-memory channel of %s: malformed request: %s", peer, error)
        except (OSError, ConnectionError) as error:
            if not region.closing:
                log.info("shared-memory channel of %s ended: %r", peer, error)
        finally:
            if reading is not None:
                reading.cancel()
            for task in list(serving.values()):
                task.cancel()
            if serving:
                await asyncio.gather(*serving.values(), return_exceptions=True)
            if ended.done() and not ended.cancelled():
                ended.exception()  # (retrieved: asyncio would log it as never retrieved)
            sock.close()
            if region.channel is sock:
                region.channel = None

    async def _serve_one(self, channel: shm_channel.NodeChannel, region: _Region) -> bool:
        """One request off a region's channel; False when it was refused (answered BAD_REQUEST: the channel ends)."""
        from ems.transport.node_handlers import Refusal  # (node_handlers imports this module)

        try:
            await self.handlers.serve(channel, region.prefix)
        except Refusal as refusal:
            log.warning("refused a shared-memory request from %s: %s", region.conn.peer, refusal)
            await channel.reply(channel.header.op, meta=str(refusal).encode(), status=protocol.Status.BAD_REQUEST)
            return False
        return True


def _refusal(region: _Region | None, pid: int, uid: int) -> str | None:
    if region is None:
        return "unknown or spent token"
    if region.closing or region.conn.aborted:
        return "its connection has ended"
    if time.monotonic() > region.expires:
        return "token expired"
    if uid != region.uid or pid != region.pid:
        return f"not the process the connection named (pid {region.pid}, uid {region.uid})"
    return None

"""The node's side of same-host shared memory (`transport/shm.py` has the protocol and the security model).

Contract:
* `ShmService(settings, handlers)` belongs to one node's `NodeHandlers` (its store, budget and worker threads).
  `start()` listens on a fresh abstract Unix socket (a random name, so no other process can predict it or take it
  first); `stop()` closes it and reclaims every region.
* `serve(channel, prefix)` answers SHM_OPEN, SHM_PUT and SHM_GET of one authenticated connection (keys in the
  tenant's namespace `prefix`, as every request). SHM_OPEN makes the connection's region (a fresh sealed memfd),
  ending any earlier region of that connection, or answers size 0 (no region: the client uses UCX) when shared
  memory is off, or the node's total (`ShmSettings.total_bytes`) or the tenant's share (`tenant_bytes`) is taken.
  A data request on a connection whose region has not been handed over is malformed.
* Memory, whatever a client does: a region counts against the total and against its tenant's share from its
  SHM_OPEN until the node has **reclaimed** it. A region ends when its connection ends (`forget`, which the server
  calls on every path), when a later SHM_OPEN of the connection replaces it, when its token expires unpresented
  (TOKEN_TTL_S: at once, not when the connection ends) and when its token is spent by a refused attempt. Once no
  copy of the node's still runs over an ended region and its populate has stopped, the node punches its pages out
  of the memfd (`ems.buffers.remove_pages`), which frees them in every process that maps it, the client's too,
  then closes its own descriptor and mapping, and only then stops counting it. A client that keeps the descriptor
  maps a file without pages: what it touches again is memory of its own faulting, as in any memfd it could create
  itself, none of the node's. So the pages of all regions the node has made stay within `total_bytes` (and a
  tenant's within its share); the node populates a region only as far as its client asked, never past its size.
  Should the kernel refuse to punch (it never has), the region stays counted for good.
* Hand-over slots: a peer of the Unix socket is admitted only when an offered region waits for exactly its uid and
  pid (SO_PEERCRED, read at accept), at most MAX_HANDOVERS at once, and per uid no more at once than that uid has
  regions waiting (nor MAX_HANDOVERS_PER_UID); any other peer is closed at once, taking no slot. A process without
  a key can therefore hold no slot, and a tenant at most as many as it has regions (its share bounds those).
* Refusals are counted by reason (`ShmRefusal`, `refusals`); `stats()` gives the regions and bytes counted and the
  pages their memfds hold (their allocated blocks, whoever faulted them), for the node's metrics. `stats()` may be
  called from any thread.
* Copies of more than `node_handlers.OFFLOAD_BYTES` run on the handlers' worker threads; the node counts the copies
  running over each region (a region is reclaimed only once none runs) and keeps a reference to every value it
  copies, so the store never recycles a buffer under a copy. The bytes a request copies count against the node's
  in-flight budget like a UCX request's, with the same answers: a PUT that cannot get room is refused
  (BAD_REQUEST, the connection closed), a GET's values beyond the room are misses.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ems.buffers import populate_in_background, remove_pages
from ems.transport import protocol, shm, shm_channel

if TYPE_CHECKING:
    from ems.transport.node_handlers import NodeHandlers, RequestChannel

log = logging.getLogger("ems.pool")

TOKEN_TTL_S = 10.0  # a token not presented within this long is void, and its region reclaimed
HANDOVER_TIMEOUT_S = 2.0  # a Unix-socket peer must send its token within this long
MAX_HANDOVERS = 64  # Unix-socket peers served at once; more are closed at once
MAX_HANDOVERS_PER_UID = 8  # ... of one uid (and never more than the regions waiting for that uid)
_LISTEN_BACKLOG = 512  # peers the kernel queues for accept (the node closes unexpected ones at once)


class RegionState(enum.Enum):
    OFFERED = "offered"  # its token is out; only the node holds its descriptor
    HANDED = "handed"  # its client holds the descriptor; its requests are served
    ENDING = "ending"  # ended: reclaimed once no copy of the node's runs over it
    RECLAIMED = "reclaimed"  # its pages punched out, the node's descriptor and mapping gone; no longer counted


class ShmRefusal(str, enum.Enum):
    """Why a region or a hand-over was refused: the `reason` of `ems_pool_shm_refusals_total`."""

    TOTAL = "total"  # SHM_OPEN: --shm-total taken
    TENANT = "tenant"  # SHM_OPEN: the tenant's share (--shm-tenant) taken
    UNEXPECTED_PEER = "unexpected_peer"  # a socket peer for whose uid and pid no region waits (closed at accept)
    SLOTS = "slots"  # every hand-over slot taken
    UID_SLOTS = "uid_slots"  # as many hand-overs of the peer's uid under way as regions wait for it (or the cap)
    TOKEN = "token"  # an unknown or spent token
    CREDENTIALS = "credentials"  # a token presented by another pid or uid than its connection stated
    ENDED = "ended"  # the token's region ended (its connection closed, or replaced it) before the hand-over
    EXPIRED = "expired"  # a token not presented within TOKEN_TTL_S (its region reclaimed then)
    FAILED = "failed"  # the hand-over itself failed (the peer left, sent too little, or timed out)


@dataclass(frozen=True)
class ShmStats:
    """What a node's shared memory holds now (`ShmService.stats`)."""

    regions: int  # counted: offered, handed over, or ended and not yet reclaimed
    handed: int  # of which handed over to their clients
    bytes: int  # the regions counted, in bytes (what --shm-total bounds)
    resident_bytes: int  # the pages their memfds hold, whoever faulted them in
    total_bytes: int  # --shm-total
    refusals: dict[str, int]  # by `ShmRefusal` value, since start


@dataclass(eq=False)
class _Region:
    conn: Any
    fd: int  # the node's own descriptor of the memfd, until reclaimed (-1 after)
    array: np.ndarray | None  # the node's mapping, until reclaimed
    nbytes: int
    uid: int
    pid: int
    prefix: bytes  # the connection's tenant namespace (its channel's requests are served under it)
    token: bytes | None
    expires: float
    populate_bytes: int = 0  # what the client stated it populates (SHM_OPEN's count, in MiB), at most nbytes
    state: RegionState = RegionState.OFFERED
    handed: bool = False  # its descriptor left the node (its pages must be punched out, not only unmapped)
    copies: int = 0  # copies of the node's running over it
    expiry: asyncio.TimerHandle | None = None
    populate: threading.Thread | None = None
    populate_stop: threading.Event = field(default_factory=threading.Event)
    channel: socket.socket | None = None  # the hand-over socket, kept as the region's request channel ...
    channel_task: asyncio.Task | None = None  # ... and the task serving it


class ShmService:
    """Regions of one node's connections; see the module docstring."""

    def __init__(self, settings: shm.ShmSettings, handlers: NodeHandlers) -> None:
        from ems.transport.node_handlers import OFFLOAD_BYTES  # (node_handlers imports this module)

        self.settings = settings
        self.handlers = handlers
        self.name = b"\0ems-shm-%d-%s" % (os.getpid(), secrets.token_hex(12).encode())
        self.refusals: Counter[ShmRefusal] = Counter()
        self._offload_bytes = OFFLOAD_BYTES
        self._regions: dict[Any, _Region] = {}  # connection -> its current region (offered or handed over)
        self._tokens: dict[bytes, _Region] = {}  # the tokens out: regions waiting for their client
        self._counted: set[_Region] = set()  # every region not yet reclaimed
        self._bytes = 0
        self._tenant_bytes: Counter[bytes] = Counter()
        self._handing: Counter[int] = Counter()  # hand-overs under way, by the peer's uid
        self._stopping = False
        self._fds = threading.Lock()  # a counted region's descriptor is closed under it (`stats` reads them)
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
            listener.listen(_LISTEN_BACKLOG)
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
        self._stopping = True  # regions are reclaimed here and now, not on the worker threads
        for conn in list(self._regions):
            self.forget(conn)
        for region in list(self._counted):  # the node is stopping: what its copies still hold goes too
            self._punch(region)
            self._uncount(region)

    def forget(self, conn: Any) -> None:
        """The connection ended (or asks for a new region): its region ends, reclaimed once no copy uses it."""
        region = self._regions.pop(conn, None)
        if region is not None:
            self._end(region)

    def stats(self) -> ShmStats:
        with self._fds:
            regions = tuple(self._counted)
            resident = 0
            for region in regions:
                if region.fd >= 0:
                    resident += os.fstat(region.fd).st_blocks * 512
        return ShmStats(
            regions=len(regions),
            handed=sum(1 for r in regions if r.state is RegionState.HANDED),
            bytes=sum(r.nbytes for r in regions),
            resident_bytes=resident,
            total_bytes=self.settings.total_bytes,
            refusals={reason.value: n for reason, n in self.refusals.items()},
        )

    def _refuse(self, reason: ShmRefusal, message: str, *args: Any) -> None:
        self.refusals[reason] += 1
        log.warning("shared memory refused (%s): " + message, reason.value, *args)

    # ---- a region's life ----

    def _end(self, region: _Region) -> None:
        """No request is served over `region` from now on; it is reclaimed once no copy of the node's runs over it."""
        if region.state in (RegionState.ENDING, RegionState.RECLAIMED):
            return
        if self._regions.get(region.conn) is region:
            del self._regions[region.conn]
        if region.token is not None:
            self._tokens.pop(region.token, None)
            region.token = None
        if region.expiry is not None:
            region.expiry.cancel()
            region.expiry = None
        region.state = RegionState.ENDING
        region.populate_stop.set()
        if region.channel_task is not None:  # (cancelled, it closes the socket: never closed under a pending read)
            region.channel_task.cancel()
        elif region.channel is not None:
            region.channel.close()
        region.channel = None
        if region.copies == 0:
            self._reclaim(region)

    def _reclaim(self, region: _Region) -> None:
        """Free an ended region's pages everywhere and stop counting it: at once for a region never handed over (no
        other process holds it, no populate ran), else on a worker thread (the populate may take a step to stop,
        and freeing a populated region's pages takes a while)."""
        if not region.handed or self._stopping:
            self._punch(region)
            self._uncount(region)
            return
        loop = asyncio.get_running_loop()

        def punch() -> None:
            self._punch(region)
            loop.call_soon_threadsafe(self._uncount, region)

        try:
            self.handlers.executor.submit(punch)
        except RuntimeError:  # the worker threads are gone (the node is stopping)
            self._punch(region)
            self._uncount(region)

    def _punch(self, region: _Region) -> None:
        """(Any thread.) Stop the populate, free the region's pages in the memfd itself (every process mapping it
        loses them), close the node's descriptor."""
        if region.populate is not None:
            region.populate.join()  # (stopped: at most one step)
        array = region.array
        if region.handed and array is not None and not remove_pages(int(array.ctypes.data), region.nbytes):
            log.error("could not free a shared-memory region's pages (MADV_REMOVE refused): it stays counted")
            return
        with self._fds:
            if region.fd >= 0:
                os.close(region.fd)
                region.fd = -1

    def _uncount(self, region: _Region) -> None:
        if region.fd >= 0 or region not in self._counted:  # (not punched: it stays counted)
            return
        region.state = RegionState.RECLAIMED
        region.array = None  # the mapping goes once no view of it is held any more (it holds no pages now)
        region.populate = None
        self._counted.discard(region)
        self._bytes -= region.nbytes
        self._tenant_bytes[region.prefix] -= region.nbytes
        if self._tenant_bytes[region.prefix] <= 0:
            del self._tenant_bytes[region.prefix]

    def _expire(self, region: _Region) -> None:
        region.expiry = None
        if region.state is RegionState.OFFERED and region.token is not None:
            self._refuse(ShmRefusal.EXPIRED, "a token of %s not presented within %s s", region.conn.peer, TOKEN_TTL_S)
            self._end(region)

    # ---- requests ----

    async def serve(self, channel: RequestChannel, prefix: bytes) -> int:
        """Serve one SHM_* request; the value bytes it moved. A request off a region's channel is served over that
        region (the channel names it); one over UCX over its connection's current region."""
        header = channel.header
        if header.data_len:
            raise protocol.ProtocolError("shared-memory requests carry no data frames")
        if header.op == protocol.Op.SHM_OPEN:
            await self._open(channel, shm.decode_open(await channel.meta()), prefix)
            return 0
        region = getattr(channel, "region", None) or self._regions.get(channel.conn)
        if region is None or region.state is not RegionState.HANDED or region.array is None:
            raise protocol.ProtocolError("a shared-memory request on a connection without a region")
        request = shm.decode_ranged(header.count, await channel.meta(), region.nbytes)
        keys = [prefix + k for k in request.keys]
        if header.op == protocol.Op.SHM_PUT:
            if request.progress is not None:
                raise protocol.ProtocolError("a shared-memory PUT with a progress word")
            return await self._put(channel, region, keys, request)
        return await self._get(channel, region, keys, request)

    async def _open(self, channel: RequestChannel, creds: tuple[int, int], prefix: bytes) -> None:
        conn = channel.conn
        self.forget(conn)  # a connection has one region at a time: an earlier one ends (and is reclaimed)
        size = self.settings.region_bytes
        reply = shm.OpenReply(b"\0" * shm.TOKEN_BYTES, 0, os.getpid(), self.name)
        share = self.settings.tenant_share
        if self._listener is None or conn.aborted:
            pass  # shared memory off (or the connection ending): no region, nothing refused
        elif self._bytes + size > self.settings.total_bytes:
            self._refuse(
                ShmRefusal.TOTAL, "no region for %s: %d of %d bytes taken", conn.peer, self._bytes, self.settings.total_bytes
            )
        elif self._tenant_bytes[prefix] + size > share:
            self._refuse(
                ShmRefusal.TENANT,
                "no region for %s: its tenant holds %d of its %d bytes",
                conn.peer,
                self._tenant_bytes[prefix],
                share,
            )
        else:
            try:
                fd = shm.create_region(size)
            except OSError as error:
                log.warning("no shared-memory region for %s: %s", conn.peer, error)
            else:
                try:
                    array = shm.map_region(fd, os.fstat(fd).st_size)
                except BaseException:
                    os.close(fd)
                    raise
                token = secrets.token_bytes(shm.TOKEN_BYTES)
                region = _Region(conn, fd, array, array.nbytes, creds[0], creds[1], prefix, token, time.monotonic() + TOKEN_TTL_S)
                # the client's stated populate (shm.py), never past the region; done once the client has mapped it
                region.populate_bytes = min(channel.header.count << 20, array.nbytes)
                self._regions[conn] = region
                self._tokens[token] = region
                self._counted.add(region)
                self._bytes += array.nbytes
                self._tenant_bytes[prefix] += array.nbytes
                region.expiry = asyncio.get_running_loop().call_later(TOKEN_TTL_S, self._expire, region)
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

    def _store(self, array: np.ndarray, keys: list[bytes], request: shm.RangedRequest) -> list[bool]:
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
                sources.append(array[offset : offset + n])
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

    def _place(self, array: np.ndarray, chosen: list[tuple[Any, int]], progress: int | None, leading: int) -> None:
        """Copy each chosen value into the region at its offset, in one call (`NodeStore.read_into`), publishing
        each of the first `leading` to the request's progress word as it lands, if it named one (`shm.py`)."""
        values = [value for value, _ in chosen]
        outs = [array[offset : offset + memoryview(value).nbytes] for value, offset in chosen]
        address = 0 if progress is None else array.ctypes.data + progress
        self.handlers.store.read_into(values, outs, address, leading if progress is not None else 0)

    async def _copy(self, nbytes: int, fn: Any, region: _Region, *args: Any) -> Any:
        """`fn(region's mapping, *args)`: on the loop (small) or a worker thread (large). The copy is counted on the
        region from before it starts until it has returned, on its thread too (a cancelled await does not stop a
        thread), so the region is never reclaimed under it. A region that ended meanwhile is not copied over."""
        if region.state is not RegionState.HANDED or region.array is None:
            raise protocol.ProtocolError("the shared-memory region ended (replaced by a later SHM_OPEN)")
        region.copies += 1
        if nbytes <= self._offload_bytes:
            try:
                return fn(region.array, *args)
            finally:
                self._copy_ended(region)
        loop = asyncio.get_running_loop()
        try:
            future = self.handlers.executor.submit(fn, region.array, *args)
        except BaseException:
            self._copy_ended(region)
            raise
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._copy_ended, region))
        return await asyncio.wrap_future(future)

    def _copy_ended(self, region: _Region) -> None:
        region.copies -= 1
        if region.copies == 0 and region.state is RegionState.ENDING:
            self._reclaim(region)

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
            try:
                pid, uid = shm.peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            refusal = self._admit(pid, uid)
            if refusal is not None:
                self.refusals[refusal] += 1
                log.info("closed a shared-memory socket peer (pid %d, uid %d): %s", pid, uid, refusal.value)
                sock.close()
                continue
            self._handing[uid] += 1
            task = asyncio.ensure_future(self._hand_over(sock, pid, uid))
            self._handovers.add(task)
            task.add_done_callback(self._handovers.discard)

    def _admit(self, pid: int, uid: int) -> ShmRefusal | None:
        """Whether a peer just accepted may take a hand-over slot (see the module docstring)."""
        if len(self._handovers) >= MAX_HANDOVERS:
            return ShmRefusal.SLOTS
        waiting = [r for r in self._tokens.values() if r.uid == uid]
        if not any(r.pid == pid for r in waiting):
            return ShmRefusal.UNEXPECTED_PEER
        if self._handing[uid] >= min(len(waiting), MAX_HANDOVERS_PER_UID):
            return ShmRefusal.UID_SLOTS
        return None

    async def _hand_over(self, sock: socket.socket, pid: int, uid: int) -> None:
        loop = asyncio.get_running_loop()
        kept = False  # the socket became the region's channel
        spent: _Region | None = None  # the region whose token this peer presented
        slot = [uid]  # the hand-over slot this peer holds, given back before its answer goes out (once)

        def free_slot() -> None:
            if slot:
                self._handing[slot.pop()] -= 1
                if self._handing[uid] <= 0:
                    del self._handing[uid]

        try:
            sock.setblocking(False)
            token = b""
            deadline = time.monotonic() + HANDOVER_TIMEOUT_S
            while len(token) < shm.TOKEN_BYTES:
                chunk = await asyncio.wait_for(
                    loop.sock_recv(sock, shm.TOKEN_BYTES - len(token)), max(0.0, deadline - time.monotonic())
                )
                if not chunk:
                    self.refusals[ShmRefusal.FAILED] += 1
                    return
                token += chunk
            spent = region = self._tokens.pop(token, None)  # spent by the first attempt, right or wrong
            if region is not None:
                region.token = None
            refusal = _refusal(region, pid, uid)
            free_slot()  # (before the answer: a peer answered may come back at once)
            if refusal is not None or region is None:
                self._refuse(refusal or ShmRefusal.TOKEN, "a mapping for pid %d, uid %d", pid, uid)
                sock.send(b"\0")
                return
            socket.send_fds(sock, [b"\1"], [region.fd])
            spent = None
            region.handed = True
            region.state = RegionState.HANDED
            if region.expiry is not None:
                region.expiry.cancel()
                region.expiry = None
            # as much of the node's mapping as the client populates of its own (shm.py): only now that a client
            # holds the region, so that a connection which only asks for one commits no memory
            if region.array is not None:
                region.populate = populate_in_background(
                    region.array, region.populate_bytes, "ems-shm-prefault", region.populate_stop
                )
            # the socket stays open as the region's request channel (shm_channel.py)
            region.channel, kept = sock, True
            task = region.channel_task = asyncio.ensure_future(self._serve_channel(sock, region))
            self._channels.add(task)
            task.add_done_callback(self._channels.discard)
        except (OSError, asyncio.TimeoutError) as error:
            self.refusals[ShmRefusal.FAILED] += 1
            log.info("shared-memory hand-over failed: %r", error)
        finally:
            free_slot()
            if spent is not None and spent.state is RegionState.OFFERED:
                self._end(spent)  # its token is spent: nobody can map it any more, it goes now
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
            while region.state is RegionState.HANDED and not ended.done():
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
                channel = shm_channel.NodeChannel(sock, header, region.conn, meta, sending, region)
                task = asyncio.ensure_future(self._serve_one(channel, region))
                serving[header.request_id] = task
                task.add_done_callback(functools.partial(finished, header.request_id))
            if ended.done():
                ended.result()  # a request's failure, raised here
        except protocol.ProtocolError as error:
            log.warning("closing the shared-memory channel of %s: malformed request: %s", peer, error)
        except (OSError, ConnectionError) as error:
            if region.state is RegionState.HANDED:
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


def _refusal(region: _Region | None, pid: int, uid: int) -> ShmRefusal | None:
    if region is None:
        return ShmRefusal.TOKEN
    if region.state is not RegionState.OFFERED or region.conn.aborted:
        return ShmRefusal.ENDED
    if time.monotonic() > region.expires:
        return ShmRefusal.EXPIRED
    if uid != region.uid or pid != region.pid:
        return ShmRefusal.CREDENTIALS
    return None

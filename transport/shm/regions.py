"""The node's ledger of same-host shared-memory regions (`transport.shm.server`; `transport.shm` has the protocol and
the security model): what each region is, what it counts against, and when it is reclaimed.

Contract:
* `RegionLedger.offer(conn, creds, prefix, populate_bytes)` makes a connection's region (a fresh sealed memfd),
  ending any earlier region of that connection, with a token out for TOKEN_TTL_S; or None when the node's total
  (`ShmSettings.total_bytes`) or the tenant's share (`tenant_bytes`) is taken (a refusal counted, by reason).
* A region counts against the total and its tenant's share from its offer until it is **reclaimed**. It ends
  (`end`) when its connection ends (`forget`), when a later offer of the connection replaces it, when its token
  expires unpresented (TOKEN_TTL_S, at once) and when its token is spent by a refused attempt. Once no copy of the
  node's runs over an ended region (`copy` counts them, on their threads too) and its populate has stopped, its
  pages are punched out of the memfd (`ems.buffers.remove_pages`: freed in every process that maps it), then the
  node's descriptor and mapping go, and only then does it stop counting. Should the kernel refuse to punch, the
  region stays counted for good.
* `copy(nbytes, fn, region, ...)` runs `fn(region's mapping, ...)` on the loop or, above the host's
  `offload_bytes`, on its worker threads; never over a region that is no longer handed over.
* `stats()` (any thread) gives the regions and bytes counted, the pages their memfds hold, and the refusals.
* Locks: `_fds` guards a counted region's descriptor (closed under it; `stats` reads them from any thread).
  Everything else runs on the node's event loop, except `_punch`, which runs on a worker thread for a region that
  was handed over and touches only that region (its populate thread, pages and descriptor).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ems.buffers import remove_pages
from ems.transport import protocol
from ems.transport.shm import wire
from ems.transport.shm.host import ShmHost

log = logging.getLogger("ems.pool")

TOKEN_TTL_S = 10.0  # a token not presented within this long is void, and its region reclaimed


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
class Region:
    """One connection's region (`RegionLedger`); its state changes on the event loop only."""

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


class RegionLedger:
    """The regions of one node's connections and what they count; see the module docstring."""

    def __init__(self, settings: wire.ShmSettings, host: ShmHost) -> None:
        self.settings = settings
        self.host = host
        self.refusals: Counter[ShmRefusal] = Counter()
        self.regions: dict[Any, Region] = {}  # connection -> its current region (offered or handed over)
        self.tokens: dict[bytes, Region] = {}  # the tokens out: regions waiting for their client
        self._counted: set[Region] = set()  # every region not yet reclaimed
        self._bytes = 0
        self._tenant_bytes: Counter[bytes] = Counter()
        self.stopping = False
        self._fds = threading.Lock()  # a counted region's descriptor is closed under it (`stats` reads them)

    def forget(self, conn: Any) -> None:
        """The connection ended (or asks for a new region): its region ends, reclaimed once no copy uses it."""
        region = self.regions.pop(conn, None)
        if region is not None:
            self.end(region)

    def reclaim_all(self) -> None:
        """The node stops: every region ends and is reclaimed here and now, not on the worker threads (what its
        copies still hold goes too)."""
        self.stopping = True
        for conn in list(self.regions):
            self.forget(conn)
        for region in list(self._counted):
            self._punch(region)
            self._uncount(region)

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

    def refuse(self, reason: ShmRefusal, message: str, *args: Any) -> None:
        self.refusals[reason] += 1
        log.warning("shared memory refused (%s): " + message, reason.value, *args)

    def offer(self, conn: Any, creds: tuple[int, int], prefix: bytes, populate_bytes: int) -> Region | None:
        """A fresh region for `conn` (any earlier one of it ended), its token out for TOKEN_TTL_S; None when the
        node's total or the tenant's share is taken (refusal counted) or the kernel gives no memfd."""
        self.forget(conn)  # a connection has one region at a time: an earlier one ends (and is reclaimed)
        size = self.settings.region_bytes
        share = self.settings.tenant_share
        if self._bytes + size > self.settings.total_bytes:
            self.refuse(
                ShmRefusal.TOTAL, "no region for %s: %d of %d bytes taken", conn.peer, self._bytes, self.settings.total_bytes
            )
            return None
        if self._tenant_bytes[prefix] + size > share:
            self.refuse(
                ShmRefusal.TENANT,
                "no region for %s: its tenant holds %d of its %d bytes",
                conn.peer,
                self._tenant_bytes[prefix],
                share,
            )
            return None
        try:
            fd = wire.create_region(size)
        except OSError as error:
            log.warning("no shared-memory region for %s: %s", conn.peer, error)
            return None
        try:
            array = wire.map_region(fd, os.fstat(fd).st_size)
        except BaseException:
            os.close(fd)
            raise
        token = secrets.token_bytes(wire.TOKEN_BYTES)
        region = Region(conn, fd, array, array.nbytes, creds[0], creds[1], prefix, token, time.monotonic() + TOKEN_TTL_S)
        # the client's stated populate (`transport.shm`), never past the region; done once the client has mapped it
        region.populate_bytes = min(populate_bytes, array.nbytes)
        self.regions[conn] = region
        self.tokens[token] = region
        self._counted.add(region)
        self._bytes += array.nbytes
        self._tenant_bytes[prefix] += array.nbytes
        region.expiry = asyncio.get_running_loop().call_later(TOKEN_TTL_S, self._expire, region)
        return region

    def end(self, region: Region) -> None:
        """No request is served over `region` from now on; it is reclaimed once no copy of the node's runs over it."""
        if region.state in (RegionState.ENDING, RegionState.RECLAIMED):
            return
        if self.regions.get(region.conn) is region:
            del self.regions[region.conn]
        if region.token is not None:
            self.tokens.pop(region.token, None)
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

    def _reclaim(self, region: Region) -> None:
        """Free an ended region's pages everywhere and stop counting it: at once for a region never handed over (no
        other process holds it, no populate ran), else on a worker thread (the populate may take a step to stop,
        and freeing a populated region's pages takes a while)."""
        if not region.handed or self.stopping:
            self._punch(region)
            self._uncount(region)
            return
        loop = asyncio.get_running_loop()

        def punch() -> None:
            self._punch(region)
            loop.call_soon_threadsafe(self._uncount, region)

        try:
            self.host.executor.submit(punch)
        except RuntimeError:  # the worker threads are gone (the node is stopping)
            self._punch(region)
            self._uncount(region)

    def _punch(self, region: Region) -> None:
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

    def _uncount(self, region: Region) -> None:
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

    def _expire(self, region: Region) -> None:
        region.expiry = None
        if region.state is RegionState.OFFERED and region.token is not None:
            self.refuse(ShmRefusal.EXPIRED, "a token of %s not presented within %s s", region.conn.peer, TOKEN_TTL_S)
            self.end(region)

    async def copy(self, nbytes: int, fn: Any, region: Region, *args: Any) -> Any:
        """`fn(region's mapping, *args)`: on the loop (small) or a worker thread (large). The copy is counted on the
        region from before it starts until it has returned, on its thread too (a cancelled await does not stop a
        thread), so the region is never reclaimed under it. A region that ended meanwhile is not copied over."""
        if region.state is not RegionState.HANDED or region.array is None:
            raise protocol.ProtocolError("the shared-memory region ended (replaced by a later SHM_OPEN)")
        region.copies += 1
        if nbytes <= self.host.offload_bytes:
            try:
                return fn(region.array, *args)
            finally:
                self._copy_ended(region)
        loop = asyncio.get_running_loop()
        try:
            future = self.host.executor.submit(fn, region.array, *args)
        except BaseException:
            self._copy_ended(region)
            raise
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._copy_ended, region))
        return await asyncio.wrap_future(future)

    def _copy_ended(self, region: Region) -> None:
        region.copies -= 1
        if region.copies == 0 and region.state is RegionState.ENDING:
            self._reclaim(region)

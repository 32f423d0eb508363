"""The hand-over of a same-host shared-memory region's descriptor to its client over an abstract Unix socket
(`transport.shm.server`; `transport.shm` has the protocol and the security model).

Contract:
* `Handover.start(name)` listens on the abstract socket `name` (a random one: no other process can predict it or
  take it first); `stop()` closes it and cancels every hand-over and region channel.
* Slots: a peer is admitted only when an offered region waits for exactly its uid and pid (SO_PEERCRED, read at
  accept), at most MAX_HANDOVERS at once, and per uid no more at once than that uid has regions waiting (nor
  MAX_HANDOVERS_PER_UID); any other peer is closed at once, taking no slot. A process without a key can therefore
  hold no slot, and a tenant at most as many as it has regions.
* A peer must send its token within HANDOVER_TIMEOUT_S. The first attempt spends the token, right or wrong: a
  wrong pid or uid, an ended or expired region is refused (`ShmRefusal`, counted in the ledger) and the region ends;
  a right one gets the descriptor (SCM_RIGHTS), the region is handed over, its populate starts (as far as the
  client asked), and the socket stays open as the region's request channel, served by `serve_channel`.
* Runs on the node's event loop only (no lock); the ledger (`transport.shm.regions`) holds the regions.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from ems.buffers import populate_in_background
from ems.transport.shm import wire
from ems.transport.shm.regions import Region, RegionLedger, RegionState, ShmRefusal

log = logging.getLogger("ems.pool")

HANDOVER_TIMEOUT_S = 2.0  # a Unix-socket peer must send its token within this long
MAX_HANDOVERS = 64  # Unix-socket peers served at once; more are closed at once
MAX_HANDOVERS_PER_UID = 8  # ... of one uid (and never more than the regions waiting for that uid)
_LISTEN_BACKLOG = 512  # peers the kernel queues for accept (the node closes unexpected ones at once)


class Handover:
    """Hands regions' descriptors to their clients; see the module docstring."""

    def __init__(self, ledger: RegionLedger, serve_channel: Callable[[socket.socket, Region], Awaitable[None]]) -> None:
        self.ledger = ledger
        self._serve_channel = serve_channel
        self._handing: Counter[int] = Counter()  # hand-overs under way, by the peer's uid
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._handovers: set[asyncio.Task] = set()
        self._channels: set[asyncio.Task] = set()  # one per region whose client kept its hand-over socket

    @property
    def listening(self) -> bool:
        return self._listener is not None

    def start(self, name: bytes) -> None:
        """Listen on `name`; shared memory stays off (a warning) when the socket cannot listen."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(name)
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

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        listener = self._listener
        while listener is not None:
            # A queued peer is accepted without a wait (the future is done at once), so without this the loop would
            # never yield while a flood keeps the backlog full: the node's UCX service would starve.
            await asyncio.sleep(0)
            try:
                sock, _ = await loop.sock_accept(listener)
            except asyncio.CancelledError:
                raise
            except OSError as error:  # e.g. out of descriptors: wait, then accept again
                log.warning("shared-memory socket: %s", error)
                await asyncio.sleep(0.1)
                continue
            try:
                pid, uid = wire.peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            refusal = self._admit(pid, uid)
            if refusal is not None:
                self.ledger.refusals[refusal] += 1
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
        waiting = [r for r in self.ledger.tokens.values() if r.uid == uid]
        if not any(r.pid == pid for r in waiting):
            return ShmRefusal.UNEXPECTED_PEER
        if self._handing[uid] >= min(len(waiting), MAX_HANDOVERS_PER_UID):
            return ShmRefusal.UID_SLOTS
        return None

    async def _hand_over(self, sock: socket.socket, pid: int, uid: int) -> None:
        loop = asyncio.get_running_loop()
        kept = False  # the socket became the region's channel
        spent: Region | None = None  # the region whose token this peer presented
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
            while len(token) < wire.TOKEN_BYTES:
                chunk = await asyncio.wait_for(
                    loop.sock_recv(sock, wire.TOKEN_BYTES - len(token)), max(0.0, deadline - time.monotonic())
                )
                if not chunk:
                    self.ledger.refusals[ShmRefusal.FAILED] += 1
                    return
                token += chunk
            spent = region = self.ledger.tokens.pop(token, None)  # spent by the first attempt, right or wrong
            if region is not None:
                region.token = None
            refusal = _refusal(region, pid, uid)
            free_slot()  # (before the answer: a peer answered may come back at once)
            if refusal is not None or region is None:
                self.ledger.refuse(refusal or ShmRefusal.TOKEN, "a mapping for pid %d, uid %d", pid, uid)
                sock.send(b"\0")
                return
            socket.send_fds(sock, [b"\1"], [region.fd])
            spent = None
            region.handed = True
            region.state = RegionState.HANDED
            if region.expiry is not None:
                region.expiry.cancel()
                region.expiry = None
            # as much of the node's mapping as the client populates of its own (`transport.shm`): only now that a client
            # holds the region, so that a connection which only asks for one commits no memory
            if region.array is not None:
                region.populate = populate_in_background(
                    region.array, region.populate_bytes, "ems-shm-prefault", region.populate_stop
                )
            # the socket stays open as the region's request channel (`serve_channel`)
            region.channel, kept = sock, True
            task = region.channel_task = asyncio.ensure_future(self._serve_channel(sock, region))
            self._channels.add(task)
            task.add_done_callback(self._channels.discard)
        except (OSError, asyncio.TimeoutError) as error:
            self.ledger.refusals[ShmRefusal.FAILED] += 1
            log.info("shared-memory hand-over failed: %r", error)
        finally:
            free_slot()
            if spent is not None and spent.state is RegionState.OFFERED:
                self.ledger.end(spent)  # its token is spent: nobody can map it any more, it goes now
            if not kept:
                sock.close()


def _refusal(region: Region | None, pid: int, uid: int) -> ShmRefusal | None:
    if region is None:
        return ShmRefusal.TOKEN
    if region.state is not RegionState.OFFERED or region.conn.aborted:
        return ShmRefusal.ENDED
    if time.monotonic() > region.expires:
        return ShmRefusal.EXPIRED
    if uid != region.uid or pid != region.pid:
        return ShmRefusal.CREDENTIALS
    return None

"""The client's side of same-host shared memory for one node client (`transport.shm.wire`: protocol and security).

Contract:
* `ShmClient(link)` serves the node client that hands it `link` (a `NodeLink`: `UcxNode` hands it one): the node's
  current connection, one request on it under the node client's rules (reconnect, back-off, deadline), and the
  failures of requests it ran on a region's channel, which the node client records as its own. It imports nothing
  of the node client's medium.
* `ShmClient.put` / `.get_into` move the values through the connection's region and return the same results as
  the UCX calls, or None when the region cannot serve this call (no region: another host, shared memory off on
  either side, a region too small for the call or busy with other calls, a connection newer than the region);
  the caller then uses UCX with the time left. A call that fails or times out raises the UCX path's
  `TransportError` (it ran on the same connection, which is dropped), and poisons the region: nothing of it is
  handed out again, since the node may still be copying.
* The region is opened lazily by the first call on a connection (one thread opens; concurrent calls use UCX
  meanwhile) and belongs to that connection only: a reconnect opens a fresh one. A connection whose node offered
  no region (its total or the tenant's share taken, or shared memory off), or whose hand-over failed (the node
  busy, the token expired), is asked again after a back-off (RETRY_FIRST_S, doubling up to RETRY_MAX_S; a success
  starts it over); its calls use UCX meanwhile.
* Zero copy where the caller's buffers already lie in the region (`buffer(nbytes)` hands out such buffers, once a
  call has opened the region: a staging area the caller fills and reads in place): their offsets go on the wire as
  they are. Otherwise a save copies its values into a range of the region first, and a load copies each placed
  value out of one.
* A value is placed in a load's buffer only from a reply with status OK that gives it exactly that buffer's length.
  A load whose buffers lie in the region and whose request travels on the region's channel may pass `as_placed`:
  it then also gets the request's progress word (`transport.shm.wire`), to use values as the node places them, before the
  reply; what it does with them is its own (the load verifies each value before writing it anywhere).
* Its requests name ranges of the region (`encode_ranged`: the SHM_PUT / SHM_GET meta, `shm.wire`), taken from the
  region's allocator and sent on its channel (`shm.client_region`), else on the connection through the link.
* Populating ahead of use (`shm.wire`): a connection's first region gets this process's `PREFAULT_BYTES` split over
  its open clients (`first_populate_bytes`: all of it with one same-host node, as deployed; 4 MiB a region with 32,
  about what a call puts on each), so what a process faults in ahead of use is bounded whatever the number of
  same-host nodes; a reconnect's region as much as the region before it had handed out.
* `EMS_POOL_SHM`: "auto" (the default: use it when the node's address is one of this host's) or "off".
"""

from __future__ import annotations

import enum
import functools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ems.buffers import Buffer, byte_view, copy_bytes
from ems.errors import EmsErrorCode
from ems.records import Deadline
from ems.transport import protocol
from ems.transport.base import AsPlaced, Ending, Failure, NodeLink, TransportError
from ems.transport.shm.client_region import (
    ClientRegion,
    RangeAllocator,
    ShmBuffer,
    ShmRange,
    retire_region,
)
from ems.transport.shm.opening import open_region
from ems.transport.shm.wire import CHANNEL_IN_FLIGHT, NO_PROGRESS, PREFAULT_BYTES, PROGRESS_BYTES
from ems.transport.stream import ChannelClosed, ChannelRefused, ChannelTimeout, ClientChannel

RETRY_FIRST_S = 1.0  # a connection without a region asks again after this long ...
RETRY_MAX_S = 30.0  # ... doubling up to this
_STALE = object()  # a request found the connection newer than the region: the caller falls back to UCX


class ShmMode(str, enum.Enum):
    """Whether a client uses shared memory with its node (`Settings.pool_shm`, EMS_POOL_SHM)."""

    AUTO = "auto"  # shared memory with a node on this host
    OFF = "off"


_MIB = 1 << 20
_open_lock = threading.Lock()
_open_clients = 0  # `ShmClient`s of this process neither closed nor collected (see `first_populate_bytes`)


def first_populate_bytes() -> int:
    """What a connection's first region populates ahead of use: `PREFAULT_BYTES` over the process's open clients,
    in whole MiB (SHM_OPEN states MiB), at least one."""
    with _open_lock:
        clients = max(1, _open_clients)
    return max(1, -(-PREFAULT_BYTES // (clients * _MIB))) * _MIB


def _count(counted: list[bool], open_: bool) -> None:
    """Count a client in or out of `_open_clients` (once each way; `counted` is its cell)."""
    global _open_clients
    with _open_lock:
        if counted[0] != open_:
            counted[0] = open_
            _open_clients += 1 if open_ else -1


class ShmClient:
    """Shared memory for one node client; see the module docstring."""

    def __init__(self, link: NodeLink) -> None:
        self.link = link
        # counted in `_open_clients` from construction, and again on use after `close` (a cell, which the finalizer
        # reads when a client is collected without a `close`)
        self._counted = [False]
        _count(self._counted, True)
        weakref.finalize(self, _count, self._counted, False)
        self._region: ClientRegion | None = None
        self._no_region_on: Any = None  # the endpoint that got no region: not asked again before `_retry_at`
        self._retry_at = 0.0  # (monotonic)
        self._retry_s = RETRY_FIRST_S
        self._opening = threading.Lock()
        self._last_allocator: RangeAllocator | None = None  # the latest region's (how much to populate next)

    # ---- calls ----

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[Buffer]], deadline: Deadline) -> list[bool] | None:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        region = self.region(deadline)
        if region is None:
            return None
        parts = [[byte_view(p) for p in ps] for ps in values]
        lens = [sum(p.nbytes for p in ps) for ps in parts]
        offsets = _offsets_in(region, parts, lens)
        taken: ShmRange | None = None
        if offsets is None:
            taken = region.allocator.alloc(sum(lens))
            if taken is None:
                return None
            offsets, at = [], taken.offset
            try:
                for ps in parts:
                    offsets.append(at)
                    for p in ps:
                        copy_bytes(region.array[at : at + p.nbytes], p)
                        at += p.nbytes
            except BaseException:
                region.allocator.free(taken)
                raise
        meta = encode_ranged(keys, offsets, lens)
        body = self._send(region, protocol.Op.SHM_PUT, meta, len(keys), taken, deadline)
        if body is _STALE:
            return None
        return protocol.decode_flags(len(keys), body)

    def get_into(
        self, keys: Sequence[bytes], outs: Sequence[memoryview], deadline: Deadline, as_placed: AsPlaced | None = None
    ) -> list[bool] | None:
        """See the module docstring. `as_placed(progress, fd, deadline_ns)`: where the buffers lie in the region and
        the request travels on the region's channel, run once the request is sent, with the address of its progress
        word (`transport.shm.wire`: how many leading values the node has placed so far), the channel's descriptor and the
        deadline (CLOCK_MONOTONIC ns): the caller may use each value as it is placed, before the reply."""
        region = self.region(deadline)
        if region is None:
            return None
        caps = [o.nbytes for o in outs]
        offsets = _offsets_in(region, [[o] for o in outs], caps)
        taken: ShmRange | None = None
        word: ShmRange | None = None
        if offsets is None:
            taken = region.allocator.alloc(sum(caps))
            if taken is None:
                return None
            offsets = (taken.offset + np.cumsum(caps) - np.asarray(caps, dtype=np.int64)).tolist()
        elif as_placed is not None:
            word = region.allocator.alloc(PROGRESS_BYTES)
        after_send = None
        if word is not None and as_placed is not None:
            region.array[word.offset : word.offset + PROGRESS_BYTES] = 0  # (aligned: the allocator's ranges are)
            address = region.array.ctypes.data + word.offset
            after_send = functools.partial(_run_as_placed, as_placed, address, int(deadline.at * 1e9))
        meta = encode_ranged(keys, offsets, caps, None if word is None else word.offset)
        try:
            body = self._send(region, protocol.Op.SHM_GET, meta, len(keys), taken, deadline, keep=True, after_send=after_send)
        finally:  # the node writes the word only before its reply (after a failure the region is poisoned)
            if word is not None:
                region.allocator.free(word)
        try:
            if body is _STALE:
                return None
            if len(body) != 8 * len(keys):
                raise self._malformed(f"SHM_GET reply meta of {len(body)} bytes for {len(keys)} keys")
            lens = np.frombuffer(body, dtype="<i8").tolist()
            placed = [n >= 0 and n == cap for n, cap in zip(lens, caps)]
            if taken is not None:
                for out, offset, ok in zip(outs, offsets, placed):
                    if ok and out.nbytes:
                        copy_bytes(out, region.array[offset : offset + out.nbytes])
            return placed
        finally:
            if taken is not None:
                region.allocator.free(taken)

    def exists(self, meta: bytes, count: int, flags: int, deadline: Deadline) -> list[bool] | None:
        """An EXISTS over the current region's channel: the flags of the keys held (`meta`: the request's meta, as
        on UCX). None when there is no channel to take now (no region yet, no channel, every slot taken, or the
        region's connection replaced): the caller asks over its node's connection. A lookup never opens a region."""
        region = self._region
        channel = None if region is None else region.channel
        if region is None or channel is None or region.allocator.poisoned:
            return None
        if not channel.slots.acquire(blocking=False):
            return None
        try:
            reply = self._over_channel(region, channel, protocol.Op.EXISTS, meta, count, deadline, flags=flags)
        except TransportError:
            if channel.spent:  # (a lookup's timeout keeps the channel, and so the region)
                retire_region(region)
                if self._region is region:
                    self._region = None
            raise
        except BaseException:
            retire_region(region)
            if self._region is region:
                self._region = None
            raise
        finally:
            channel.slots.release()
        if reply is _STALE:
            return None
        try:
            return protocol.decode_flags(count, reply)
        except protocol.ProtocolError as malformed:
            raise self._malformed(str(malformed)) from None

    def buffer(self, nbytes: int) -> ShmBuffer | None:
        """`nbytes` of the current connection's region for the caller to fill or read in place, or None. Never
        opens a region (that costs a round trip, which the calls do under their own deadlines): until a call
        has opened one, callers stage elsewhere."""
        region = self._region
        if region is None or region.ep is not self.link.connection() or region.allocator.poisoned:
            return None
        taken = region.allocator.alloc(nbytes)
        return None if taken is None else ShmBuffer(region, taken, nbytes)

    def close(self) -> None:
        """Forget the region (its connection is being dropped): unmapped once no lease of it is held any more."""
        region, self._region = self._region, None
        _count(self._counted, False)
        if region is not None:
            retire_region(region)

    # ---- machinery ----

    def _send(
        self,
        region: ClientRegion,
        op: int,
        meta: bytes,
        count: int,
        taken: ShmRange | None,
        deadline: Deadline,
        keep: bool = False,
        after_send: Callable[[int], None] | None = None,
    ) -> Any:
        """Run one SHM request on the region's connection; its reply meta (or _STALE). `taken` is freed after a
        success unless `keep` (the caller still reads it), and the region is poisoned after a failure."""
        channel = region.channel
        try:
            if channel is not None and channel.slots.acquire(blocking=False):
                try:
                    result = self._over_channel(region, channel, op, meta, count, deadline, after_send)
                finally:
                    channel.slots.release()
            else:  # no channel, or every slot of it taken: this one goes over the node's connection
                sent = self.link.request(op, count, meta, deadline, on=region.ep)
                result = _STALE if sent is None else sent[1]
        except BaseException:
            retire_region(region)
            if self._region is region:
                self._region = None
            raise
        if taken is not None and not keep:
            region.allocator.free(taken)
        return result

    def _over_channel(
        self,
        region: ClientRegion,
        channel: ClientChannel,
        op: int,
        meta: bytes,
        count: int,
        deadline: Deadline,
        after_send: Callable[[int], None] | None = None,
        flags: int = 0,
    ) -> Any:
        """One request over the region's channel; its reply meta, or _STALE when the region's connection is no longer
        the current one. Any failure drops the connection, as a failed request on it does (`NodeLink.fail`)."""
        link = self.link
        if link.connection() is not region.ep:
            return _STALE
        keep = op == protocol.Op.EXISTS  # a lookup writes nothing: its timeout leaves the calls beside it be
        try:
            return channel.request(op, count, meta, deadline.at, after_send, flags, keep_on_timeout=keep)
        except ChannelTimeout as timeout:
            message = "no answer within the call's deadline"
            if keep and not timeout.mid_frame:
                raise link.timed_out(message) from None
            error = link.fail(region.ep, EmsErrorCode.EMS_IO_TIMEOUT, message, ending=Ending.CANCELLED)
        except ChannelRefused as refused:
            error = link.fail(region.ep, EmsErrorCode.EMS_IO_ERROR, str(refused), Failure.REFUSED)
        except (ChannelClosed, OSError) as lost:
            error = link.fail(region.ep, EmsErrorCode.EMS_IO_ERROR, f"shared-memory channel lost: {lost}")
        except protocol.ProtocolError as malformed:
            error = link.fail(region.ep, EmsErrorCode.EMS_IO_ERROR, f"malformed reply: {malformed}")
        raise error

    def _malformed(self, message: str) -> Exception:
        if self._region is not None:
            retire_region(self._region)
            self._region = None
        self.link.close()
        return TransportError(EmsErrorCode.EMS_IO_ERROR, f"{self.link.address}: malformed reply: {message}")

    def region(self, deadline: Deadline) -> ClientRegion | None:
        """The current connection's region, opened now if it has none; None when there is none to use."""
        ep = self.link.connection()  # a reference read: another call may replace it, requests check it again
        region = self._region
        if region is not None and region.ep is ep and ep is not None and not region.allocator.poisoned:
            return region
        if ep is not None and ep is self._no_region_on and time.monotonic() < self._retry_at:
            return None
        if not self._opening.acquire(blocking=False):
            return None  # another thread is opening it: this call goes over UCX
        try:
            return self._open(deadline)
        finally:
            self._opening.release()

    def _open(self, deadline: Deadline) -> ClientRegion | None:
        _count(self._counted, True)  # (a client used again after `close`)
        previous = self._last_allocator  # a reconnect populates as much as the region before it had handed out
        populate = first_populate_bytes() if previous is None else previous.high_water
        handed = open_region(self.link, populate, deadline)
        if handed is None:
            return None
        if handed.array is None or handed.sock is None:
            self._no_region(handed.ep)
            return None
        self._no_region_on, self._retry_s = None, RETRY_FIRST_S
        region = ClientRegion(
            handed.ep, handed.array, RangeAllocator(handed.array.nbytes), ClientChannel(handed.sock, CHANNEL_IN_FLIGHT)
        )
        self._last_allocator = region.allocator
        previous_region, self._region = self._region, region
        if previous_region is not None:  # an older connection's: nothing of it is used again
            retire_region(previous_region)
        return region

    def _no_region(self, ep: Any) -> None:
        """`ep` got no region: its calls use UCX, and it asks again after the back-off."""
        self._no_region_on = ep
        self._retry_at = time.monotonic() + self._retry_s
        self._retry_s = min(self._retry_s * 2, RETRY_MAX_S)


def _run_as_placed(as_placed: AsPlaced, progress: int, deadline_ns: int, fd: int) -> None:
    as_placed(progress, fd, deadline_ns)


def encode_ranged(keys: Sequence[bytes], offsets: Sequence[int], lens: Sequence[int], progress: int | None = None) -> bytes:
    """An SHM_PUT or SHM_GET meta (`transport.shm.wire`; the node reads it with `wire.decode_ranged`)."""
    key_lens, blob = protocol.encode_keys(keys)
    head = np.array([NO_PROGRESS if progress is None else progress], dtype="<u8").tobytes()
    return head + np.asarray(offsets, dtype="<u8").tobytes() + np.asarray(lens, dtype="<u8").tobytes() + key_lens.tobytes() + blob


def address_of(buffer: Any) -> tuple[int, int]:
    """(address, byte length) of a contiguous buffer."""
    array = np.frombuffer(buffer, dtype=np.uint8)
    return int(array.ctypes.data), int(array.nbytes)


def _offsets_in(region: ClientRegion, parts: Sequence[Sequence[Any]], lens: Sequence[int]) -> list[int] | None:
    """Each value's region offset when every value's parts lie back to back inside the region, else None."""
    offsets = []
    for ps, n in zip(parts, lens):
        if not ps:
            return None
        address, _ = address_of(ps[0])
        offset = region.offset_of(address, n)
        if offset < 0:
            return None
        at = address
        for p in ps:
            part_address, size = address_of(p)
            if part_address != at:
                return None
            at += size
        offsets.append(offset)
    return offsets

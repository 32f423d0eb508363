"""Same-host shared memory's protocol and security model: the region, SHM_OPEN and its hand-over, the SHM_PUT and
SHM_GET metas, the progress word (what both sides keep; no I/O here but making and mapping a region).

Each side's part of it: the client's in `shm.client` (its calls, the SHM_PUT / SHM_GET meta it writes:
`encode_ranged`), `shm.client_region` (its region's allocator and channel) and `shm.opening` (SHM_OPEN and the
hand-over), the node's in `shm.server`; a region's request channel's two ends in `shm.client_region` (`ClientChannel`)
and `shm.server` (`NodeChannel`).

Contract:
* A **region** is one sealed memfd per authenticated connection, created by the node and mapped by that client
  only: never shared between connections, never reused (a fresh memfd's pages are zero, so it can hold no stale
  bytes of another connection). When it ends (its connection ends, a later SHM_OPEN replaces it, its token
  expires) the node punches its pages out of the memfd, freeing them in the client's mapping too, and counts it
  against its limits until then (`shm.server`). Its size is fixed by the node and sealed (F_SEAL_SHRINK |
  F_SEAL_GROW | F_SEAL_SEAL): a client cannot truncate it under the node (no SIGBUS there), nor seal it against
  the node's punching.
* Opening (`SHM_OPEN`, an ordinary inline request on the authenticated connection): the client states its uid and
  pid; the node answers a one-time token, the region's size, its own pid and the abstract Unix socket it listens
  on (size 0: no region for this connection, the client uses UCX). The client connects to that socket, sends the
  token and receives the memfd (SCM_RIGHTS). The node hands the descriptor over only for an unexpired token it
  issued to a live connection, and only when the socket's peer credentials (SO_PEERCRED) are the uid and pid that
  connection stated; the token is spent by the first attempt, right or wrong. The client, in turn, accepts the
  descriptor only from the node's pid (SO_PEERCRED), and only tries at all when the node's address is one of this
  host's own.
* `SHM_PUT` meta: progress u64 (NO_PROGRESS: a PUT has none) | offsets u64[count] | value_lens u64[count] |
  key_lens u32[count] | keys; no data frames: value i is region[offsets[i] : offsets[i] + value_lens[i]]. The
  reply is PUT's (u8[count], 1 = stored); the node copies each value out of the region into its own buffer and
  verifies that copy (checksum) before storing it, in one pass (each 64 KiB hashed right after it is copied:
  `value_format.copy_well_formed_many`).
* `SHM_GET` meta: progress u64 | offsets u64[count] | capacities u64[count] | key_lens u32[count] | keys. The reply
  meta is GET's i64[count] (the value's length, -1 = miss); the value is in region[offsets[i]:] when (and only
  when) its length equals capacities[i]. Without a progress word (NO_PROGRESS) the client reads a range only after
  the reply: nothing is placed from a failed request. With one (the region offset of a u32 the client zeroed,
  4-byte aligned, outside every value range, else the request is malformed), the node stores there, with release
  order, after placing each of the request's leading values, how many of them it has placed, and wakes the
  word's futex waiters: value i may then be read before the reply once the word exceeds i (the client verifies
  it, header and checksum, before using it: `ems_verify_scatter_as_placed`). The word never counts a value the
  reply will not give as placed, and is never written after the reply.
* Both sides populate the start of a region on a background thread when they map it (MADV_POPULATE_WRITE, no
  GIL): the client chooses how much (for a connection's first region its share of PREFAULT_BYTES, which a process
  splits over its open clients, `shm.client.first_populate_bytes`; for a reconnect's region, as much as the region
  before it had handed out, `RangeAllocator.high_water`) and states it in SHM_OPEN's `count`, in
  MiB; the node populates as much of its own mapping (0 from a client that states none). First fit hands out the
  start first, so a region's first calls do not fault page by page (fresh memfd pages cost about 2 ms per MiB on
  a VM, and each side's first touch of a page faults: a 62 MiB first load took 7x a warm one). Memory: that much
  of the region in use from the start, which the calls would fault in anyway.
* The region's **channel**: after the hand-over the socket stays open, one per region, and carries that region's
  data requests and the connection's lookups (EXISTS, with its LEASE or PIN flag; the node answers it as on UCX):
  the same 32-byte header and meta as on UCX (`protocol.pack_header`; no data frames, count and
  request id as there), the reply a header (op | REPLY, status, count, meta length) and its meta. The socket's
  peer was proven at the hand-over (token, SO_PEERCRED both ways), so a request on it belongs to the region's
  connection and tenant; only SHM_GET, SHM_PUT and EXISTS travel on it, and the node serves them as it serves the same
  ops on UCX. Up to `CHANNEL_IN_FLIGHT` requests are in flight on it at once, told apart by their request ids (an
  id is not reused while its request is in flight: the node ends the channel if it is); a client call takes one of
  the channel's slots for its whole request, and one that finds none free goes over UCX. The node serves the
  requests of a channel at once (a lookup between two reads, without a task) and writes each reply whole; replies
  may come in any order.
* The node ends a channel on anything malformed (a ProtocolError) and on a refusal (answered BAD_REQUEST first),
  and when the region's connection ends. The client drops the connection after any failure on its channel
  (a timeout included), as after any failed UCX request: the region is poisoned and a fresh connection gets a
  fresh region.
* Every range must lie inside the region (`ProtocolError` otherwise: the node closes the connection).
* Concurrency (client side): `RangeAllocator` (`shm.client_region`) hands out disjoint page-aligned ranges, one per
  request in flight, freed when the request's reply has come back. A request that failed or timed out may still be
  copied into by the node, so its region is **poisoned**: no range of it is handed out again, and the connection is
  dropped anyway (the next connection gets a fresh region).
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
from dataclasses import dataclass

import numpy as np

from ems.transport import protocol

TOKEN_BYTES = 32
NO_PROGRESS = (1 << 64) - 1  # a request's progress offset when it has no progress word
PROGRESS_BYTES = 4  # a progress word: a u32 (a futex)
PAGE = 4096
MAX_SOCKET_NAME = 107  # sun_path
DEFAULT_REGION_BYTES = 256 << 20  # per connection (`python -m ems.pool --shm-bytes`)
DEFAULT_TOTAL_BYTES = 4 << 30  # all connections of one node together (`--shm-total`)
PREFAULT_BYTES = 128 << 20  # what a process's first regions populate ahead of use, in all (both sides)
# what travels on a region's channel: the region's data requests, and lookups (a same-host EXISTS costs a socket round
# trip there, against UCX's posts and progress thread: perf/RESULTS.md, "exists over the region's channel")
CHANNEL_OPS = frozenset({int(protocol.Op.SHM_GET), int(protocol.Op.SHM_PUT), int(protocol.Op.EXISTS)})
CHANNEL_IN_FLIGHT = 8  # requests in flight on one region's channel (the node serves them at once, in this bound)
_OPEN_REPLY = struct.Struct("<32sQI")  # token | region bytes | node pid; then the socket name
_CREDS = struct.Struct("<II")  # uid | pid
_PEERCRED = struct.Struct("3i")  # pid, uid, gid (struct ucred)


@dataclass(frozen=True)
class ShmSettings:
    """What a node offers: bytes per connection's region (0: shared memory off), in all, and to one tenant (None:
    no share below the total)."""

    region_bytes: int = DEFAULT_REGION_BYTES
    total_bytes: int = DEFAULT_TOTAL_BYTES
    tenant_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.region_bytes < 0 or self.total_bytes < 0 or (self.tenant_bytes is not None and self.tenant_bytes < 0):
            raise ValueError("shared-memory sizes must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.region_bytes > 0 and self.total_bytes >= self.region_bytes

    @property
    def tenant_share(self) -> int:
        """The most bytes of regions one tenant's connections hold together."""
        return self.total_bytes if self.tenant_bytes is None else min(self.tenant_bytes, self.total_bytes)

    @staticmethod
    def default_tenant_bytes(total_bytes: int, tenants: int) -> int | None:
        """A node's default share per tenant: half the total when it serves two or more tenants by key (so that no
        one tenant holds it all), none below the total otherwise (one tenant; or a node without keys, whose tenant
        names anyone may claim)."""
        return total_bytes // 2 if tenants >= 2 else None


def metric_name(op: int) -> str:
    """A request's name in a node's metrics: SHM_PUT / SHM_GET count as the put / get they are (the sessions count a
    LOOKUP_OPEN as `lookup_open`)."""
    if op == protocol.Op.SHM_PUT:
        return "put"
    if op == protocol.Op.SHM_GET:
        return "get"
    return protocol.Op(op).name.lower() if op in protocol.Op._value2member_map_ else "other"


# ---- the region ----


def create_region(nbytes: int) -> int:
    """A sealed memfd of exactly `nbytes` (rounded up to pages), close-on-exec; its descriptor."""
    import fcntl

    size = (nbytes + PAGE - 1) // PAGE * PAGE
    fd = os.memfd_create("ems-shm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_region(fd: int, nbytes: int) -> np.ndarray:
    """The region behind `fd` as a writable uint8 array of `nbytes` (the mapping lives as long as the array)."""
    if os.fstat(fd).st_size != nbytes:
        raise OSError(f"shared-memory region of {os.fstat(fd).st_size} bytes, announced {nbytes}")
    return np.frombuffer(mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), dtype=np.uint8)


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of a Unix socket's peer, as the kernel recorded them."""
    pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


def is_local_address(ip: str) -> bool:
    """True when `ip` is an address of this host (a node there can share memory with this process)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind((ip, 0))
        return True
    except OSError:
        return False


# ---- requests ----


def encode_open(uid: int, pid: int) -> bytes:
    return _CREDS.pack(uid, pid)


def decode_open(meta: bytes) -> tuple[int, int]:
    if len(meta) != _CREDS.size:
        raise protocol.ProtocolError(f"SHM_OPEN meta of {len(meta)} bytes, expected {_CREDS.size}")
    uid, pid = _CREDS.unpack(meta)
    return uid, pid


@dataclass(frozen=True)
class OpenReply:
    token: bytes
    region_bytes: int  # 0: no region for this connection
    node_pid: int
    socket_name: bytes  # abstract namespace (leading NUL)


def encode_open_reply(reply: OpenReply) -> bytes:
    return _OPEN_REPLY.pack(reply.token, reply.region_bytes, reply.node_pid) + reply.socket_name


def decode_open_reply(meta: bytes) -> OpenReply:
    if len(meta) < _OPEN_REPLY.size or len(meta) - _OPEN_REPLY.size > MAX_SOCKET_NAME:
        raise protocol.ProtocolError(f"SHM_OPEN reply of {len(meta)} bytes")
    token, region_bytes, node_pid = _OPEN_REPLY.unpack_from(meta)
    return OpenReply(token, region_bytes, node_pid, bytes(meta[_OPEN_REPLY.size :]))


@dataclass(frozen=True)
class RangedRequest:
    """A decoded SHM_PUT or SHM_GET: keys and, per key, a region offset and a length (PUT) or capacity (GET)."""

    keys: list[bytes]
    offsets: np.ndarray  # int64
    lens: np.ndarray  # int64
    progress: int | None = None  # SHM_GET: the region offset of the client's progress word, if it asked for one


def decode_ranged(count: int, meta: memoryview | bytes, region_bytes: int) -> RangedRequest:
    """Parse an SHM_PUT/SHM_GET meta and check every range against the region and the protocol's limits (a
    progress word too: 4-byte aligned, inside the region, outside every value range)."""
    meta = memoryview(meta)
    if len(meta) < 8 + 20 * count:
        raise protocol.ProtocolError("shared-memory request meta shorter than its lengths")
    progress = int(np.frombuffer(meta, dtype="<u8", count=1)[0])
    offsets = np.frombuffer(meta, dtype="<u8", count=count, offset=8).astype(np.uint64)
    lens = np.frombuffer(meta, dtype="<u8", count=count, offset=8 + 8 * count).astype(np.uint64)
    key_lens = np.frombuffer(meta, dtype="<u4", count=count, offset=8 + 16 * count)
    keys = protocol.split_keys(key_lens, meta[8 + 20 * count :])
    if count and (int(lens.max()) > protocol.MAX_VALUE_BYTES or int(offsets.max()) > region_bytes):
        raise protocol.ProtocolError("a shared-memory range out of bounds")
    ends = offsets + lens  # no overflow: both are bounded above
    if count and int(ends.max()) > region_bytes:
        raise protocol.ProtocolError("a shared-memory range out of bounds")
    if progress == NO_PROGRESS:
        return RangedRequest(keys, offsets.astype(np.int64), lens.astype(np.int64), None)
    if progress % PROGRESS_BYTES or progress > region_bytes - PROGRESS_BYTES:
        raise protocol.ProtocolError("a progress word unaligned or out of bounds")
    if count and bool(((offsets < progress + PROGRESS_BYTES) & (ends > progress)).any()):
        raise protocol.ProtocolError("a progress word inside a value's range")
    return RangedRequest(keys, offsets.astype(np.int64), lens.astype(np.int64), progress)

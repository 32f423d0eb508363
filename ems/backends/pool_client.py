"""The pool as one client sees it (a `PoolBackend`): `ems.pool` nodes over UCX (or nodes in this process,
`transport.inprocess`, as tests build clusters), assembled from two parts with contracts of their own. The
embedded pool is a backend of its own (`ems.backends.embedded`).

* Routing (`ems.backends.node_router.NodeRouter`): owners and replicas, per-node requests within the protocol's
  `RequestLimits`, fan-out in parallel with one `Deadline`, failover to the next owner on reads.
* The read cache (`ReadCache`, below; remote pools only): in front of the router. A put with
  `write_rcache` keeps what it stored there; a read takes what it holds first (an entry that is not the `expected`
  value is dropped) and asks the nodes for the rest; with `read_local_only` a read never leaves the process. Nodes
  in this process (every node's `location` is `NodeLocation.IN_PROCESS`) have no read cache in front of them, and
  they always serve.

Contract: every call returns by the option's timeout, or by `deadline` where given (the chunks of one request
share its deadline); results come back in request order, a failed node's keys as misses with its error in
`PoolOutcome.errors`; interpreting them (the consecutive prefix, raising when nothing was reachable) is the caller's
job.

The read cache (`ReadCache`):
* A `ReadCache` holds copies of values in this process, at most `capacity` bytes (each entry charged its key, its
  value and `ems.store.index.ENTRY_OVERHEAD`, as a store charges), the least recently used evicted first. It is not
  a `KvStore`: nothing is leased, pinned, handed in without a copy or checked on the way in, so it is one small
  class on the save's path. The pool client puts it in front of its nodes for remote pools only (the embedded pool
  is local already).
* `remember(keys, values, stored)` copies in the values a put stored (the caller decides when: `write_rcache`). The
  buffer of the value it replaces, or of one evicted to make room, is reused when it is the same size and no reader
  holds it (a full cache of one block size, or a key saved again, copies into memory already faulted in). A value
  larger than the whole cache is not kept, and the key's older value goes (the cache never answers with a value
  older than the one last saved).
* `lookup`, `place` and `contains` answer what the cache holds, in request order, and leave the rest to the pool
  (None / False); a hit becomes the most recently used. `lookup` gives read-only views, which stay valid while the
  caller holds them, evicted or not. With `expected` (value i of the call is `expected`'s value i), an entry that is
  not exactly the expected value (damaged, or written by another layout) is dropped from the cache and reported
  missing, so it never shadows a good copy in the pool. `place` copies a value into the caller's buffer only when
  its length is the buffer's.
* Thread-safe: one lock, held for the index, never while copying.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeGuard

import numpy as np

from ems.backends.base import InPlaceValues, PoolCall, PoolOutcome
from ems.backends.node_router import NodeRouter
from ems.buffers import Buffer
from ems.cluster.placement import Members
from ems.kernels.host_copy import copy_buffers
from ems.store.index import ENTRY_OVERHEAD
from ems.store.value_format import ExpectedValues, matches, valid_flags
from ems.transport.base import AsPlaced, NodeClient, NodeLocation, SharedBuffer
from ems.transport.exists_holds import Hold, HoldKind
from ems.transport.protocol import WIRE_LIMITS, RequestLimits
from ems.types import CcKvOption


def _charge(key: bytes, nbytes: int) -> int:
    """What a value of `nbytes` under `key` counts against the cache's capacity: as a store counts it
    (`ems.store.index.charge`, not called here: that would walk the store's module on every save)."""
    return len(key) + nbytes + ENTRY_OVERHEAD


def _unshared(buffer: Buffer) -> TypeGuard[np.ndarray]:
    """Whether a buffer the cache made is held by nothing but its caller's one local: no reader's view of it is alive,
    so its bytes may be overwritten (references: that local, this parameter, getrefcount's argument)."""
    return type(buffer) is np.ndarray and sys.getrefcount(buffer) <= 3


# A read of this many bytes or more is checked and copied in one batch each (`valid_flags`, `copy_buffers`: the GIL
# given away once); below it, a check and a copy per value holding the GIL cost less than building the batch (a place
# of 16 x 64 KiB: 42 us a value at a time, 81 us batched; of 32 x 1 MiB: 3.5 ms against 2.5 ms batched, and a small
# load beside such reads waited 2-3x less, `perf/bench_read_cache.py --against`, `perf/bench_beside.py`).
BATCH_FROM_BYTES = 4 << 20


def _hit_bytes(values: Sequence[Buffer | None]) -> int:
    return sum(memoryview(value).nbytes for value in values if value is not None)


class ReadCache:
    """A client-side cache of values, least recently used evicted first; see the module docstring."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[bytes, Buffer] = OrderedDict()  # least recently used first
        self._used = 0  # charges of the entries and of the values being copied in
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, keys: Sequence[bytes], values: Sequence[Sequence[Buffer]], stored: Sequence[bool]) -> None:
        for key, parts, ok in zip(keys, values, stored):
            if ok:
                self._keep(key, parts)

    def _keep(self, key: bytes, parts: Sequence[Buffer]) -> None:
        """Copy the concatenation of `parts` in under `key`, replacing its old value."""
        views = [memoryview(part).cast("B") for part in parts]
        nbytes = sum(view.nbytes for view in views)
        charge = _charge(key, nbytes)
        with self._lock:
            replaced = self._drop(key)
            if charge > self.capacity:
                return
            reused = self._make_room(charge, nbytes, replaced if replaced is not None and len(replaced) == nbytes else None)
            del replaced
            self._used += charge  # reserved while the copy runs outside the lock
        try:
            buffer = np.empty(nbytes, dtype=np.uint8) if reused is None else reused
            target = memoryview(buffer)
            position = 0
            for view in views:
                target[position : position + view.nbytes] = view
                position += view.nbytes
            del target
        except BaseException:
            with self._lock:
                self._used -= charge
            raise
        with self._lock:
            self._drop(key)  # (another thread's copy of the same key, landed meanwhile)
            self._entries[key] = buffer  # its reservation becomes its charge

    def _drop(self, key: bytes, value: Buffer | None = None) -> np.ndarray | None:
        """Take `key` out (only if it still holds `value`, where given); its buffer when nobody else holds it (for
        reuse). Under the lock."""
        old = self._entries.get(key)
        if old is None or (value is not None and old is not value):
            return None
        del self._entries[key]
        self._used -= _charge(key, memoryview(old).nbytes)
        return old if _unshared(old) else None

    def _make_room(self, charge: int, nbytes: int, spare: np.ndarray | None) -> np.ndarray | None:
        """Evict until `charge` more bytes fit; returns `spare`, else an evicted buffer of `nbytes` that nobody else
        holds, if any (for reuse). Under the lock."""
        entries = self._entries
        while self._used + charge > self.capacity and entries:
            key, evicted = entries.popitem(last=False)
            self._used -= _charge(key, memoryview(evicted).nbytes)
            if spare is None and _unshared(evicted) and len(evicted) == nbytes:
                spare = evicted
            del evicted
        return spare

    def _hits(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """Each key's entry or None, the hits made the most recently used."""
        entries = self._entries
        with self._lock:
            values = [entries.get(key) for key in keys]
            for key, value in zip(keys, values):
                if value is not None:
                    entries.move_to_end(key)
        return values

    def _verified(
        self, keys: Sequence[bytes], values: list[Buffer | None], expected: ExpectedValues | None, large: bool
    ) -> list[Buffer | None]:
        """`values` with each entry that is not `expected`'s value dropped (from the cache too) and None; `large`: the
        payloads' checksums in one batch (one GIL hand-over), else a check each holding the GIL."""
        if expected is not None and any(value is not None for value in values):
            if large:
                good = valid_flags(values, expected)
            else:
                good = [value is not None and matches(value, expected, i) for i, value in enumerate(values)]
            for i, value in enumerate(values):
                if value is not None and not good[i]:
                    with self._lock:
                        self._drop(keys[i], value)
                    values[i] = None
        return values

    def lookup(self, keys: Sequence[bytes], expected: ExpectedValues | None = None) -> list[Buffer | None]:
        """Each key's cached value (a read-only view), or None."""
        values = self._hits(keys)
        values = self._verified(keys, values, expected, _hit_bytes(values) >= BATCH_FROM_BYTES)
        return [None if value is None else memoryview(value).toreadonly() for value in values]

    def place(self, keys: Sequence[bytes], outs: Sequence[Buffer], expected: ExpectedValues | None = None) -> list[bool]:
        """Copy each cached value into `outs[i]`; True where it was there with exactly that buffer's length."""
        placed = [False] * len(keys)
        values = self._hits(keys)
        large = _hit_bytes(values) >= BATCH_FROM_BYTES
        values = self._verified(keys, values, expected, large)
        if large:  # one batch without the GIL: a copy each held it, and stalled the process's other threads
            chosen = [i for i, v in enumerate(values) if v is not None and memoryview(v).nbytes == memoryview(outs[i]).nbytes]
            copy_buffers([outs[i] for i in chosen], [values[i] for i in chosen])
            for i in chosen:
                placed[i] = True
            return placed
        for i, value in enumerate(values):
            if value is None:
                continue
            out = memoryview(outs[i]).cast("B")
            source = memoryview(value).cast("B")
            if source.nbytes == out.nbytes:
                out[:] = source
                placed[i] = True
        return placed

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        entries = self._entries
        with self._lock:
            return [key in entries for key in keys]


class PoolClient:
    """Routes batched put/get/exists to the owning nodes, behind the read cache; see the module docstring."""

    def __init__(
        self,
        nodes: Sequence[NodeClient],
        read_cache_capacity: int = 0,
        replicas: int = 1,
        connect: Callable[[str], NodeClient] | None = None,
        limits: RequestLimits = WIRE_LIMITS,
        hedge: bool = True,
    ) -> None:
        self.router = NodeRouter(nodes, replicas, connect, limits, hedge)
        self.limits = limits
        self.replicas = replicas
        self.read_check = self.router.read_check
        #: where the nodes live (`NodeRouter.location`): nodes in this process get no read cache and always serve
        self.location = self.router.location
        remote = self.location is NodeLocation.REMOTE
        self.read_cache: ReadCache | None = ReadCache(read_cache_capacity) if read_cache_capacity > 0 and remote else None
        #: values move through put and get_into (the nodes' memory is not this process's to lend)
        self.in_place: InPlaceValues | None = None
        self._on_close: list[Callable[[], None]] = []

    @property
    def members(self) -> Members:
        """The live set placement uses (`ems.cluster.placement.Members`)."""
        return self.router.members

    @property
    def nodes(self) -> list[NodeClient]:
        """The nodes placement uses now (the live set)."""
        return self.router.nodes

    def set_members(self, addresses: Sequence[str], incarnations: Mapping[str, object] | None = None) -> None:
        """Route to exactly these nodes from now on (membership changes; see `ems.cluster.placement.Members`:
        `incarnations` tell a node that came back from one that stayed)."""
        self.router.members.set(addresses, incarnations)

    def describe(self) -> str:
        """ "embedded", or the live nodes' addresses (for logs)."""
        return "embedded" if self.location is NodeLocation.IN_PROCESS else ", ".join(n.address for n in self.nodes)

    def prepare_staging(self, buffer: Any) -> None:
        """Nothing to do: UCX registers what it sends (see `ems.backends.base`)."""

    def release_staging(self, buffer: Any) -> None:
        """Nothing to do (see `prepare_staging`)."""

    def shm_staging(self, nbytes: int) -> SharedBuffer | None:
        """A buffer of `nbytes` in the shared-memory region of this pool's one node (`NodeClient.shm_buffer`: its
        calls move values lying there without a copy), or None: several nodes, a node elsewhere, or no room."""
        return self.router.shm_staging(nbytes)

    def on_close(self, callback: Callable[[], None]) -> None:
        """Run `callback` first when this client closes (e.g. stop a membership watch)."""
        self._on_close.append(callback)

    # ---- batched operations ----

    def _remote_reads(self, option: CcKvOption) -> bool:
        """Whether a read may ask the nodes (not with `read_local_only` on a remote pool)."""
        return self.location is NodeLocation.IN_PROCESS or not option.read_local_only

    def put(
        self, request: PoolCall, values: Sequence[Sequence[Buffer]], value_lens: np.ndarray | None = None
    ) -> PoolOutcome[bool]:
        """Store each value at its owning nodes (`NodeRouter.put`: when a value counts as stored), and keep the
        stored ones in the read cache when `option.write_rcache`. `value_lens` (int64 bytes of each value) saves
        measuring every part."""
        outcome = self.router.put(request, values, value_lens)
        if self.read_cache is not None and request.option.write_rcache:
            self.read_cache.remember(request.keys, values, outcome.results)
        return outcome

    def get(self, request: PoolCall) -> PoolOutcome[Buffer | None]:
        """Each key's stored value, or None: the read cache first, then (unless local-only) the owning nodes."""
        keys, expected = request.keys, request.expected
        results: list = [None] * len(keys) if self.read_cache is None else self.read_cache.lookup(keys, expected)
        if not self._remote_reads(request.option):
            return PoolOutcome(results)
        return self.router.get(request, results)

    def get_into(self, request: PoolCall, outs: Sequence[Buffer], as_placed: AsPlaced | None = None) -> PoolOutcome[bool]:
        """Place each key's value in the caller's writable buffer `outs[i]` (the read cache first, then, unless
        local-only, the owning node, which receives it there without an intermediate copy when it travels alone);
        `results[i]` is True where a value of exactly `len(outs[i])` bytes is now in `outs[i]`. A buffer whose
        result is False holds unspecified bytes. `expected` is `get`'s.
        `as_placed`: run while a same-host node places the values, when nothing came from the read cache and the
        whole request goes to that node in one call (`NodeRouter.get_into`); else never."""
        keys, expected = request.keys, request.expected
        if len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} buffers")
        results: list = [False] * len(keys) if self.read_cache is None else self.read_cache.place(keys, outs, expected)
        if not self._remote_reads(request.option) or all(results):  # (all from the read cache: no node is asked)
            return PoolOutcome(results)
        progressive = as_placed if not any(results) else None  # (its progress counts the request from its start)
        return self.router.get_into(request, outs, results, progressive)

    def exists(self, request: PoolCall, hold: Hold | None = None) -> PoolOutcome[bool]:
        """Whether each key is held (the read cache first, then the owning nodes unless local-only). With a lease, a
        key in the read cache needs none (the load reads it there); a pin is a node's, never the cache's."""
        keys = request.keys
        cached = self.read_cache is not None and (hold is None or hold.kind is HoldKind.LEASE)
        results: list = self.read_cache.contains(keys) if cached and self.read_cache is not None else [False] * len(keys)
        if not self._remote_reads(request.option):
            return PoolOutcome(results)
        return self.router.exists(request, results, hold)

    def healthy(self, timeout_s: float = 1.0) -> bool:
        """True when at least one node answers a ping within `timeout_s` (the pool is usable)."""
        return self.router.healthy(timeout_s)

    def close(self) -> None:
        for callback in self._on_close:
            try:
                callback()
            except Exception:  # closing must release everything even if one step fails
                pass
        self.router.close()

"""Mooncake Store as the pool: `MooncakePool`, a `PoolBackend` (`ems.backends.base`) over Mooncake's Python client
(`mooncake.store.MooncakeDistributedStore`), chosen with `pool_backend="mooncake"` (docs/mooncake.md).

Contract, beyond `ems.backends.base`'s:
* Keys: `KEY_PREFIX` + this package's storage key in hex (Mooncake keys are strings). The storage key already holds
  the namespace (tenant, model, ranks, layout signature), so tenants and models stay apart exactly as on `ems`
  nodes, and no key of another Mooncake user that lacks the prefix can collide with ours. Mooncake authenticates
  nobody: any client of the same master can read, overwrite or remove these keys (docs/mooncake.md says what an
  operator must add).
* Values: this package's format, unchanged (header, layout signature, checksum); the jobs check every value they
  load, so a damaged value, one of another layout or version, or a foreign value under our key is a miss.
* Zero copy: each staging buffer is registered with the store once (`prepare_staging`) and unregistered when the
  staging pool lets go of it and no Mooncake call is in flight; a put is `batch_upsert_from` straight from the
  values' bytes (Mooncake's plain put does not replace a value; a save does, as on `ems` nodes), a receive
  `batch_get_into` straight into the caller's buffers, one Mooncake call per request (per `MAX_KEYS` keys, its `limits`). Bytes
  outside registered memory (a V0 value's separate header, a caller's own buffer) go through a registered bounce
  buffer instead: one copy, correct on every Mooncake transport.
* `get` (V0 loads) is `get_batch`: Mooncake copies through its own client buffer (`mooncake_buffer`), so a call's
  keys are read in parts within half of it.
* Per-key results: a put is stored where Mooncake answered 0; a receive placed a value where it answered exactly
  the buffer's length (any other length, a missing key, a lease that expired during the read: a miss). Answers at
  or below `POOL_FAILURE` (transfer and RPC failures: a storage process or the master gone) also count as the
  call's error, so a call that reached nothing is `unreachable` as on `ems` nodes.
* Deadlines: the binding has no timeouts (a lost master stalls a call for seconds; `setup` without a master for
  more than a minute), so every Mooncake call runs on one of this backend's daemon worker threads and the caller
  waits at most until its deadline: a call still running then fails its keys with EMS_IO_TIMEOUT. It goes on
  holding its buffers (the closure keeps them alive, so their memory is never freed under it), the outcome's error
  makes the caller retire its staging, and registered buffers are unregistered only when no call is in flight.
* Start-up: the constructor starts one `setup` attempt; `healthy()` (what `Ems.init` and `Ems.check_health` ask)
  waits for it within its timeout and starts a new attempt after a failed one, so an engine can start before
  Mooncake does. Mooncake's `setup` holds the interpreter lock while it waits for a master (over a minute when there
  is none), so an attempt first checks that the master, and a metadata server given as a URL, accept a TCP
  connection within `connect_timeout_ms`; only then does it call `setup`.
* `pool_replicas` is Mooncake's `replica_num`. There is no client-side read cache (`read_cache_capacity` does not
  apply); a `read_local_only` read never leaves the process, so it finds nothing.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import itertools
import logging
import queue
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import numpy as np
import torch

from ems.backends.base import PoolOutcome
from ems.buffers import Buffer
from ems.config import MooncakeSettings
from ems.datapath.executor import ChunkExecutor
from ems.datapath.staging import StagingLease, StagingPool
from ems.deadline import Deadline
from ems.errors import EmsErrorCode, EmsException
from ems.store.kv_store import KvStore
from ems.store.value_format import HEADER_SIZE, ExpectedValues
from ems.transport.base import AsPlaced, TransportError
from ems.transport.holds import Hold, HoldKind
from ems.transport.protocol import RequestLimits
from ems.types import CcKvOption

log = logging.getLogger("ems")
R = TypeVar("R")

KEY_PREFIX = "ems/"
MAX_KEYS = 1024  # keys per Mooncake batch call (a request of more is sent in parts, one after the other)
POOL_FAILURE = -800  # Mooncake answers at or below this: transfer (-8xx) and RPC (-9xx) failures, not a key's fate
WORKER_THREADS = 16  # Mooncake calls running at once (a call that hangs holds one until it returns)
BOUNCE_CAPACITY = 256 << 20  # registered bounce buffers in use at once
HEALTH_KEY = KEY_PREFIX + "health"
_NO_LIMIT = 1 << 62


def mooncake_key(key: bytes) -> str:
    """The Mooncake key of a storage key."""
    return KEY_PREFIX + key.hex()


def address_of(buffer: Buffer) -> int:
    """The address of a bytes-like buffer's first byte (read-only buffers too)."""
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data) if len(buffer) else 0


class _Workers:
    """Daemon threads that run calls which may hang: `call(fn, deadline)` waits for `fn` at most until `deadline`.
    A call not started by then is never started; one still running goes on in its thread (holding what `fn` holds)
    and is reported as timed out. Daemon threads: a hung call never keeps the process from exiting."""

    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        self._lock = threading.Lock()
        self._started = False
        self.in_flight = 0  # calls running now (read under `_lock`)
        self._idle: list[Callable[[], None]] = []  # run once when no call is in flight

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as error:  # delivered to the waiting caller
                future.set_exception(error)
            finally:
                del item, fn  # drop the call's buffers before saying it is over
                self._finished()

    def _finished(self) -> None:
        with self._lock:
            self.in_flight -= 1
            todo, self._idle = (self._idle, []) if self.in_flight == 0 else ([], self._idle)
        for action in todo:
            action()

    def when_idle(self, action: Callable[[], None]) -> None:
        """Run `action` now if no call is in flight, else once none is."""
        with self._lock:
            if self.in_flight:
                self._idle.append(action)
                return
        action()

    def submit(self, fn: Callable[[], R]) -> concurrent.futures.Future[R]:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self._started:
                for thread in self._threads:
                    thread.start()
                self._started = True
            self.in_flight += 1
        future.add_done_callback(lambda f: self._finished() if f.cancelled() else None)
        self._queue.put((future, fn))
        return future

    def call(self, fn: Callable[[], R], deadline: Deadline, what: str) -> R:
        """`fn()`'s result, or `TransportError(EMS_IO_TIMEOUT)` when it has not returned by `deadline`."""
        future = self.submit(fn)
        try:
            return future.result(timeout=deadline.left())
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TransportError(EmsErrorCode.EMS_IO_TIMEOUT, f"mooncake: {what} did not return in time") from None

    def close(self) -> None:
        with self._lock:
            started = self._started
        if started:
            for _ in self._threads:
                self._queue.put(None)


class _Registry:
    """The store's registered memory regions, by address (few: one per staging or bounce buffer)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._lock = threading.Lock()

    def add(self, start: int, size: int) -> None:
        with self._lock:
            i = bisect.bisect(self._starts, start)
            self._starts.insert(i, start)
            self._ends.insert(i, start + size)

    def remove(self, start: int) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, start)
            if i < len(self._starts) and self._starts[i] == start:
                del self._starts[i], self._ends[i]

    def covers(self, addresses: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Per range: whether it lies inside one registered region."""
        with self._lock:
            starts, ends = np.asarray(self._starts, dtype=np.int64), np.asarray(self._ends, dtype=np.int64)
        if starts.size == 0:
            return np.zeros(addresses.size, dtype=bool)
        i = np.searchsorted(starts, addresses, side="right") - 1
        ok = i >= 0
        j = np.maximum(i, 0)
        covered: np.ndarray = ok & (addresses >= starts[j]) & (addresses + sizes <= ends[j])
        return covered


def _failure(codes: Sequence[int], what: str) -> TransportError | None:
    """The call's error when some key failed as the pool fails (transfer, RPC), else None."""
    failed = sorted({int(c) for c in codes if int(c) <= POOL_FAILURE})
    if not failed:
        return None
    count = sum(1 for c in codes if int(c) <= POOL_FAILURE)
    return TransportError(EmsErrorCode.EMS_IO_ERROR, f"mooncake: {what} failed for {count} key(s), codes {failed}")


class MooncakePool:
    """A `PoolBackend` over a Mooncake Store deployment; see the module docstring."""

    def __init__(self, settings: MooncakeSettings, replicas: int = 1, connect_timeout_s: float = 3.0) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as exc:
            raise EmsException(
                EmsErrorCode.EMS_INTERNAL_ERROR,
                "pool_backend='mooncake' needs Mooncake's Python client: pip install mooncake-transfer-engine "
                f"(or mooncake-transfer-engine-non-cuda on hosts without CUDA): {exc}",
            ) from exc
        self.settings = settings
        self.limits = RequestLimits(
            max_keys=MAX_KEYS, max_data_bytes=_NO_LIMIT, max_meta_bytes=_NO_LIMIT, max_data_frames=_NO_LIMIT
        )
        self._factory = MooncakeDistributedStore
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = replicas
        self._connect_timeout_s = connect_timeout_s
        self._workers = _Workers(WORKER_THREADS, "ems-mooncake")
        self._store: Any = None  # set once a setup attempt succeeded
        self._attempt: concurrent.futures.Future | None = None
        self._state_lock = threading.Lock()
        self._registry = _Registry()
        self._registered: dict[int, torch.Tensor] = {}  # address -> buffer (kept alive while registered)
        self._bounce = StagingPool(BOUNCE_CAPACITY, self.prepare_staging, self.release_staging)
        self.executor = ChunkExecutor()
        self._closed = False
        self._connect()

    # ---- start-up and health

    def _connect(self) -> concurrent.futures.Future | None:
        """The setup attempt in progress, starting one when there is none (or the last one failed)."""
        with self._state_lock:
            if self._store is not None or self._closed:
                return None
            attempt = self._attempt
            if attempt is None or (attempt.done() and (attempt.exception() is not None or attempt.result() is None)):
                attempt = self._attempt = self._workers.submit(self._setup)
            return attempt

    def _reachable(self) -> str | None:
        """Why the master (or a metadata server given as a URL) does not accept a TCP connection now, or None."""
        s = self.settings
        targets = [s.master.rpartition(":")[::2]]
        if "://" in s.metadata:
            url = urlsplit(s.metadata)
            if url.hostname and url.port:
                targets.append((url.hostname, str(url.port)))
        for host, port in targets:
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=self._connect_timeout_s).close()
            except (OSError, ValueError) as error:
                return f"{host}:{port}: {error}"
        return None

    def _setup(self) -> Any:
        s = self.settings
        unreachable = self._reachable()  # before `setup`, which would hold the interpreter lock while it waits
        if unreachable is not None:
            log.warning("mooncake: not reachable yet: %s", unreachable)
            return None
        store = self._factory()
        rc = store.setup(s.hostname, s.metadata, s.segment_bytes, s.buffer_bytes, s.protocol, s.devices, s.master)
        if rc != 0:
            log.warning("mooncake: setup with master %s answered %s", s.master, rc)
            return None
        with self._state_lock:
            if self._closed:
                store.close()
                return None
            self._store = store
        log.info("mooncake: connected to master %s (%s, metadata %s)", s.master, s.protocol, s.metadata)
        return store

    def _ready(self, timeout_s: float) -> Any:
        """The set-up store, waiting at most `timeout_s` for the setup attempt; None when not (yet) set up."""
        attempt = self._connect()
        if attempt is not None:
            concurrent.futures.wait([attempt], timeout=timeout_s)
        return self._store

    def healthy(self, timeout_s: float = 1.0) -> bool:
        """True when the store is set up and its master answers within `timeout_s`; never raises."""
        deadline = Deadline.after(timeout_s)
        try:
            store = self._ready(timeout_s)
            if store is None:
                return False
            codes = self._workers.call(lambda: store.batch_is_exist([HEALTH_KEY]), deadline, "health probe")
            return len(codes) == 1 and int(codes[0]) >= 0
        except Exception:  # a probe reports, it never raises
            return False

    def describe(self) -> str:
        return f"mooncake master {self.settings.master} ({self.settings.protocol})"

    @property
    def local_store(self) -> KvStore | None:
        return None

    # ---- registered memory

    def shm_staging(self, nbytes: int) -> Any | None:
        """None: staging is this process's memory, registered with Mooncake (`prepare_staging`)."""
        return None

    def prepare_staging(self, buffer: torch.Tensor) -> None:
        """Register a new staging (or bounce) buffer with the store; kept alive while registered."""
        store = self._store
        if store is None:
            return  # not set up: unregistered bytes go through the bounce buffer (registered once set up)
        address, size = int(buffer.data_ptr()), int(buffer.numel() * buffer.element_size())
        rc = store.register_buffer(address, size)
        if rc != 0:
            log.warning("mooncake: register_buffer of %d bytes answered %s (that buffer's values bounce)", size, rc)
            return
        with self._state_lock:
            self._registered[address] = buffer
        self._registry.add(address, size)

    def release_staging(self, buffer: torch.Tensor) -> None:
        """Unregister `buffer` once no Mooncake call is in flight (one that hangs may still touch it)."""
        address = int(buffer.data_ptr())
        with self._state_lock:
            if address not in self._registered:
                return
        self._workers.when_idle(lambda: self._unregister(address))

    def _unregister(self, address: int) -> None:
        self._registry.remove(address)
        with self._state_lock:
            buffer = self._registered.pop(address, None)
            store = self._store
        if buffer is not None and store is not None:  # (after close, `close` unregisters what is left)
            store.unregister_buffer(address)

    def _bounce_lease(self, nbytes: int) -> StagingLease:
        return self._bounce.acquire(nbytes, torch.device("cpu"))

    # ---- calls

    def _begin(self, option: CcKvOption, deadline: Deadline | None) -> tuple[Any, Deadline]:
        """(the store, or None when not set up or closed; the call's deadline)."""
        if deadline is None:
            deadline = Deadline.of(option)
        if self._closed:
            return None, deadline
        return self._ready(deadline.left()), deadline

    @staticmethod
    def _not_set_up(count: int) -> PoolOutcome:
        error = TransportError(EmsErrorCode.EMS_IO_ERROR, "mooncake: not connected to the master yet")
        return PoolOutcome([False] * count, [error], nodes_contacted=1)

    def _run(self, fn: Callable[[], R], deadline: Deadline, what: str, outcome: PoolOutcome) -> R | None:
        """`fn()` on a worker by `deadline`; None (and the error in `outcome`) when it failed or timed out."""
        try:
            return self._workers.call(fn, deadline, what)
        except TransportError as error:
            outcome.errors.append(error)
        except Exception as error:  # a binding fault must not become a wrong block: the call's keys fail
            outcome.errors.append(TransportError(EmsErrorCode.EMS_IO_ERROR, f"mooncake: {what}: {error!r}"))
        return None

    def put(
        self,
        route_keys: Sequence[bytes],
        keys: Sequence[bytes],
        values: Sequence[Sequence[Buffer]],
        option: CcKvOption,
        value_lens: np.ndarray | None = None,
        deadline: Deadline | None = None,
    ) -> PoolOutcome[bool]:
        """`batch_upsert_from` of every value (replaced where it exists); True where Mooncake stored it."""
        n = len(keys)
        if n == 0:
            return PoolOutcome([])
        store, deadline = self._begin(option, deadline)
        if store is None:
            return self._not_set_up(n)
        names = [mooncake_key(k) for k in keys]
        single = np.fromiter((len(v) == 1 for v in values), dtype=bool, count=n)
        sizes = (
            np.asarray(value_lens, dtype=np.int64)
            if value_lens is not None
            else np.fromiter((sum(len(memoryview(p).cast("B")) for p in v) for v in values), dtype=np.int64, count=n)
        )
        addresses = np.zeros(n, dtype=np.int64)
        where = np.nonzero(single)[0]
        addresses[where] = np.fromiter((address_of(values[i][0]) for i in where.tolist()), np.int64, where.size)
        direct = single & self._registry.covers(addresses, sizes)
        bounce: StagingLease | None = None
        if not direct.all():  # copy those values whole into registered memory
            idx = np.nonzero(~direct)[0]
            offsets = np.concatenate(([0], np.cumsum(sizes[idx])))
            bounce = self._bounce_lease(int(offsets[-1]))
            target = bounce.host_array()
            base = int(bounce.host.data_ptr())
            for i, at in zip(idx.tolist(), offsets[:-1].tolist()):
                for part in values[i]:
                    raw = np.frombuffer(part, dtype=np.uint8)
                    target[at : at + raw.size] = raw
                    at += raw.size
            addresses[idx] = base + offsets[:-1]
        ptrs, lens = addresses.tolist(), sizes.tolist()
        replicate = self._replicate
        step = self.limits.max_keys

        def call(held: object = (values, bounce)) -> list[int]:  # `held`: the bytes stay alive while the call runs
            codes: list[int] = []
            for at in range(0, n, step):
                codes += store.batch_upsert_from(names[at : at + step], ptrs[at : at + step], lens[at : at + step], replicate)
            return codes

        outcome: PoolOutcome[bool] = PoolOutcome([False] * n, nodes_contacted=1)
        codes = self._run(call, deadline, "put", outcome)
        if codes is not None:
            outcome.results = [int(c) == 0 for c in codes]
            error = _failure(codes, "put")
            if error is not None:
                outcome.errors.append(error)
        if bounce is not None:
            (self._bounce.release if codes is not None else self._bounce.retire)(bounce)
        return outcome

    def get_into(
        self,
        route_keys: Sequence[bytes],
        keys: Sequence[bytes],
        outs: Sequence[Buffer],
        option: CcKvOption,
        expected: ExpectedValues | None = None,
        deadline: Deadline | None = None,
        as_placed: AsPlaced | None = None,
    ) -> PoolOutcome[bool]:
        """`batch_get_into` straight into `outs` (through the bounce buffer where they are not registered); True
        where a value of exactly `len(outs[i])` bytes was placed. `as_placed` is never run (Mooncake places a batch
        whole)."""
        n = len(keys)
        if len(outs) != n:
            raise ValueError(f"{n} keys but {len(outs)} buffers")
        if n == 0 or (option.read_local_only):
            return PoolOutcome([False] * n)
        store, deadline = self._begin(option, deadline)
        if store is None:
            return self._not_set_up(n)
        names = [mooncake_key(k) for k in keys]
        sizes = np.fromiter((memoryview(o).nbytes for o in outs), dtype=np.int64, count=n)
        addresses = np.fromiter((address_of(o) for o in outs), dtype=np.int64, count=n)
        direct = self._registry.covers(addresses, sizes)
        bounce: StagingLease | None = None
        idx = np.nonzero(~direct)[0]
        if idx.size:
            offsets = np.concatenate(([0], np.cumsum(sizes[idx])))
            bounce = self._bounce_lease(int(offsets[-1]))
            addresses[idx] = int(bounce.host.data_ptr()) + offsets[:-1]
        ptrs, lens = addresses.tolist(), sizes.tolist()
        step = self.limits.max_keys

        def call(held: object = (outs, bounce)) -> list[int]:  # `held`: the buffers stay alive while the call runs
            got: list[int] = []
            for at in range(0, n, step):
                got += store.batch_get_into(names[at : at + step], ptrs[at : at + step], lens[at : at + step])
            return got

        outcome: PoolOutcome[bool] = PoolOutcome([False] * n, nodes_contacted=1)
        got = self._run(call, deadline, "get_into", outcome)
        if got is not None:
            placed = np.asarray(got, dtype=np.int64) == sizes
            if bounce is not None:
                source = bounce.host_array()
                for i, at in zip(idx.tolist(), (addresses[idx] - int(bounce.host.data_ptr())).tolist()):
                    if placed[i]:
                        memoryview(outs[i]).cast("B")[:] = source[at : at + int(sizes[i])].data
            outcome.results = placed.tolist()
            error = _failure(got, "get_into")
            if error is not None:
                outcome.errors.append(error)
        if bounce is not None:
            (self._bounce.release if got is not None else self._bounce.retire)(bounce)
        return outcome

    def get(
        self,
        route_keys: Sequence[bytes],
        keys: Sequence[bytes],
        option: CcKvOption,
        expected: ExpectedValues | None = None,
    ) -> PoolOutcome[Buffer | None]:
        """`get_batch` (Mooncake's own buffer, in parts within half of it by the expected sizes): each value, or
        None."""
        n = len(keys)
        if n == 0 or option.read_local_only:
            return PoolOutcome([None] * n)
        store, deadline = self._begin(option, None)
        if store is None:
            missing: PoolOutcome[Buffer | None] = self._not_set_up(n)
            missing.results = [None] * n
            return missing
        names = [mooncake_key(k) for k in keys]
        if expected is not None:
            sizes = np.asarray(expected.payload_len, dtype=np.int64) + HEADER_SIZE
            zeros = np.zeros(n, dtype=np.int64)
            batches = self.limits.capped(max(1, self.settings.buffer_bytes // 2)).batches((sizes, zeros, zeros))
            cuts = [0] + [b.stop for b in batches]
        else:
            cuts = list(range(0, n, self.limits.max_keys)) + [n]

        def call() -> list[bytes]:
            values: list[bytes] = []
            for a, b in itertools.pairwise(cuts):
                values += store.get_batch(names[a:b])
            return values

        outcome: PoolOutcome[Buffer | None] = PoolOutcome([None] * n, nodes_contacted=1)
        values = self._run(call, deadline, "get", outcome)
        if values is not None:
            outcome.results = [v if len(v) else None for v in values]
        return outcome

    def exists(
        self, route_keys: Sequence[bytes], keys: Sequence[bytes], option: CcKvOption, hold: Hold | None = None
    ) -> PoolOutcome[bool]:
        """`batch_is_exist`: True where Mooncake holds the key. Mooncake's master leases every object an exists finds
        (its own `default_kv_lease_ttl`, 5 s by default: eviction passes it by meanwhile), so a lease asked for is
        Mooncake's, of Mooncake's length, ended by its time only. A pin cannot be added to an object Mooncake already
        holds (its pins are set when an object is put): False for every key."""
        n = len(keys)
        if n == 0 or option.read_local_only or (hold is not None and hold.kind is HoldKind.PIN):
            return PoolOutcome([False] * n)
        store, deadline = self._begin(option, None)
        if store is None:
            return self._not_set_up(n)
        names = [mooncake_key(k) for k in keys]
        step = self.limits.max_keys

        def call() -> list[int]:
            codes: list[int] = []
            for at in range(0, n, step):
                codes += store.batch_is_exist(names[at : at + step])
            return codes

        outcome: PoolOutcome[bool] = PoolOutcome([False] * n, nodes_contacted=1)
        codes = self._run(call, deadline, "exists", outcome)
        if codes is not None:
            outcome.results = [int(c) == 1 for c in codes]
            if any(int(c) < 0 for c in codes):
                failed = sorted({int(c) for c in codes if int(c) < 0})
                outcome.errors.append(TransportError(EmsErrorCode.EMS_IO_ERROR, f"mooncake: exists answered {failed}"))
        return outcome

    def close(self) -> None:
        """Stop taking calls, stop the pipeline threads, then unregister the buffers and close Mooncake's client once
        no Mooncake call is in flight (closing it under a running call would free what that call uses): now, waiting
        at most `connect_timeout_ms`, or, when a call still hangs, on its own thread when the last one returns."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            store, self._store = self._store, None
        self.executor.close()
        self._bounce.clear()
        closed = threading.Event()

        def close_store() -> None:
            try:
                with self._state_lock:
                    registered, self._registered = list(self._registered), {}
                for address in registered:
                    store.unregister_buffer(address)
                store.close()
            except Exception as error:  # closing releases what it can, and never raises
                log.warning("mooncake: close failed: %s", error)
            finally:
                closed.set()

        if store is not None:
            closer = threading.Thread(target=close_store, name="ems-mooncake-close", daemon=True)
            self._workers.when_idle(closer.start)
            if closer.ident is not None and not closed.wait(self._connect_timeout_s):  # started now: bounded wait
                log.warning("mooncake: close did not finish within %.1f s", self._connect_timeout_s)
        self._workers.close()

"""Mooncake Store as the pool: `MooncakePool`, a `PoolBackend` (`ems.backends.base`) over Mooncake's Python client
(`mooncake.store.MooncakeDistributedStore`), chosen with `pool_backend="mooncake"` (docs/guides/mooncake.md).

Contract, beyond `ems.backends.base`'s:
* Keys: `keys.mooncake_key` (the storage key in hex, prefixed). Mooncake authenticates nobody: any client of the
  same master can read, overwrite or remove these keys (docs/guides/mooncake.md says what an operator must add).
* Values: this package's format, unchanged (header, layout signature, checksum); the jobs check every value they
  load, so a damaged value, one of another layout or version, or a foreign value under our key is a miss.
* Zero copy: a put is `batch_upsert_from` straight from the values' bytes (Mooncake's plain put does not replace a
  value; a save does, as on `ems` nodes), a receive `batch_get_into` straight into the caller's buffers, one
  Mooncake call per request (per `MAX_KEYS` keys, its `limits`), where those bytes lie in registered memory;
  others bounce (`memory.RegisteredMemory`: registration of staging, the bounce buffer).
* `get` (V0 loads) is `get_batch`: Mooncake copies through its own client buffer (`mooncake_buffer`), so a call's
  keys are read in parts within half of it.
* Per-key results: a put is stored where Mooncake answered 0; a receive placed a value where it answered exactly
  the buffer's length (any other length, a missing key, a lease that expired during the read: a miss). Answers at
  or below `POOL_FAILURE` (transfer and RPC failures: a storage process or the master gone) also count as the
  call's error, so a call that reached nothing is `unreachable` as on `ems` nodes.
* Deadlines: every Mooncake call runs on one of this backend's daemon worker threads (`workers.Workers`) and the
  caller waits at most until its deadline: a call still running then fails its keys with EMS_IO_TIMEOUT. It goes on
  holding its buffers (the closure keeps them alive, so their memory is never freed under it), the outcome's error
  makes the caller retire its staging, and registered buffers are unregistered only when no call is in flight.
* Start-up and health: `connection.MooncakeConnection` (an engine can start before Mooncake does); a call while the
  store is not set up fails its keys (`unreachable`), it does not wait past its deadline.
* `pool_replicas` is Mooncake's `replica_num`. There is no client-side read cache (`read_cache_capacity` does not
  apply); a `read_local_only` read never leaves the process, so it finds nothing.
* Close: stop taking calls and the pipeline threads, then unregister the buffers and close Mooncake's client once no
  Mooncake call is in flight (closing it under a running call would free what that call uses).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from ems.backends.base import InPlaceValues, PoolCall, PoolOutcome, ReadCheck
from ems.backends.mooncake.connection import MooncakeConnection
from ems.backends.mooncake.keys import mooncake_key
from ems.backends.mooncake.memory import RegisteredMemory
from ems.backends.mooncake.workers import Workers
from ems.buffers import Buffer
from ems.errors import EmsErrorCode, EmsException
from ems.records import Deadline
from ems.settings import MooncakeSettings
from ems.store.value_format import HEADER_SIZE
from ems.transport.base import AsPlaced, TransportError
from ems.transport.exists_holds import Hold, HoldKind
from ems.transport.protocol import RequestLimits

log = logging.getLogger("ems")
R = TypeVar("R")

MAX_KEYS = 1024  # keys per Mooncake batch call (a request of more is sent in parts, one after the other)
POOL_FAILURE = -800  # Mooncake answers at or below this: transfer (-8xx) and RPC (-9xx) failures, not a key's fate
WORKER_THREADS = 16  # Mooncake calls running at once (a call that hangs holds one until it returns)
_NO_LIMIT = 1 << 62


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
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = replicas
        self._connect_timeout_s = connect_timeout_s
        self._workers = Workers(WORKER_THREADS, "ems-mooncake")
        self._connection = MooncakeConnection(settings, MooncakeDistributedStore, self._workers, connect_timeout_s)
        self._memory = RegisteredMemory(lambda: self._connection.store, self._workers)
        #: values move through put and get_into (Mooncake's memory is not this process's to lend)
        self.in_place: InPlaceValues | None = None
        self.read_check = ReadCheck.NONE  # (Mooncake's bytes as stored: the jobs check them)

    def healthy(self, timeout_s: float = 1.0) -> bool:
        """True when the store is set up and its master answers within `timeout_s`; never raises."""
        return self._connection.healthy(timeout_s)

    def describe(self) -> str:
        return f"mooncake master {self.settings.master} ({self.settings.protocol})"

    # ---- registered memory (`memory.RegisteredMemory`)

    def shm_staging(self, nbytes: int) -> Any | None:
        """None: staging is this process's memory, registered with Mooncake (`prepare_staging`)."""
        return None

    def prepare_staging(self, buffer: torch.Tensor) -> None:
        """Register a new staging buffer with the store; kept alive while registered."""
        self._memory.prepare(buffer)

    def release_staging(self, buffer: torch.Tensor) -> None:
        """Unregister `buffer` once no Mooncake call is in flight (one that hangs may still touch it)."""
        self._memory.release(buffer)

    # ---- calls

    def _begin(self, request: PoolCall) -> tuple[Any, Deadline]:
        """(the store, or None when not set up or closed; the call's deadline)."""
        deadline = request.until()
        if self._connection.closed:
            return None, deadline
        return self._connection.ready(deadline.left()), deadline

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
        self, request: PoolCall, values: Sequence[Sequence[Buffer]], value_lens: np.ndarray | None = None
    ) -> PoolOutcome[bool]:
        """`batch_upsert_from` of every value (replaced where it exists); True where Mooncake stored it."""
        keys = request.keys
        n = len(keys)
        if n == 0:
            return PoolOutcome([])
        store, deadline = self._begin(request)
        if store is None:
            return self._not_set_up(n)
        names = [mooncake_key(k) for k in keys]
        sizes = (
            np.asarray(value_lens, dtype=np.int64)
            if value_lens is not None
            else np.fromiter((sum(len(memoryview(p).cast("B")) for p in v) for v in values), dtype=np.int64, count=n)
        )
        placement = self._memory.sources(values, sizes)
        ptrs, lens = placement.addresses.tolist(), sizes.tolist()
        replicate = self._replicate
        step = self.limits.max_keys

        def call(held: object = (values, placement)) -> list[int]:  # `held`: the bytes stay alive while it runs
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
        self._memory.give_back(placement, codes is not None)
        return outcome

    def get_into(self, request: PoolCall, outs: Sequence[Buffer], as_placed: AsPlaced | None = None) -> PoolOutcome[bool]:
        """`batch_get_into` straight into `outs` (through the bounce buffer where they are not registered); True
        where a value of exactly `len(outs[i])` bytes was placed. `as_placed` is never run (Mooncake places a batch
        whole)."""
        keys = request.keys
        n = len(keys)
        if len(outs) != n:
            raise ValueError(f"{n} keys but {len(outs)} buffers")
        if n == 0 or request.option.read_local_only:
            return PoolOutcome([False] * n)
        store, deadline = self._begin(request)
        if store is None:
            return self._not_set_up(n)
        names = [mooncake_key(k) for k in keys]
        sizes = np.fromiter((memoryview(o).nbytes for o in outs), dtype=np.int64, count=n)
        placement = self._memory.targets(outs, sizes)
        ptrs, lens = placement.addresses.tolist(), sizes.tolist()
        step = self.limits.max_keys

        def call(held: object = (outs, placement)) -> list[int]:  # `held`: the buffers stay alive while it runs
            got: list[int] = []
            for at in range(0, n, step):
                got += store.batch_get_into(names[at : at + step], ptrs[at : at + step], lens[at : at + step])
            return got

        outcome: PoolOutcome[bool] = PoolOutcome([False] * n, nodes_contacted=1)
        got = self._run(call, deadline, "get_into", outcome)
        if got is not None:
            placed = np.asarray(got, dtype=np.int64) == sizes
            self._memory.copy_back(placement, outs, sizes, placed)
            outcome.results = placed.tolist()
            error = _failure(got, "get_into")
            if error is not None:
                outcome.errors.append(error)
        self._memory.give_back(placement, got is not None)
        return outcome

    def get(self, request: PoolCall) -> PoolOutcome[Buffer | None]:
        """`get_batch` (Mooncake's own buffer, in parts within half of it by the expected sizes): each value, or
        None."""
        keys, expected = request.keys, request.expected
        n = len(keys)
        if n == 0 or request.option.read_local_only:
            return PoolOutcome([None] * n)
        store, deadline = self._begin(request)
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

    def exists(self, request: PoolCall, hold: Hold | None = None) -> PoolOutcome[bool]:
        """`batch_is_exist`: True where Mooncake holds the key. Mooncake's master leases every object an exists finds
        (its own `default_kv_lease_ttl`, 5 s by default: eviction passes it by meanwhile), so a lease asked for is
        Mooncake's, of Mooncake's length, ended by its time only. A pin cannot be added to an object Mooncake already
        holds (its pins are set when an object is put): False for every key."""
        keys = request.keys
        n = len(keys)
        if n == 0 or request.option.read_local_only or (hold is not None and hold.kind is HoldKind.PIN):
            return PoolOutcome([False] * n)
        store, deadline = self._begin(request)
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
        no Mooncake call is in flight: now, waiting at most `connect_timeout_ms`, or, when a call still hangs, on its
        own thread when the last one returns."""
        first, store = self._connection.close()
        if not first:
            return
        self._memory.clear()
        closed = threading.Event()

        def close_store() -> None:
            try:
                for address in self._memory.drain():
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

"""The embedded pool: `EmbeddedPool`, a `PoolBackend` (`ems.backends.base`) over a store in this process
(`ems.store.kv_store.KvStore`, the same store code a pool node runs), what `Ems.init` picks when no pool nodes are
configured.

Contract, beyond `ems.backends.base`'s:
* One owner for every key, in this process: no routing, no replicas, no read cache (reads never leave the process,
  so `read_local_only` changes nothing), no threads of its own; calls answer on the caller's
  thread and cannot hang.
* `in_place` is the store (`InPlaceValues`): the jobs on CPU tensors write values straight into the store's own
  buffers and read them where they lie (`ems.datapath.jobs.embedded`), and `exists` is the store's index. The
  other calls (the pipelined jobs, accelerators) move values as to a pool node, cut by the jobs within `limits`
  (the wire's, as for nodes).
* A put or a `get_into` whose deadline (a job's, handed down) has passed before the store is asked fails its keys
  with `EMS_IO_TIMEOUT`; otherwise every call is answered at once (the store cannot hang: a `get` or an `exists`,
  whose deadline starts with the call, never times out). A put stores what the store admits (`KvStore.put_many`:
  a malformed value or one larger than the pool is refused); a read of a value of another length than the caller's
  buffer is a miss.
* Closing stops the store's background threads; values already handed out stay readable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from ems.backends.base import InPlaceValues, PoolCall, PoolOutcome, ReadCheck
from ems.buffers import Buffer
from ems.errors import EmsErrorCode
from ems.records import Deadline
from ems.store.kv_store import KvStore
from ems.transport.base import AsPlaced, TransportError, place_values
from ems.transport.exists_holds import Hold
from ems.transport.protocol import WIRE_LIMITS, RequestLimits

T = TypeVar("T")


class EmbeddedPool:
    """The pool in this process, over its store; see the module docstring."""

    def __init__(self, store: KvStore, limits: RequestLimits = WIRE_LIMITS) -> None:
        self.store = store
        self.limits = limits
        self.in_place: InPlaceValues | None = store
        self.read_check = ReadCheck.NONE  # (the store's bytes as they are: the jobs check them)

    def describe(self) -> str:
        return "embedded"

    def prepare_staging(self, buffer: Any) -> None:
        """Nothing to do: the store copies from and to any memory of this process."""

    def release_staging(self, buffer: Any) -> None:
        """Nothing to do (see `prepare_staging`)."""

    def shm_staging(self, nbytes: int) -> Any | None:
        """None: the store is in this process already (staging comes from the staging pool)."""
        return None

    @staticmethod
    def _answer(keys: Sequence[bytes], miss: T, deadline: Deadline, ask: Callable[[], list[T]]) -> PoolOutcome[T]:
        """The store's answer for `keys` (`ask`), or every key a miss with `EMS_IO_TIMEOUT` once `deadline` passed."""
        if not keys:
            return PoolOutcome([])
        if deadline.expired():
            error = TransportError(EmsErrorCode.EMS_IO_TIMEOUT, "embedded: no answer in time")
            return PoolOutcome([miss] * len(keys), [error], nodes_contacted=1)
        return PoolOutcome(ask(), nodes_contacted=1)

    def put(
        self, request: PoolCall, values: Sequence[Sequence[Buffer]], value_lens: np.ndarray | None = None
    ) -> PoolOutcome[bool]:
        """Store each value (its parts concatenated, copied into the store); True where the store admitted it."""
        keys = request.keys
        return self._answer(keys, False, request.until(), lambda: self.store.put_many(keys, values))

    def get(self, request: PoolCall) -> PoolOutcome[Buffer | None]:
        """Each key's stored value (a read-only view of the store's bytes), or None; not checked here (the caller
        checks against `expected`)."""
        keys = request.keys
        return PoolOutcome(self.store.get_many(keys), nodes_contacted=1) if keys else PoolOutcome([])

    def get_into(self, request: PoolCall, outs: Sequence[Buffer], as_placed: AsPlaced | None = None) -> PoolOutcome[bool]:
        """Each key's value copied into `outs[i]`; True where a value of exactly `len(outs[i])` bytes is there.
        `as_placed` is never run (the values are placed before the call returns)."""
        keys = request.keys
        if len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} buffers")
        return self._answer(keys, False, request.until(), lambda: place_values(self.store.get_many(keys), outs))

    def exists(self, request: PoolCall, hold: Hold | None = None) -> PoolOutcome[bool]:
        """Whether the store's index holds each key (with `hold`: holds it and keeps it as asked)."""
        keys = request.keys
        if not keys:
            return PoolOutcome([])
        held = self.store.contains_many(keys) if hold is None else self.store.hold_many(keys, hold)
        return PoolOutcome(held, [], 1)  # (positional: the lookup's fast path, ~0.1 µs less than by keyword)

    def healthy(self, timeout_s: float = 1.0) -> bool:
        """Always True: the pool is this process."""
        return True

    def close(self) -> None:
        self.store.close()  # its background threads stop; the values stay readable

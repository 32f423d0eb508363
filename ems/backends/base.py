"""The pool backend contract: what the jobs, `ContextCaching` and `Ems` use of a pool, whichever pool it is.

Two implementations: `ems.backends.pool_client.PoolClient` (the embedded store, or `ems.pool` nodes over UCX: routing,
replicas and the read cache on the client) and `ems.backends.mooncake.MooncakePool` (a Mooncake Store deployment, which
places and replicates by itself). `Ems.init` picks one from the `pool_backend` setting; nothing above it knows which.

Contract, for every implementation:
* Keys are opaque bytes (this package's storage keys, namespaced per tenant, model and layout); values are this
  package's format (`ems.store.value_format`), written and checked above the backend: a backend stores bytes.
* Results come back per key in request order in a `PoolOutcome`; a key that failed is a miss (False / None), never
  a wrong value; a backend that failed as a whole reports it in `errors` (`unreachable` when it is all there was).
* Every call returns by the option's timeout, or by `deadline` (`ems.deadline.Deadline`) where given, even when the
  pool hangs. A buffer handed to a call that did not return in time, or returned with `errors`, may still be touched by
  the transfer for a while: the caller retires it (`StagingPool.retire`), never reuses it.
* `executor` (`ems.datapath.executor.ChunkExecutor`) runs the jobs' chunk calls (a job's chunks in flight at once), one
  per backend, so the number of chunk calls at once is capped per client; the backend closes it.
* `limits` (`ems.transport.protocol.RequestLimits`) is the most one request may carry: the jobs cut their chunks
  with it, the backend its requests.
* `shm_staging(nbytes)`: a staging buffer in memory the pool shares with this process (an `ems` node on this host),
  or None.
* `prepare_staging(buffer)` is called once for each host staging buffer before it carries values, and
  `release_staging(buffer)` once when the staging pool lets go of it: a backend that moves bytes from and to
  registered memory registers it in between (and keeps it alive until no transfer can touch it any more).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np

from ems.buffers import Buffer
from ems.datapath.executor import ChunkExecutor
from ems.deadline import Deadline
from ems.errors import EmsErrorCode
from ems.store.kv_store import KvStore
from ems.store.value_format import ExpectedValues
from ems.transport.base import AsPlaced, TransportError
from ems.transport.holds import Hold
from ems.transport.protocol import RequestLimits
from ems.types import CcKvOption

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


@dataclass
class PoolOutcome(Generic[T]):
    """Per-key results in request order, and the errors of the nodes that failed."""

    results: list[T]
    errors: list[TransportError] = field(default_factory=list)
    nodes_contacted: int = 0
    #: a get's present values were all checked against `expected` already (the caller need not check them again)
    verified: bool = False

    @property
    def unreachable(self) -> bool:
        """Every node this call needed failed."""
        return self.nodes_contacted > 0 and len(self.errors) == self.nodes_contacted

    def first_error(self) -> TransportError | None:
        """The error to raise for an unreachable pool: a timeout if any node timed out."""
        for error in self.errors:
            if error.status_code() == EmsErrorCode.EMS_IO_TIMEOUT:
                return error
        return self.errors[0] if self.errors else None


class PoolBackend(Protocol):
    """A pool as the SDK's data path sees it; see the module docstring."""

    #: the most one request may carry (the jobs cut chunks within it)
    limits: RequestLimits
    #: the jobs' chunk calls run here
    executor: ChunkExecutor

    @property
    def local_store(self) -> KvStore | None:
        """The embedded store when the pool is in this process (the one-pass data path), else None."""
        ...

    def describe(self) -> str:
        """The pool in a few words, for logs ("embedded", node addresses, the Mooncake master)."""
        ...

    def prepare_staging(self, buffer: torch.Tensor) -> None:
        """Make a new host staging buffer (uint8, contiguous) ready to carry values (e.g. register it)."""
        ...

    def shm_staging(self, nbytes: int) -> Any | None:
        """A staging buffer of `nbytes` in memory the pool shares with this process (`StagingPool.acquire`'s
        `shared`), or None: then staging comes from the staging pool."""
        ...

    def release_staging(self, buffer: torch.Tensor) -> None:
        """The staging pool no longer keeps `buffer` (undo `prepare_staging` once no transfer can touch it)."""
        ...

    def put(
        self,
        route_keys: Sequence[bytes],
        keys: Sequence[bytes],
        values: Sequence[Sequence[Buffer]],
        option: CcKvOption,
        value_lens: np.ndarray | None = None,
        deadline: Deadline | None = None,
    ) -> PoolOutcome[bool]:
        """Store each value (its parts concatenated); True where stored."""
        ...

    def get(
        self,
        route_keys: Sequence[bytes],
        keys: Sequence[bytes],
        option: CcKvOption,
        expected: ExpectedValues | None = None,
    ) -> PoolOutcome[Buffer | None]:
        """Each key's stored value, or None."""
        ...

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
        """Each key's value placed in `outs[i]`; True where a value of exactly `len(outs[i])` bytes is there.
        `as_placed`: a pool may run it while the values are still being placed (a same-host node, the buffers in its
        shared region: `transport.base.AsPlaced`), or never."""
        ...

    def exists(
        self, route_keys: Sequence[bytes], keys: Sequence[bytes], option: CcKvOption, hold: Hold | None = None
    ) -> PoolOutcome[bool]:
        """Whether the pool holds each key; with `hold` (`ems.transport.holds`), whether it holds it and keeps it as
        asked: leased until it is read or the lease's time has passed, or pinned. A pool that cannot keep keys so
        says False for them (a lookup then promises nothing it could lose)."""
        ...

    def healthy(self, timeout_s: float = 1.0) -> bool:
        """True when the pool answers within `timeout_s`; never raises."""
        ...

    def close(self) -> None:
        """Release threads, connections and registrations."""
        ...

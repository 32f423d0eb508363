"""The pool backend contract: what the jobs, `ContextCaching` and `Ems` use of a pool, whichever pool it is.

Three implementations: `ems.backends.embedded.EmbeddedPool` (the store in this process), `ems.backends.pool_client.PoolClient`
(`ems.pool` nodes over UCX: routing, replicas and the read cache on the client) and `ems.backends.mooncake.MooncakePool`
(a Mooncake Store deployment, which places and replicates by itself). `Ems.init` picks one from the settings (no pool
nodes: embedded; `pool_backend`); nothing above it knows which, beyond what the contract says a backend can do.

Contract, for every implementation:
* Every data call takes one `PoolCall`: its `keys`, the `route_keys` (and `units`) placement goes by, its `option`,
  and where the call uses them its `deadline` and its `expected` values; the request checks its lengths once.
* Keys are opaque bytes (this package's storage keys, namespaced per tenant, model and layout); values are this
  package's format (`ems.store.value_format`), written and checked above the backend: a backend stores bytes.
* Results come back per key in request order in a `PoolOutcome`; a key that failed is a miss (False / None), never
  a wrong value; a backend that failed as a whole reports it in `errors` (`unreachable` when it is all there was).
* Every call returns by the option's timeout, or by the request's `deadline` (`ems.records.Deadline`) where given,
  even when the pool hangs (`PoolCall.until`). A buffer handed to a call that did not return in time, or returned
  with `errors`, may still be touched by the transfer for a while: the caller retires it (`StagingPool.retire`),
  never reuses it.
* `limits` (`ems.transport.protocol.RequestLimits`) is the most one request may carry: the jobs cut their chunks
  with it, the backend its requests.
* `read_check` (`ReadCheck`): what the pool's reads check of the values they return, given the request's `expected`,
  stated once per backend: the load jobs choose from it, once, what they check themselves.
* `in_place`: where the pool's values lie in this process's memory, what it lends the one-pass jobs
  (`InPlaceValues`: buffers to write values into, the stored bytes where they lie); None for a pool elsewhere, whose
  values move through `put` and `get_into`.
* `shm_staging(nbytes)`: a staging buffer in memory the pool shares with this process (an `ems` node on this host),
  or None.
* `prepare_staging(buffer)` is called once for each host staging buffer before it carries values, and
  `release_staging(buffer)` once when the staging pool lets go of it: a backend that moves bytes from and to
  registered memory registers it in between (and keeps it alive until no transfer can touch it any more).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np

from ems.buffers import Buffer
from ems.errors import EmsErrorCode, EmsException
from ems.records import Deadline
from ems.store.value_format import ExpectedValues
from ems.transport.base import AsPlaced, TransportError
from ems.transport.exists_holds import Hold
from ems.transport.protocol import RequestLimits
from ems.types import CcKvOption

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


class ReadCheck(enum.Enum):
    """What a pool's reads (`get`, `get_into`) check of the values they return, given the `expected` values
    (`PoolBackend.read_check`)."""

    #: the bytes as stored: the load checks them (`ems.datapath.copier.Copier.check`)
    NONE = "none"
    #: every value a read returns is exactly the expected one, header and checksum (with replicas a damaged copy
    #: sends the read on to the next owner, so the pool checks each value anyway)
    EXPECTED = "expected"


@dataclass(slots=True)
class PoolCall:
    """One pool call's keys and terms (every data call of `PoolBackend` takes one): `keys[i]` is stored under and
    placed by `route_keys[i]`; `option` is the caller's (its timeout, `write_rcache`, `read_local_only`); `deadline`,
    where given, replaces the option's timeout (a job's, handed down to its chunks); `expected` (`put` and `exists`
    ignore it) is what each value must be, for the pools that check their reads (`ReadCheck`). Raises
    `EmsException(EMS_INVALID_ARGUMENT)` when `route_keys` or `expected` does not have one entry per key.

    A value: nothing changes a request once it is built (a plain slotted dataclass, not a frozen one: building a
    frozen one costs about 0.5 µs more, a tenth of an embedded `exists`, which builds one per call)."""

    route_keys: Sequence[bytes]
    keys: Sequence[bytes]
    option: CcKvOption
    deadline: Deadline | None = None
    expected: ExpectedValues | None = None
    #: u64 `[keys]`: each key's placement unit (`ems.datapath.keys.chain_keys`, `ems.cluster.rendezvous`); None: each
    #: key is placed by its route key alone
    units: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.keys)
        if len(self.route_keys) != n:
            raise EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, f"route_keys: {len(self.route_keys)} for {n} keys")
        if self.units is not None and len(self.units) != n:
            raise EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, f"units: {len(self.units)} for {n} keys")
        if self.expected is not None and len(self.expected.payload_len) != n:
            raise EmsException(
                EmsErrorCode.EMS_INVALID_ARGUMENT, f"expected: {len(self.expected.payload_len)} values for {n} keys"
            )

    def until(self) -> Deadline:
        """The call's deadline: the request's, else the option's timeout from now (call it once, as the call starts)."""
        return self.deadline if self.deadline is not None else Deadline.of(self.option)


@dataclass
class PoolOutcome(Generic[T]):
    """Per-key results in request order, and the errors of the nodes that failed."""

    results: list[T]
    errors: list[TransportError] = field(default_factory=list)
    nodes_contacted: int = 0

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


class InPlaceValues(Protocol):
    """A pool's values in this process's memory, as the one-pass jobs (`ems.datapath.jobs.embedded`) use them: a save
    takes buffers for its values (`allocate_many`, room made and reserved in one step), writes every byte of each and
    hands them over under their keys without a copy (`put_owned_many`), or gives back those it will not store
    (`recycle`); a load reads the stored bytes where they lie (`get_many_with_addresses`: read-only views, and each
    one's address where known). `ems.store.kv_store.KvStore` is one (its docstring is the full contract)."""

    @property
    def capacity_bytes(self) -> int:
        """The most the pool holds (a value charged more than this is refused)."""
        ...

    def allocate_many(self, sizes: Sequence[int] | np.ndarray, reserves: Sequence[int]) -> tuple[list[np.ndarray], list[int]]:
        """Writable buffers of `sizes[i]` bytes (stale bytes: the caller overwrites every one), each reserving
        `reserves[i]`, and their addresses."""
        ...

    def put_owned_many(
        self, keys: Sequence[bytes], values: Sequence[np.ndarray], reserved: Sequence[int], addresses: Sequence[int]
    ) -> None:
        """Store buffers from `allocate_many`, each a well-formed value now, under `keys` (no copy: the pool owns them)."""
        ...

    def recycle(self, buffer: np.ndarray, reserved: int = 0, address: int | None = None) -> None:
        """Give back a buffer from `allocate_many` that will not be stored, and its reservation."""
        ...

    def get_many_with_addresses(self, keys: Sequence[bytes]) -> tuple[list[Buffer | None], list[int | None]]:
        """Each key's stored bytes (a read-only view) or None, and each hit's address where known."""
        ...


class PoolBackend(Protocol):
    """A pool as the SDK's data path sees it; see the module docstring."""

    #: the most one request may carry (the jobs cut chunks within it)
    limits: RequestLimits
    #: the pool's values in this process's memory, lent to the one-pass jobs; None: the pool is elsewhere
    in_place: InPlaceValues | None
    #: what the pool's reads check of the values they return (given `expected`)
    read_check: ReadCheck

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
        self, request: PoolCall, values: Sequence[Sequence[Buffer]], value_lens: np.ndarray | None = None
    ) -> PoolOutcome[bool]:
        """Store each value (its parts concatenated) under its key; True where stored. `value_lens` (int64 bytes of
        each value, its parts together) saves measuring every part where the caller knows them."""
        ...

    def get(self, request: PoolCall) -> PoolOutcome[Buffer | None]:
        """Each key's stored value, or None."""
        ...

    def get_into(self, request: PoolCall, outs: Sequence[Buffer], as_placed: AsPlaced | None = None) -> PoolOutcome[bool]:
        """Each key's value placed in `outs[i]` (one buffer per key); True where a value of exactly `len(outs[i])`
        bytes is there. `as_placed`: a pool may run it while the values are still being placed (a same-host node, the
        buffers in its shared region: `transport.base.AsPlaced`), or never."""
        ...

    def exists(self, request: PoolCall, hold: Hold | None = None) -> PoolOutcome[bool]:
        """Whether the pool holds each key; with `hold` (`ems.transport.exists_holds`), whether it holds it and keeps it as
        asked: leased until it is read or the lease's time has passed, or pinned. A pool that cannot keep keys so
        says False for them (a lookup then promises nothing it could lose)."""
        ...

    def healthy(self, timeout_s: float = 1.0) -> bool:
        """True when the pool answers within `timeout_s`; never raises."""
        ...

    def close(self) -> None:
        """Release threads, connections and registrations."""
        ...

"""The transport contract: one pool node, as a client sees it.

A `NodeClient` carries batched requests to one node: a remote pool node (`ucx.py`), or a store in this process
served as a node (`inprocess.py`: the nodes of in-process clusters; the embedded pool is a backend of its own,
`ems.backends.embedded`). Every call takes a `Deadline` (`ems.records`; a caller holding seconds may pass those,
`Deadline.within`) and must return or raise by it, even when the node hangs; a node that fails raises
`TransportError` with `EMS_IO_ERROR` (lost, refused, malformed reply) or `EMS_IO_TIMEOUT` (no answer in time).
Per-key outcomes (a refused put, a missing key) are results, not errors.

Layering: the transport imports nothing of `ems` but the leaf modules `ems.errors`, `ems.records` (deadlines) and `ems.buffers`
(the `Buffer` type both sides share), and the in-process node reaches the embedded store only through `LocalStore`, so
`ems.transport.*` never imports `ems.store.kv_store` (tests/transport/test_layering.py checks it).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ems.buffers import Buffer
from ems.errors import EmsErrorCode, EmsException
from ems.records import Deadline
from ems.transport.exists_holds import Hold

if TYPE_CHECKING:
    import numpy as np

#: A load's use of values while a same-host node is still placing them (`NodeClient.places_progressively`):
#: called with the address of the request's progress word (a u32: how many leading values are placed, `transport.shm`),
#: the descriptor to watch for the node's reply, and the call's deadline in CLOCK_MONOTONIC nanoseconds.
AsPlaced = Callable[[int, int, int], None]


class LocalStore(Protocol):
    """What the in-process node needs of a store in this process (`ems.store.kv_store.KvStore` is one)."""

    def put_many(self, keys: Sequence[bytes], values: Sequence[Sequence[Buffer]]) -> list[bool]: ...

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]: ...

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...

    def hold_many(self, keys: Sequence[bytes], hold: Hold) -> list[bool]: ...

    def close(self) -> None: ...


def place_values(values: Sequence[Buffer | None], outs: Sequence[Buffer]) -> list[bool]:
    """Copy each value into the writable buffer beside it in `outs`; True where there was a value of exactly that
    buffer's length (False: a miss, or another length; that buffer's bytes are then unchanged)."""
    placed = []
    for value, out in zip(values, outs):
        target = memoryview(out).cast("B")
        if value is None or memoryview(value).nbytes != target.nbytes:
            placed.append(False)
            continue
        target[:] = memoryview(value).cast("B")
        placed.append(True)
    return placed


class NodeLocation(enum.Enum):
    """Where a node's store lives, as its client states it (`NodeClient.location`)."""

    #: in this process's memory (`inprocess.InProcessNode`): a call cannot hang nor fail to reach it, so the pool
    #: client calls it on the calling thread, keeps no read cache in front of it and always reads it
    IN_PROCESS = "in-process"
    #: in another process, on this host or another, reached over the wire
    REMOTE = "remote"


class TransportError(EmsException):
    """A node failed as a whole (connection, protocol or timeout)."""

    def __init__(self, status_code: EmsErrorCode, message: str) -> None:
        super().__init__(status_code, message)


class Failure(enum.Enum):
    """What the last failed call of a remote node's client ran into (`UcxNode.last_failure`)."""

    NONE = "none"
    UNREACHABLE = "unreachable"  # connection refused, reset or lost; malformed replies
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"  # the call's connection was aborted by this client (`abort`, `close`, another's deadline)
    REFUSED = "refused"  # the node answered with an error (authentication failed)


class Ending(enum.Enum):
    """Why a connection to a remote node was aborted (`ucx.direct.Connection.ending`), whichever medium the failed
    request travelled on: only a failure the wire reported makes its client back off before reconnecting."""

    CANCELLED = "cancelled"  # its owner's choice: a caller stopped waiting (another node answered, a deadline), close
    FAILED = "failed"  # the wire reported a failure: lost, reset, refused, a malformed or missing reply


class SharedBuffer(Protocol):
    """Memory a same-host node shares with this process, lent to a caller (`NodeClient.shm_buffer`): `array` is
    writable uint8 memory that the node's calls move without a copy. `release()` gives it back; `retire()` instead
    when a failed call may still touch it."""

    array: np.ndarray

    def release(self) -> None: ...

    def retire(self) -> None: ...


class NodeClient(abc.ABC):
    """Batched requests to one pool node."""

    #: "host:port" of a remote node, or "embedded"
    address: str = "?"
    #: where the node's store lives (a node client says so itself; the default: elsewhere)
    location: NodeLocation = NodeLocation.REMOTE
    #: True when every call returns or raises by its deadline by itself (no caller-side thread needed)
    self_timed: bool = False
    #: True when `get_into` takes `as_placed` (an `AsPlaced`), which it may run while the node places the values
    places_progressively: bool = False

    @abc.abstractmethod
    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[Buffer]], deadline: Deadline | float) -> list[bool]:
        """Store `values[i]` (its parts concatenated) under `keys[i]`; True where the node stored it."""

    @abc.abstractmethod
    def get(self, keys: Sequence[bytes], deadline: Deadline | float) -> list[Buffer | None]:
        """The stored value of each key, or None where the node has none."""

    def get_into(self, keys: Sequence[bytes], outs: Sequence[Buffer], deadline: Deadline | float) -> list[bool]:
        """Place each key's stored value in the caller's writable buffer `outs[i]`; True where the node had a value
        of exactly `len(outs[i])` bytes and it is now there (False: a miss, or a value of another length; that
        buffer's bytes are then unspecified). Transports override this to receive in place."""
        if len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} buffers")
        return place_values(self.get(keys, deadline), outs)

    @abc.abstractmethod
    def exists(self, keys: Sequence[bytes], deadline: Deadline | float, hold: Hold | None = None) -> list[bool]:
        """Whether the node holds each key; with `hold`, whether it holds it and keeps it as asked (a lease or a
        pin: `transport.exists_holds`)."""

    @abc.abstractmethod
    def ping(self, deadline: Deadline | float) -> bool:
        """True when the node answers by `deadline`; never raises."""

    def shm_buffer(self, nbytes: int) -> SharedBuffer | None:
        """`nbytes` of memory this node shares with this process (a same-host node's shared-memory region, whose
        values its calls move without a copy: `UcxNode.shm_buffer`), or None: none, or no room in it. A staging
        buffer the pool client hands out (`PoolBackend.shm_staging`)."""
        return None

    def abort(self) -> None:
        """Make the calls in flight on this node fail now (a caller that stopped waiting for a slow node); each
        returns once nothing of it can touch its buffers, or by its own deadline. A cancellation, not a failure of
        the node: further calls reconnect at once (no reconnect back-off). Nodes whose calls cannot be stopped (in
        this process) ignore it."""

    def close(self) -> None:
        """Release connections; further calls may reconnect."""


class NodeLink(Protocol):
    """What a medium beside a node client's connection needs of that client (`UcxNode` hands one to its
    `shm.client.ShmClient` and its `tcp.client.TcpLookups`): so those media import nothing of the client's."""

    @property
    def address(self) -> str:
        """The node's "host:port" (for messages)."""
        ...

    @property
    def ip(self) -> str:
        """The IP address the node client's connections reach."""
        ...

    def connection(self) -> Any:
        """The node client's current connection (compared by identity only: a region or a lookup channel belongs
        to one), or None."""
        ...

    def request(self, op: int, count: int, meta: bytes, deadline: Deadline, on: Any = None) -> tuple[Any, bytes] | None:
        """One inline request on the current connection (made first when there is none), under the node client's
        rules: (that connection, the reply's meta); a failure raises its `TransportError`. With `on`, only on that
        connection: None, and nothing sent, when the current one is another."""
        ...

    def fail(
        self, conn: Any, code: EmsErrorCode, message: str, failure: Failure | None = None, ending: Ending = Ending.FAILED
    ) -> TransportError:
        """Record a failure the node client did not see (a request on a channel of `conn`'s, a malformed reply) as a
        failed call of its own: `conn` dropped, a back-off after `Ending.FAILED`; the error to raise."""
        ...

    def timed_out(self, message: str) -> TransportError:
        """Record a lookup that timed out on a channel beside the connection with the connection left as it was (the channel goes
        on: `ClientChannel.request(..., keep_on_timeout=True)`), as the node client records its own; the error to
        raise."""
        ...

    def close(self) -> None:
        """Close the node client (its connection is dropped; a later call reconnects)."""
        ...

"""What same-host shared memory asks of the node it serves: the protocol between the node's side of shared memory
(`transport.shm.server.ShmService`, `transport.shm.regions.RegionLedger`) and `ems.pool` (the store, the in-flight
budget, the handlers).

Contract:
* `ShmHost` (what `ShmService` calls; `ems.pool.handlers.NodeHandlers` is one, as it is the `transport.handler.
  RequestHandler` of the node's UCX sessions): the in-flight budget (`take` refuses, `room` answers False for misses,
  `release` gives back), value lookups (`lookup_values`, off the loop when the store may wait for a disk), the
  copies between a region and the store (`store_copies`, `read_into`), the worker threads (`executor`) for copies
  of more than `offload_bytes`, and `serve` for the requests read off a region's channel (`answer_now` for its
  lookups, EXISTS, answered between two reads).
* As with `transport.handler`, shared memory depends on this protocol only, never on `ems.pool`
  (tests/transport/test_layering.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Protocol

import numpy as np

from ems.buffers import Buffer
from ems.transport import protocol
from ems.transport.handler import RequestChannel
from ems.transport.shm.wire import RangedRequest


class ShmHost(Protocol):
    """What `transport.shm.server.ShmService` calls; see the module docstring."""

    @property
    def executor(self) -> Executor: ...

    @property
    def offload_bytes(self) -> int:
        """Copies of more than this run on `executor`, smaller ones on the loop."""
        ...

    async def take(self, nbytes: int) -> None:
        """Reserve `nbytes` of the in-flight budget for a request, or refuse it (`transport.handler.Refusal`)."""
        ...

    async def room(self, nbytes: int) -> bool:
        """Reserve `nbytes` of the budget for a reply; False: no room (answer misses)."""
        ...

    def release(self, nbytes: int) -> None:
        """Give back `nbytes` taken by `take` or `room`."""
        ...

    async def lookup_values(self, keys: list[bytes]) -> list[Buffer | None]:
        """The store's values of `keys` (None: a miss)."""
        ...

    def store_copies(self, array: np.ndarray, keys: list[bytes], request: RangedRequest) -> list[bool]:
        """(Any thread.) Copy each value of `request` out of `array` (a region) into the store; which were stored."""
        ...

    def read_into(self, values: Sequence[Buffer], outs: Sequence[Buffer], progress: int, signalled: int) -> None:
        """(Any thread.) Copy each value into the buffer of `outs` beside it (`NodeStore.read_into`)."""
        ...

    async def serve(self, channel: RequestChannel, prefix: bytes) -> int:
        """Serve one request read off a region's channel (as `RequestHandler.serve`)."""
        ...

    def answer_now(self, header: protocol.Header, meta: memoryview, prefix: bytes) -> bytes:
        """The reply meta of an EXISTS read off a region's channel, answered without waiting (as
        `RequestHandler.answer_now`)."""
        ...

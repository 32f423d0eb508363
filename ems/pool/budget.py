"""What one pool node allows (`NodeLimits`) and the in-flight byte budget its requests share (`ByteBudget`).

Contract:
* `NodeLimits` holds the node's limits (`python -m ems.pool` options of the same names): the bytes of requests in
  flight, all connections together; how long a handshake and each frame of a request may take; how many
  connections in all and per peer. The session part (`transport.ucx.server`) applies the timeouts and connection
  counts, the request handlers (`ems.pool.handlers`) the budget.
* `ByteBudget` counts the bytes of requests in flight on the event loop (it is not thread-safe): `acquire` takes
  bytes, waiting for others to release them until a `Deadline`, and says whether it got them; every acquired byte
  is released by the one who acquired it, on every path.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ems.records import Deadline
from ems.transport import protocol

MIN_INFLIGHT_BYTES = 64 << 20


@dataclass(frozen=True)
class NodeLimits:
    """What one node allows (`python -m ems.pool` options of the same names)."""

    inflight_bytes: int
    handshake_timeout_s: float = 10.0
    stall_timeout_s: float = 30.0
    max_connections: int = 1024
    max_connections_per_peer: int = 64

    @classmethod
    def for_capacity(cls, capacity_bytes: int, **overrides: Any) -> NodeLimits:
        """The defaults for a node of `capacity_bytes`: in-flight bytes equal to the capacity up to 4 GiB (so a GET
        of distinct keys always fits and a request of the protocol's largest size can be received), a quarter of it
        above 16 GiB, never under 64 MiB."""
        largest = protocol.WIRE_LIMITS.max_data_bytes
        default = max(MIN_INFLIGHT_BYTES, min(capacity_bytes, max(capacity_bytes // 4, largest)))
        overrides.setdefault("inflight_bytes", default)
        return cls(**overrides)

    def stall_deadline(self) -> Deadline:
        """The deadline of a wait that starts now and may last one stall timeout."""
        return Deadline.after(self.stall_timeout_s)


class ByteBudget:
    """Bytes of requests in flight, all connections together (used on the event loop only)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self.peak = 0
        self._freed = asyncio.Event()

    def try_acquire(self, nbytes: int) -> bool:
        """Take `nbytes` now if they fit (no wait); whether it did."""
        if self.used + nbytes > self.total:
            return False
        self.used += nbytes
        if self.used > self.peak:
            self.peak = self.used
        return True

    async def acquire(self, nbytes: int, deadline: Deadline) -> bool:
        """Take `nbytes` (<= total), waiting until `deadline` for others to release; False if it did not fit."""
        while not self.try_acquire(nbytes):
            left = deadline.left()
            if left <= 0:
                return False
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), left)
            except asyncio.TimeoutError:
                return False
        return True

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        self._freed.set()

"""`ByteBudget` and `NodeLimits` of the pool node (no processes): what waits, what is refused, what is released."""

from __future__ import annotations

import asyncio

import pytest

from ems.pool.budget import MIN_INFLIGHT_BYTES, ByteBudget, NodeLimits
from ems.records import Deadline
from ems.transport import protocol
from ems.transport.ucx.channel import send_windows as _windows

GiB = 1 << 30


def test_default_inflight_follows_capacity():
    assert NodeLimits.for_capacity(8 << 20).inflight_bytes == MIN_INFLIGHT_BYTES
    assert NodeLimits.for_capacity(256 << 20).inflight_bytes == 256 << 20
    assert NodeLimits.for_capacity(4 * GiB).inflight_bytes == protocol.MAX_DATA_BYTES
    assert NodeLimits.for_capacity(64 * GiB).inflight_bytes == 16 * GiB
    assert NodeLimits.for_capacity(1 * GiB, inflight_bytes=5).inflight_bytes == 5


def test_budget_waits_then_gives_up_and_releases():
    async def scenario() -> list:
        budget = ByteBudget(100)
        assert await budget.acquire(60, Deadline.after(0.1))
        assert not await budget.acquire(50, Deadline.after(0.05))  # does not fit in time
        waiter = asyncio.ensure_future(budget.acquire(50, Deadline.after(2.0)))
        await asyncio.sleep(0.02)
        assert not waiter.done()
        budget.release(60)
        assert await waiter
        assert budget.used == 50 and budget.peak == 60
        budget.release(50)
        return [budget.used, budget.peak]

    assert asyncio.run(scenario()) == [0, 60]


@pytest.mark.parametrize("sizes", [[], [5], [10, 10, 10], [40, 1, 1, 1], [1, 40, 1]])
def test_send_windows_keep_order_and_bound(sizes):
    frames = [bytes(n) for n in sizes]
    groups = _windows(frames, 20)
    assert [f for g in groups for f in g] == frames
    assert all(sum(map(len, g)) <= 20 or len(g) == 1 for g in groups)


def test_a_full_node_receives_new_keys_into_recycled_buffers():
    """The node's path for a lone value (`allocate` with a reservation, fill, `put_owned(reserved=)`, as
    `NodeHandlers._put` does) with new keys at capacity: the buffers it evicts are the ones it receives into next
    (issue 8: without the reservation `_insert` dropped them before the next allocation), and a stored value is never
    a recycled buffer's old bytes."""
    import numpy as np
    from pool_testlib import joined, make_values

    from ems.store.kv_store import KvStore

    value_len = (1 << 20) + 40
    store = KvStore(6 * value_len)
    values = [joined(v) for v in make_values(40, 1 << 20, seed=11)]
    for i, value in enumerate(values):
        key = f"new-{i}".encode()
        reserve = store.charge_of(len(key), value_len)
        buffer = store.allocate(value_len, reserve=reserve)
        buffer[:] = np.frombuffer(value, np.uint8)
        assert store.put_owned(key, buffer, reserved=reserve)
    stats = store.stats()
    assert stats.reused_buffers >= 30, stats
    assert stats.used_bytes + stats.spare_bytes <= store.capacity_bytes
    assert bytes(store.get(b"new-39")) == values[39] and store.get(b"new-0") is None

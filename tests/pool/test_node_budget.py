"""`ByteBudget` and `NodeLimits` of the pool node (no processes): what waits, what is refused, what is released."""

from __future__ import annotations

import asyncio

import pytest

from ems.pool.server import MIN_INFLIGHT_BYTES, ByteBudget, NodeLimits, _windows
from ems.transport import protocol as P

GiB = 1 << 30


def test_default_inflight_follows_capacity():
    assert NodeLimits.for_capacity(8 << 20).inflight_bytes == MIN_INFLIGHT_BYTES
    assert NodeLimits.for_capacity(256 << 20).inflight_bytes == 256 << 20
    assert NodeLimits.for_capacity(4 * GiB).inflight_bytes == P.MAX_DATA_BYTES
    assert NodeLimits.for_capacity(64 * GiB).inflight_bytes == 16 * GiB
    assert NodeLimits.for_capacity(1 * GiB, inflight_bytes=5).inflight_bytes == 5


def test_budget_waits_then_gives_up_and_releases():
    async def scenario() -> list:
        budget = ByteBudget(100)
        assert await budget.acquire(60, 0.1)
        assert not await budget.acquire(50, 0.05)  # does not fit in time
        waiter = asyncio.ensure_future(budget.acquire(50, 2.0))
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

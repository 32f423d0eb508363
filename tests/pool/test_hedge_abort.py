"""A hedged read's abort of a slow node is a cancellation, not a failure: with real pool nodes over UCX (three
`python -m ems.pool` processes, `UcxNode` clients without shared memory, as across hosts), the slow node's
connection is aborted once another owner answered, and a save right after still gives it its copies, and a read
right after is still answered by it. (The abort used to start the client's reconnect back-off: for 0.5 s every call
to that live node failed at once, so the save left its blocks with one copy.)

The node is made slow by stopping it (SIGSTOP) for the read; it is let go again before the save.
"""

from __future__ import annotations

import numpy as np
import pytest
from ems_testlib import keyed
from pool_testlib import make_values, wait_until

from ems.backends import latency
from ems.backends.pool_client import PoolClient
from ems.cluster.rendezvous import node_seeds, ranked_owners
from ems.store.value_format import ExpectedValues, ValueKind
from ems.transport.shm.client import ShmMode
from ems.transport.ucx.remote import connect
from ems.types import CcKvOption

pytestmark = pytest.mark.slow

SIZE = 256 * 1024  # a share of several of these is no small read: its first request receives into the caller's buffers
OPTION = CcKvOption(timeout=20_000, write_rcache=False)


def _owners(pool: PoolClient, key: bytes) -> list[str]:
    """The key's owners (replicas = 2), first owner first."""
    addresses = list(pool.members.view.addresses)
    return [addresses[j] for j in ranked_owners([key], node_seeds(addresses), len(addresses))[0, :2].tolist()]


def test_a_hedge_abort_leaves_the_slow_node_taking_copies_and_answering(pool_nodes, monkeypatch):
    procs = {p.address: p for p in (pool_nodes() for _ in range(3))}
    clients = {a: connect(a, connect_timeout_ms=2000, shm=ShmMode.OFF) for a in procs}
    checker = None
    pool = PoolClient(list(clients.values()), replicas=2)
    try:
        keys = [f"hedged-{i}".encode() for i in range(12)]
        values = make_values(len(keys), SIZE, seed=1)
        blobs = [b"".join(v) for v in values]
        expected = ExpectedValues(ValueKind.RAW_V0, 0, np.zeros(len(keys), np.uint64), np.full(len(keys), SIZE))
        assert all(pool.put(keyed(keys, OPTION), values).results)
        for _ in range(3):  # the latency model learns what a normal read costs
            outs = [np.empty(len(b), np.uint8) for b in blobs]
            assert all(pool.get_into(keyed(keys, OPTION, expected=expected), outs).results)
        slow = _owners(pool, keys[0])[0]
        procs[slow].pause()
        try:
            outs = [np.zeros(len(b), np.uint8) for b in blobs]
            outcome = pool.get_into(keyed(keys, OPTION, expected=expected), outs)
        finally:
            procs[slow].resume()
        assert all(outcome.results) and [o.tobytes() for o in outs] == blobs
        assert any(slow in e.message() and "slow" in e.message() for e in outcome.errors), outcome.errors  # aborted
        # the node is live again (asked through a client of its own, which the pool's back-off would not hold back)
        checker = connect(slow, connect_timeout_ms=2000, shm=ShmMode.OFF)
        assert wait_until(lambda: checker.ping(1.0), 5.0)
        new_keys = [f"after-{i}".encode() for i in range(12)]
        # small values, and a give-up delay of seconds for the save: its share on the node just let go is not cut
        # short on a busy host (a back-off would fail it at once, which is what this is about)
        monkeypatch.setattr(latency, "ABORT_FLOOR_S", 5.0)
        new_values = make_values(len(new_keys), 4096, seed=2)
        saved = pool.put(keyed(new_keys, OPTION), new_values)
        assert all(saved.results) and not saved.errors, saved.errors
        theirs = [k for k in new_keys if slow in _owners(pool, k)]
        assert theirs
        assert checker.exists(theirs, 5.0) == [True] * len(theirs)  # the slow node took its copies
        # and the pool's own client of it answers a read at once
        mine = {k: b"".join(v) for k, v in zip(new_keys, new_values)}
        got = clients[slow].get(theirs, 5.0)
        assert [bytes(g) if g is not None else None for g in got] == [mine[k] for k in theirs]
    finally:
        if checker is not None:
            checker.close()
        pool.close()

"""Staging in a same-host node's shared-memory region (`StagingPool.acquire(shared=...)`, `PoolClient.shm_staging`):
pipelined saves and loads through it are byte-exact, give their region ranges back, and a lease a failed call may
still touch poisons its region (never reused); the next connection's fresh region serves again."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from ems_testlib import (
    assert_cache_equals,
    direct_cc,
    expected_after_load,
    make_cache,
    poison,
    set_chunk_bytes,
    slots_of_blocks,
    snapshot,
)

from ems import CcKvOption, CcResult, EmsException
from ems.records import JobKind, Stage
from ems.staging import StagingPool
from ems.transport.ucx.client import UcxNode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pool"))
from pool_testlib import PoolProcess

pytestmark = pytest.mark.slow
BS, BLOCKS = 4, 24


@pytest.fixture
def node():
    proc = PoolProcess("64MiB")
    yield proc
    proc.cleanup()


@pytest.fixture
def client(node):
    ucx = UcxNode(node.address, connect_timeout_ms=2000)
    cc = direct_cc([ucx], model_id="shm-staging")
    yield cc, ucx
    cc.close()
    cc._pool.close()


@pytest.fixture
def leases(monkeypatch):
    """Every staging lease handed out, in order."""
    taken: list = []
    acquire = StagingPool.acquire

    def spy(self, nbytes, device, shared=None):
        lease = acquire(self, nbytes, device, shared)
        taken.append(lease)
        return lease

    monkeypatch.setattr(StagingPool, "acquire", spy)
    return taken


def _setup(cc, seed: int):
    torch.manual_seed(seed)
    cache = make_cache(layers=2, blocks=BLOCKS, block_size=BS, heads=2, head_size=16)
    cc.register_kvcache(cache)
    rng = np.random.default_rng(seed)
    offsets = [int(x) for x in rng.integers(1, BS + 1, BLOCKS)]
    slots = slots_of_blocks(list(range(BLOCKS)), BS, offsets)
    hashes = [int(h) for h in rng.integers(1, 2**62, BLOCKS)]
    return cache, slots, hashes, offsets


def _round_trip(cc, cache, slots, hashes, offsets) -> None:
    original = snapshot(cache)
    assert cc.save(slots, hashes, offsets) == CcResult(BLOCKS, BLOCKS)
    poisoned = poison(cache)
    assert cc.load(slots, hashes, offsets) == CcResult(BLOCKS, BLOCKS)
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots))


@pytest.mark.parametrize("chunk", ["0", "3KiB"])
def test_saves_and_loads_stage_in_the_region(client, leases, monkeypatch, chunk):
    cc, ucx = client
    set_chunk_bytes(cc, chunk)
    cache, slots, hashes, offsets = _setup(cc, seed=1)
    _round_trip(cc, cache, slots, hashes, offsets)  # the first call opens the region
    first = len(leases)
    _round_trip(cc, cache, slots, hashes[::-1], offsets)
    assert leases[first:] and all(lease.shared is not None for lease in leases[first:])
    # a load staged in the region is one chunk whatever EMS_CHUNK_BYTES (the node only copies: nothing to overlap)
    assert cc.jobs.last(JobKind.LOAD).stages[Stage.RECEIVE].runs == 1
    region = ucx.shm._region
    assert region is not None and not region.allocator.poisoned and region.allocator.used == 0
    assert cc._staging.leased_bytes == 0


def test_a_failed_save_retires_its_region_and_the_next_connection_serves(client, node, leases, monkeypatch):
    cc, ucx = client
    set_chunk_bytes(cc, "3KiB")
    cache, slots, hashes, offsets = _setup(cc, seed=2)
    _round_trip(cc, cache, slots, hashes, offsets)
    old = ucx.shm._region
    node.pause()  # every put stays in flight
    try:
        # finish, not abandon: abandoning at once could cancel every chunk before one is sent (nothing in flight,
        # nothing to retire); finishing sends them and they time out against the paused node
        finish, _ = cc._begin_save((slots, hashes, offsets, CcKvOption(timeout=800)), {})
        with contextlib.suppress(EmsException):  # every put timed out: nothing was stored
            finish()
        assert leases[-1].shared is not None
        assert old.allocator.poisoned and old.allocator.alloc(1) is None  # never handed out again
    finally:
        node.resume()
    time.sleep(0.6)  # the reconnect back-off
    _round_trip(cc, cache, slots, hashes, offsets)
    _round_trip(cc, cache, slots, hashes, offsets)
    new = ucx.shm._region
    assert new is not None and new is not old and leases[-1].shared is not None
    assert leases[-1].shared.region is new and new.allocator.used == 0


@pytest.fixture
def as_placed(monkeypatch):
    """What each load's scatter-as-placed returned (count written, why it stopped), in order."""
    from ems.datapath.copier import FusedCopier

    seen: list = []
    real = FusedCopier.verify_scatter_as_placed

    def spy(self, *args, **kwargs):
        seen.append(real(self, *args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(FusedCopier, "verify_scatter_as_placed", spy)
    return seen


def test_a_load_in_the_region_verifies_and_scatters_each_value_as_the_node_places_it(client, as_placed):
    from ems.kernels.base import PlacedStop

    cc, ucx = client
    cache, slots, hashes, offsets = _setup(cc, seed=4)
    _round_trip(cc, cache, slots, hashes, offsets)  # the first call opens the region
    as_placed.clear()
    _round_trip(cc, cache, slots, hashes[::-1], offsets)
    _round_trip(cc, cache, slots, hashes, offsets)
    assert as_placed == [(BLOCKS, PlacedStop.ALL)] * 2  # every value taken before the reply came
    assert ucx.shm._region.allocator.used == 0 and cc._staging.leased_bytes == 0  # progress words given back


@pytest.mark.parametrize("how", ["layout", "length", "missing"])
def test_a_value_the_load_refuses_stops_it_there_while_values_are_placed(client, node, as_placed, how):
    """Another layout's header: the value arrives and fails its check (the load stops at it); another length or no
    value: the node never counts it as placed, so the wait for it ends with the reply, which says so. Either way the
    blocks before it are exact and nothing at or after it is written."""
    from ems_testlib import store_refused_value

    from ems.datapath.arguments import Operation
    from ems.datapath.calls import bind_call
    from ems.datapath.planning import plan_blocks
    from ems.kernels.base import PlacedStop

    cc, _ = client
    cache, slots, hashes, offsets = _setup(cc, seed=5)
    original = snapshot(cache)
    bad = 13
    kept = hashes if how != "missing" else hashes[:bad]
    kept_slots = slots_of_blocks(list(range(len(kept))), BS, offsets[: len(kept)])
    assert cc.save(kept_slots, kept, offsets[: len(kept)]) == CcResult(len(kept), len(kept))
    plan = plan_blocks(bind_call(Operation.LOAD, (slots, hashes, offsets), {}, cc._layout), cc._layout, cc._v1_namespace)
    if how != "missing":
        store_refused_value(node.address, plan.keys[bad], plan.route_keys[bad], plan, bad, how)
    _round_trip_prefix = slots_of_blocks(list(range(bad)), BS, offsets[:bad])
    poisoned = poison(cache)
    as_placed.clear()
    assert cc.load(slots, hashes, offsets) == CcResult(bad, BLOCKS)
    assert_cache_equals(cache, expected_after_load(original, poisoned, _round_trip_prefix))
    want = PlacedStop.DAMAGED if how == "layout" else PlacedStop.INTERRUPTED
    assert as_placed == [(bad, want)]
    assert cc._staging.leased_bytes == 0

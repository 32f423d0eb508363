"""The pipelined data path (`ems.datapath.jobs`, any remote pool): requests cut into many chunks, against real UCX pool-node
processes (`python -m ems.pool`), through the public API.

* Many-chunk saves and loads are byte-exact, whatever the chunk sizes of the saving and the loading call (a chunk
  of one value, of a few, or the whole request), for both V1 call forms with partial blocks and for V0.
* A damaged value in chunk k (another layout, another length) stops the load at that block: the blocks before it
  are exact, nothing at or after it is written. With replicas, a damaged copy falls back to the good one.
* A node paused or killed mid-request gives a consecutive prefix, within the timeout, never a wrong block.
* A job keeps exactly `PIPELINE_DEPTH` chunk requests in flight when the node is slow, never more.
* Every path gives the staging lease back (the staging pool's leased bytes return to zero): a clean request, a
  failed one, an interrupt while gathering with puts in flight, and `abandon()` with puts in flight to a node that
  does not answer.
"""

from __future__ import annotations

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
    store_refused_value,
)

from ems import CcKvOption, CcResult, EmsException, KvBufferWrapper, PrimaryKey
from ems.config import parse_size
from ems.datapath.arguments import Operation
from ems.datapath.calls import bind_call
from ems.datapath.copier import Copier, FusedCopier
from ems.datapath.jobs import FENCE_GRACE_S, plan_chunks
from ems.datapath.planning import BlockPlan, plan_blocks
from ems.records import JobKind, Stage
from ems.transport.shm.client import ShmMode
from ems.transport.ucx.client import UcxNode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pool"))
from pool_testlib import PoolProcess

BS = 4
BLOCKS = 48  # 2 layers x K/V x 2 heads x 16 x fp16 = 256 B a token: 1 KiB a full block
TINY = "3KiB"  # two values a chunk


@pytest.fixture(scope="module")
def shared():
    node = PoolProcess("256MiB")
    yield node
    node.cleanup()


@pytest.fixture
def nodes():
    """`start()` → a `PoolProcess` of this test alone (killed at the end)."""
    started: list[PoolProcess] = []

    def start() -> PoolProcess:
        started.append(PoolProcess("64MiB"))
        return started[-1]

    yield start
    for node in started:
        node.cleanup()


@pytest.fixture
def connect(request):
    """`connect(*addresses, replicas=1)` → a `ContextCaching` over those nodes (no read cache: every load crosses the
    wire), closed at the end with its pool client."""
    from ems.backends.pool_client import PoolClient
    from ems.client.context_caching import ContextCaching
    from ems.config import CcConfig, EmsConfig
    from ems.settings import resolve_settings

    made: list = []

    def make(*addresses: str, replicas: int = 1):
        # as nodes on another host (no shared memory): a load staged in a same-host region is one chunk
        # (tests/datapath/test_shm_staging.py), and these tests are about many chunks
        clients = [UcxNode(a, connect_timeout_ms=2000, shm=ShmMode.OFF) for a in addresses]
        if replicas == 1:
            cc = direct_cc(clients, model_id=request.node.name[:60])
        else:
            cc = ContextCaching(
                CcConfig(rank_id=0, device_id=0, model_id=request.node.name[:60]),
                None,
                PoolClient(clients, replicas=replicas),
                resolve_settings(EmsConfig()),
            )
        made.append(cc)
        return cc

    yield make
    for cc in made:
        cc.close()
        cc._pool.close()


def _plan(cc, slots, hashes, offsets) -> BlockPlan:
    """White-box: the plan a call makes (its keys and chunks)."""
    request = bind_call(Operation.LOAD, (slots, hashes, offsets), {}, cc._layout)
    return plan_blocks(request, cc._layout, cc._v1_namespace)


def _setup(cc, seed: int = 0):
    torch.manual_seed(seed)
    cache = make_cache(layers=2, blocks=BLOCKS, block_size=BS, heads=2, head_size=16)
    cc.register_kvcache(cache)
    rng = np.random.default_rng(seed)
    offsets = [int(x) for x in rng.integers(1, BS + 1, BLOCKS)]
    offsets[::3] = [BS] * len(offsets[::3])
    slots = slots_of_blocks(list(range(BLOCKS)), BS, offsets)
    hashes = [int(h) for h in rng.integers(1, 2**62, BLOCKS)]
    return cache, slots, hashes, offsets


def _chunk_starts(cc, slots, hashes, offsets) -> list[int]:
    """The first value of each chunk of this call (at the chunk size set now)."""
    return [a for a, _ in plan_chunks(_plan(cc, slots, hashes, offsets), cc._pool.limits, cc._settings.chunk_bytes)]


def _idle(cc) -> None:
    assert cc._staging.leased_bytes == 0  # every lease given back (released or retired)


@pytest.mark.parametrize("save_chunk, load_chunk", [(TINY, "0"), ("0", TINY), ("1", "5KiB"), (TINY, TINY)])
def test_many_chunks_round_trip_byte_exact(shared, connect, monkeypatch, save_chunk, load_chunk):
    cc = connect(shared.address)
    cache, slots, hashes, offsets = _setup(cc)
    original = snapshot(cache)
    set_chunk_bytes(cc, save_chunk)
    assert cc.save(slots, hashes, offsets) == CcResult(BLOCKS, BLOCKS)
    record = cc.jobs.last(JobKind.SAVE)
    chunks = len(plan_chunks(_plan(cc, slots, hashes, offsets), cc._pool.limits, parse_size("chunk", save_chunk)))
    assert record.path == "pipelined" and record.stages[Stage.SEND].runs == chunks == record.stages[Stage.GATHER].runs
    # each chunk encoded: in its gather's pass where the backend can (the compiled host copy), else as a stage of its own
    if cc.kernel_backend == "host":
        assert Stage.ENCODE not in record.stages
    else:
        assert record.stages[Stage.ENCODE].runs == chunks
    assert chunks == {"0": 1, "1": BLOCKS}.get(save_chunk, chunks) and (chunks > 12 or save_chunk == "0")
    assert record.stages[Stage.GATHER].nbytes == record.nbytes
    _idle(cc)
    set_chunk_bytes(cc, load_chunk)
    poisoned = poison(cache)
    assert cc.load(slots, hashes, offsets) == CcResult(BLOCKS, BLOCKS)
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots))
    load = cc.jobs.last(JobKind.LOAD)
    assert load.stages[Stage.SCATTER].nbytes == load.nbytes == record.nbytes
    assert load.stages[Stage.RECEIVE].runs == load.stages[Stage.SCATTER].runs > (1 if load_chunk != "0" else 0)
    _idle(cc)
    # chunk_descs form, async, the same values
    poisoned = poison(cache)
    descs = [[(b * BS, n) for b, n in zip(range(BLOCKS), offsets)]]
    assert cc.get_result(cc.async_load(hashes=hashes, chunk_descs=descs)) == CcResult(BLOCKS, BLOCKS)
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots))
    _idle(cc)


def test_v0_raw_values_in_many_chunks(shared, connect, monkeypatch):
    cc = connect(shared.address)
    set_chunk_bytes(cc, "2KiB")
    arena = torch.randint(0, 255, (1 << 18,), dtype=torch.uint8)
    lengths = [1, 700, 3000, 64, 5000, 1, 2048, 999] * 3
    offsets = np.cumsum([0] + lengths[:-1]).tolist()
    keys = [PrimaryKey("doc", f"part{i}") for i in range(len(lengths))]
    values = [[KvBufferWrapper(arena.data_ptr() + o, n)] for o, n in zip(offsets, lengths)]
    want = arena.clone()
    assert cc.save(CcKvOption(), keys, values) == CcResult(len(keys), len(keys))
    assert cc.jobs.last(JobKind.SAVE).stages[Stage.SEND].runs > 5
    arena.zero_()
    assert cc.load(CcKvOption(), keys, values) == CcResult(len(keys), len(keys))
    end = offsets[-1] + lengths[-1]
    assert torch.equal(arena[:end], want[:end])
    _idle(cc)


@pytest.mark.parametrize("how", ["layout", "length"])
def test_a_damaged_value_in_chunk_k_stops_the_load_there(shared, connect, monkeypatch, how):
    cc = connect(shared.address)
    cache, slots, hashes, offsets = _setup(cc, seed=3)
    original = snapshot(cache)
    set_chunk_bytes(cc, TINY)
    assert cc.save(slots, hashes, offsets) == CcResult(BLOCKS, BLOCKS)
    plan = _plan(cc, slots, hashes, offsets)
    starts = _chunk_starts(cc, slots, hashes, offsets)
    bad = starts[9] + 1  # in chunk 9, not its first value: the chunk's first values are written, nothing after it
    assert starts[10] > bad
    store_refused_value(shared.address, plan.keys[bad], plan.route_keys[bad], plan, bad, how)
    poisoned = poison(cache)
    assert cc.load(slots, hashes, offsets) == CcResult(bad, BLOCKS)
    written = slots_of_blocks(list(range(bad)), BS, offsets[:bad])
    assert_cache_equals(cache, expected_after_load(original, poisoned, written))  # after it: untouched
    _idle(cc)


def test_with_replicas_a_damaged_copy_falls_back_to_the_good_one(nodes, connect, monkeypatch):
    from ems.cluster.rendezvous import ranked_owners

    a, b = nodes(), nodes()
    cc = connect(a.address, b.address, replicas=2)
    cache, slots, hashes, offsets = _setup(cc, seed=4)
    original = snapshot(cache)
    set_chunk_bytes(cc, TINY)
    assert cc.save(slots, hashes, offsets) == CcResult(BLOCKS, BLOCKS)
    plan = _plan(cc, slots, hashes, offsets)
    view = cc._pool.members.view
    firsts = ranked_owners(plan.route_keys, view.seeds, 2)[:, 0]
    for i in (5, 30):  # damage the copy on the owner asked first
        store_refused_value(view.nodes[int(firsts[i])].address, plan.keys[i], plan.route_keys[i], plan, i, "layout")
    poisoned = poison(cache)
    assert cc.load(slots, hashes, offsets) == CcResult(BLOCKS, BLOCKS)
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots))
    _idle(cc)


def test_a_node_killed_mid_load_gives_an_exact_prefix_and_writes_nothing_after(nodes, connect, monkeypatch):
    import ems.datapath.jobs.pipelined

    monkeypatch.setattr(ems.datapath.jobs.pipelined, "PIPELINE_DEPTH", 1)  # one chunk in flight: the kill lands mid-request
    node = nodes()
    cc = connect(node.address)
    cache, slots, hashes, offsets = _setup(cc, seed=5)
    original = snapshot(cache)
    set_chunk_bytes(cc, TINY)
    assert cc.save(slots, hashes, offsets) == CcResult(BLOCKS, BLOCKS)
    starts = _chunk_starts(cc, slots, hashes, offsets)
    scatter, verify_scatter = Copier.scatter_at, FusedCopier.verify_scatter

    def kill_after_first(self, plan, span, value_offsets, a, b):
        if a == 0:
            node.kill()
        scatter(self, plan, span, value_offsets, a, b)

    def kill_after_first_verified(self, plan, span, value_offsets, a, stated):  # the fused copier's scatter
        if a == 0:
            node.kill()
        return verify_scatter(self, plan, span, value_offsets, a, stated)

    monkeypatch.setattr(Copier, "scatter_at", kill_after_first)
    monkeypatch.setattr(FusedCopier, "verify_scatter", kill_after_first_verified)
    poisoned = poison(cache)
    start = time.monotonic()
    result = cc.load(slots, hashes, offsets, CcKvOption(timeout=2000))
    assert time.monotonic() - start < 2.0 + FENCE_GRACE_S
    assert result.success in starts[1:3] and result.total == BLOCKS  # chunk 0, perhaps chunk 1 (just started)
    written = slots_of_blocks(list(range(result.success)), BS, offsets[: result.success])
    assert_cache_equals(cache, expected_after_load(original, poisoned, written))
    _idle(cc)


def test_a_node_paused_mid_save_gives_the_acknowledged_prefix_in_time(nodes, connect, monkeypatch):
    node = nodes()
    cc = connect(node.address)
    cache, slots, hashes, offsets = _setup(cc, seed=6)
    original = snapshot(cache)
    assert cc.exists(hashes[:1]) == CcResult(0, 1)  # connected
    set_chunk_bytes(cc, TINY)
    starts = _chunk_starts(cc, slots, hashes, offsets)
    gather = Copier.gather

    def pause_at_chunk_5(self, plan, staging, a, b):
        if a == starts[5]:
            time.sleep(0.2)  # the first chunks' puts are answered
            node.pause()
        return gather(self, plan, staging, a, b)

    monkeypatch.setattr(Copier, "gather", pause_at_chunk_5)
    start = time.monotonic()
    try:
        result = cc.save(slots, hashes, offsets, CcKvOption(timeout=1500))
    finally:
        elapsed = time.monotonic() - start
        node.resume()
    assert elapsed < 1.5 + FENCE_GRACE_S
    assert 0 < result.success <= starts[5] and result.total == BLOCKS
    _idle(cc)
    monkeypatch.setattr(Copier, "gather", gather)
    time.sleep(0.6)  # the client's reconnect back-off
    poisoned = poison(cache)
    loaded = cc.load(slots, hashes, offsets)
    assert loaded.success >= result.success  # every acknowledged block is stored, and exact
    written = slots_of_blocks(list(range(loaded.success)), BS, offsets[: loaded.success])
    assert_cache_equals(cache, expected_after_load(original, poisoned, written))
    _idle(cc)


def test_abandon_with_puts_in_flight_gives_everything_back(nodes, connect, monkeypatch):
    node = nodes()
    cc = connect(node.address)
    cache, slots, hashes, offsets = _setup(cc, seed=7)
    assert cc.exists(hashes[:1]) == CcResult(0, 1)  # connected
    set_chunk_bytes(cc, TINY)
    node.pause()  # every put stays in flight
    try:
        start = time.monotonic()
        _, abandon = cc._begin_save((slots, hashes, offsets, CcKvOption(timeout=800)), {})
        assert cc._staging.leased_bytes > 0
        abandon()
        assert time.monotonic() - start < 0.8 + FENCE_GRACE_S + 1.0
        _idle(cc)
        assert not cc._staging._free  # the lease UCX may still read was retired, never reused
    finally:
        node.resume()
    time.sleep(0.6)
    original = snapshot(cache)
    assert cc.save(slots, hashes, offsets) == CcResult(BLOCKS, BLOCKS)
    poisoned = poison(cache)
    assert cc.load(slots, hashes, offsets) == CcResult(BLOCKS, BLOCKS)
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots))
    _idle(cc)


def test_an_interrupt_while_gathering_with_puts_in_flight_gives_the_lease_back(shared, connect, monkeypatch):
    cc = connect(shared.address)
    _cache, slots, hashes, offsets = _setup(cc, seed=8)
    set_chunk_bytes(cc, TINY)
    starts = _chunk_starts(cc, slots, hashes, offsets)
    gather = Copier.gather

    def interrupted_at_chunk_3(self, plan, staging, a, b):
        if a == starts[3]:
            raise KeyboardInterrupt
        return gather(self, plan, staging, a, b)

    monkeypatch.setattr(Copier, "gather", interrupted_at_chunk_3)
    with pytest.raises(KeyboardInterrupt):
        cc.save(slots, hashes, offsets)
    with pytest.raises(KeyboardInterrupt):
        cc.async_save(slots, hashes, offsets)
    _idle(cc)
    assert len(cc._staging._free) == 1  # the puts had returned: the lease is kept for reuse
    monkeypatch.setattr(Copier, "gather", gather)
    assert cc.save(slots, hashes, offsets) == CcResult(BLOCKS, BLOCKS)
    _idle(cc)


def test_an_unreachable_node_fails_the_call_in_time(nodes, connect, monkeypatch):
    node = nodes()
    cc = connect(node.address)
    _, slots, hashes, offsets = _setup(cc, seed=9)
    set_chunk_bytes(cc, TINY)
    node.kill()
    for call in (cc.save, cc.load):
        start = time.monotonic()
        with pytest.raises(EmsException):
            call(slots, hashes, offsets, CcKvOption(timeout=1000))
        assert time.monotonic() - start < 1.0 + FENCE_GRACE_S
        _idle(cc)


def test_a_job_keeps_at_most_depth_chunk_requests_in_flight(fault_node_factory, monkeypatch):
    """In process (a wrapped embedded store takes the pipelined path): with every call slowed down, a save and a
    load each keep exactly `PIPELINE_DEPTH` chunk requests in flight, never more, and still write every block."""
    import threading

    from ems.datapath.jobs import PIPELINE_DEPTH

    node = fault_node_factory()
    node.delay_s = 0.02
    lock = threading.Lock()
    now = {"put": 0, "get": 0}
    peak = {"put": 0, "get": 0}

    def counted(op, call):
        def run(*args, **kwargs):
            with lock:
                now[op] += 1
                peak[op] = max(peak[op], now[op])
            try:
                return call(*args, **kwargs)
            finally:
                with lock:
                    now[op] -= 1

        return run

    monkeypatch.setattr(node, "put", counted("put", node.put))
    monkeypatch.setattr(node, "get", counted("get", node.get))
    cc = direct_cc([node])
    try:
        cache, slots, hashes, offsets = _setup(cc, seed=10)
        original = snapshot(cache)
        set_chunk_bytes(cc, TINY)
        assert cc.save(slots, hashes, offsets) == CcResult(BLOCKS, BLOCKS)
        assert cc.jobs.last(JobKind.SAVE).stages[Stage.SEND].runs > 2 * PIPELINE_DEPTH
        poisoned = poison(cache)
        assert cc.load(slots, hashes, offsets) == CcResult(BLOCKS, BLOCKS)
        assert_cache_equals(cache, expected_after_load(original, poisoned, slots))
        assert peak == {"put": PIPELINE_DEPTH, "get": PIPELINE_DEPTH}
        _idle(cc)
    finally:
        cc.close()


def test_one_chunk_runs_on_the_calling_thread(shared, connect, monkeypatch):
    """A request of one chunk has nothing to overlap: its put and its receive run on the thread that finishes the
    call, never on the pipeline threads (no thread hop per small call); several chunks do use them."""
    import threading

    from ems.datapath.executor import ChunkExecutor

    started: list = []
    real_start = ChunkExecutor.start
    monkeypatch.setattr(ChunkExecutor, "start", lambda self, call: started.append(call) or real_start(self, call))
    cc = connect(shared.address)
    _cache, slots, hashes, offsets = _setup(cc, seed=3)
    callers: set = set()
    real_put, real_get = cc._pool.put, cc._pool.get_into
    monkeypatch.setattr(cc._pool, "put", lambda *a, **k: callers.add(threading.get_ident()) or real_put(*a, **k))
    monkeypatch.setattr(cc._pool, "get_into", lambda *a, **k: callers.add(threading.get_ident()) or real_get(*a, **k))
    set_chunk_bytes(cc, "0")
    assert cc.save(slots, hashes, offsets) == CcResult(BLOCKS, BLOCKS)
    assert cc.load(slots, hashes, offsets) == CcResult(BLOCKS, BLOCKS)
    assert not started and callers == {threading.get_ident()}
    set_chunk_bytes(cc, TINY)
    assert cc.load(slots, hashes, offsets) == CcResult(BLOCKS, BLOCKS)
    assert started and len(callers) > 1
    _idle(cc)

"""The job model (`ems.datapath.jobs`) and the embedded pool's one pass.

* Every save and load leaves a `JobRecord` whose stages account for the bytes the request moved; the ledger sums them.
* The one-pass path (gather into the store's buffer, scatter from the stored value) and the staged path (one
  gather into staging) produce byte-identical values, for random requests of both V1 forms and for split K/V planes.
* The store's arena and reservations: capacity is never exceeded, evicted buffers are reused at once, a buffer given
  back releases its reservation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ems_testlib import make_cache
from hypothesis import given, settings
from hypothesis import strategies as st

from ems import CcConfig, Ems, EmsConfig
from ems.datapath.arguments import Operation
from ems.datapath.calls import bind_call
from ems.datapath.copier import Gathered, copier_for, encode_values
from ems.datapath.layout import register_layout
from ems.datapath.planning import plan_blocks
from ems.kernels import get_backend
from ems.records import JobKind, Stage, stage_table
from ems.store.kv_store import KvStore
from ems.store.value_format import HEADER_SIZE, build_headers, checksum, matches


@pytest.fixture
def cc():
    Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "jobs"), pool_capacity="8MiB", pool_prefault="1MiB"))
    yield Ems.get_cc()
    Ems.shutdown()


def test_records_account_for_every_byte(cc):
    cache = make_cache(layers=2, blocks=8, block_size=4)
    cc.register_kvcache(cache)
    payload = 4 * 2 * 2 * 2 * 8 * 2  # tokens x layers x K/V x heads x head_size x fp16
    assert cc.save([0, 1, 2, 3, 8, 9, 10, 11], [1, 2], [4, 4]).success == 2
    save = cc.jobs.last(JobKind.SAVE)
    assert save.path == "one-pass" and (save.blocks_ok, save.blocks_total, save.nbytes) == (2, 2, 2 * payload)
    # the whole request in one gather (one backend call per layer group, whatever the number of blocks)
    assert save.stages[Stage.GATHER].nbytes == 2 * payload and save.stages[Stage.GATHER].runs == 1
    assert save.stages[Stage.SEND].nbytes == 2 * (payload + HEADER_SIZE)
    assert cc.load([16, 17, 18, 19, 20, 21, 22, 23], [1, 2], [4, 4]).success == 2
    load = cc.jobs.last(JobKind.LOAD)
    assert load.stages[Stage.SCATTER].nbytes == 2 * payload and load.stages[Stage.SCATTER].runs == 1
    for layer in cache:
        for t in layer:
            assert torch.equal(t[4], t[0]) and torch.equal(t[5], t[2])
    assert cc.load([0, 1, 2, 3], [7], [4]).success == 0  # a miss: received, nothing verified or scattered
    miss = cc.jobs.last(JobKind.LOAD)
    assert miss.blocks_ok == 0 and Stage.SCATTER not in miss.stages
    totals = cc.jobs.totals(JobKind.LOAD)
    assert totals.jobs == 2 and totals.blocks_ok == 2 and totals.stages[Stage.SCATTER].nbytes == 2 * payload
    assert "scatter" in stage_table([save, load])
    metrics = cc.metrics()  # the counters read the same job records
    assert metrics["save_stage_gather_bytes"] == 2 * payload and metrics["load_stage_scatter_bytes"] == 2 * payload
    assert metrics["save_blocks_ok"] == 2 and metrics["load_blocks"] == 3 and metrics["load_stage_verify_seconds"] > 0


@pytest.mark.parametrize("where", ["in place", "a buffer handed in"])
def test_a_damaged_value_stops_the_one_pass_load_there(cc, where):
    """Value 1 of 3 damaged in its last byte: in the store's own buffer (a bit flip in memory), or replaced by a
    damaged buffer the store did not allocate (as `put_owned` hands them in: no known address)."""
    cache = make_cache(layers=1, blocks=8, block_size=2)
    cc.register_kvcache(cache)
    assert cc.save([0, 1, 2, 3, 4, 5], [1, 2, 3], [2, 2, 2]).success == 3
    store = Ems._pool.store
    keys = list(store._entries)
    if where == "in place":
        memoryview(store._entries[keys[1]]).cast("B")[-1] ^= 0xFF
    else:
        damaged = bytearray(store._entries[keys[1]])
        damaged[-1] ^= 0xFF
        with store._lock:
            store._entries[keys[1]] = bytes(damaged)
            store._addresses.pop(keys[1], None)
    before = [t.clone() for t in cache[0]]
    assert cc.load([8, 9, 10, 11, 12, 13], [1, 2, 3], [2, 2, 2]).success == 1
    for t, b in zip(cache[0], before):  # block 4 got block 0's rows; blocks 5 and 6 untouched
        assert torch.equal(t[4], t[0]) and torch.equal(t[5:7], b[5:7])


def _planned(cache, slots, hashes, offsets):
    layout = register_layout(cache, None)
    request = bind_call(Operation.SAVE, (slots, hashes, offsets), {}, layout)
    return plan_blocks(request, layout, b"ns")


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_one_pass_and_staged_values_are_identical(data):
    bs = data.draw(st.sampled_from([1, 2, 4]))
    blocks = 6
    cache = make_cache(layers=2, blocks=blocks, block_size=bs, interleaved=data.draw(st.booleans()))
    n = data.draw(st.integers(1, 4))
    offsets = [data.draw(st.integers(1, bs)) for _ in range(n)]
    slots = data.draw(st.permutations(range(blocks * bs)))[: sum(offsets)]
    if len(slots) < sum(offsets):
        return
    plan = _planned(cache, list(slots), list(range(n)), offsets)
    backend = get_backend(torch.device("cpu"))
    staging = torch.zeros(plan.staging_bytes, dtype=torch.uint8)
    copier = copier_for(backend, torch.device("cpu"))
    copier.gather(plan, staging, 0, plan.total)
    for i in range(n):
        value = torch.zeros(plan.value_len(i), dtype=torch.uint8)
        copier.gather_value(plan, i, value)
        a = int(plan.value_start[i])
        assert torch.equal(value[HEADER_SIZE:], staging[a + HEADER_SIZE : a + plan.value_len(i)])
    # scatter each value into a fresh cache: the staged scatter of the prefix writes the same rows
    host = memoryview(staging.numpy())
    headers = build_headers(plan.expected, [checksum([p]) for p in plan.payloads(host)])
    values = [
        bytes(v[0]) for v in encode_values(plan, host, 0, plan.total, Gathered.PAYLOADS)
    ]  # one C call for more than a few values
    assert [v[:HEADER_SIZE] for v in values] == headers  # the same header bytes as the struct path
    assert all(matches(v, plan.expected, i) for i, v in enumerate(values))


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_gather_that_encodes_writes_exactly_what_gather_then_encode_writes(data):
    """The compiled host copy's one pass (each value gathered, then hashed and headed while in cache) against the
    torch path's gather followed by `encode_in_place`, into staging poisoned with random bytes: every value's bytes,
    header included, are the same, for a whole request and for a chunk of it."""
    from ems.kernels.torch_backend import TorchBackend

    bs = data.draw(st.sampled_from([1, 2, 4, 16]))
    blocks = 12
    cache = make_cache(layers=data.draw(st.integers(1, 3)), blocks=blocks, block_size=bs, interleaved=data.draw(st.booleans()))
    n = data.draw(st.integers(1, 10))
    offsets = [data.draw(st.integers(1, bs)) for _ in range(n)]
    slots = data.draw(st.permutations(range(blocks * bs)))[: sum(offsets)]
    if len(slots) < sum(offsets):
        return
    plan = _planned(cache, list(slots), list(range(100, 100 + n)), offsets)
    a = data.draw(st.integers(0, n - 1))
    b = data.draw(st.integers(a + 1, n))
    seed = data.draw(st.integers(0, 2**31))
    staged = []
    for backend in (TorchBackend(), get_backend(torch.device("cpu"))):
        staging = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, plan.staging_bytes, dtype=np.uint8))
        gathered = copier_for(backend, torch.device("cpu")).gather(plan, staging, a, b)
        assert (gathered is Gathered.VALUES) == (backend.name == "host")
        host = memoryview(staging.numpy())
        staged.append([bytes(v[0]) for v in encode_values(plan, host, a, b, gathered)])
    assert staged[0] == staged[1]
    assert all(matches(v, plan.expected, a + i) for i, v in enumerate(staged[1]))


def test_split_kv_planes_round_trip_on_the_one_pass_path(cc):
    k = [torch.randn(6, 4, 1, 32).to(torch.bfloat16) for _ in range(2)]
    v = [torch.randn(6, 4, 1, 8).to(torch.float32) for _ in range(2)]
    cache = [[k[i], v[i]] for i in range(2)]
    cc.register_kvcache(cache)
    assert cc.save([0, 1, 2, 3, 4, 5], [5, 6], [4, 2]).success == 2
    assert cc.load([12, 13, 14, 15, 16, 17], [5, 6], [4, 2]).success == 2
    for t in k + v:
        assert torch.equal(t[3], t[0]) and torch.equal(t[4, :2], t[1, :2])


def test_store_reservations_and_arena_keep_the_capacity():
    rng = np.random.default_rng(0)
    store = KvStore(64 << 10, verify_on_put=False, prefault_bytes=32 << 10)
    assert store.stats().arena_bytes == 32 << 10
    for step in range(400):
        nbytes = int(rng.choice([1000, 3000, 7000]))
        key = b"k%d" % rng.integers(0, 40)
        reserve = store.charge_of(len(key), nbytes)
        buffer = store.allocate(nbytes, reserve)
        buffer[:] = step % 251
        if rng.random() < 0.2:
            store.recycle(buffer, reserve)
        else:
            assert store.put_owned(key, buffer, reserve)
        stats = store.stats()
        assert stats.used_bytes + stats.spare_bytes <= stats.capacity_bytes
    stats = store.stats()
    assert stats.reused_buffers > 100 and stats.arena_used_bytes > 0
    with pytest.raises(ValueError):
        store.allocate(128 << 10, 128 << 10)


def test_an_arena_buffer_is_never_handed_out_while_a_reader_holds_it():
    store = KvStore(16 << 10, verify_on_put=False, prefault_bytes=16 << 10)
    buffer = store.allocate(4000, store.charge_of(1, 4000))
    buffer[:] = 7
    assert store.put_owned(b"a", buffer, store.charge_of(1, 4000))
    del buffer
    held = store.get(b"a")
    for i in range(8):  # evicts "a" while it is held: its buffer must not come back
        b = store.allocate(4000, store.charge_of(1, 4000))
        b[:] = i
        store.put_owned(bytes([i]), b, store.charge_of(1, 4000))
    assert bytes(held) == bytes([7]) * 4000


@pytest.mark.parametrize("ahead, arena", [("0", 2 << 20), ("1MiB", 4 << 20)])
def test_pool_prefault_setting(monkeypatch, ahead, arena):
    """`pool_prefault` bytes are faulted in at init; with `pool_prefault_ahead` the arena spans the capacity and
    grows in the background, else it is just the pre-faulted bytes."""
    monkeypatch.setenv("EMS_POOL_PREFAULT", "2MiB")
    monkeypatch.setenv("EMS_POOL_PREFAULT_AHEAD", ahead)
    Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "jobs"), pool_capacity="4MiB"))
    try:
        stats = Ems._pool.store.stats()
        assert stats.arena_bytes == arena and stats.prefault_seconds > 0
    finally:
        Ems.shutdown()

"""Client-side hardening (issue 7): requests split at the protocol limits, the accepted hash range, huge timeouts,
object arrays, the bounded span cache, and interrupts that pass through with every lease given back."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch
from ems_testlib import direct_cc, fill_random, keyed, make_cache, slots_of_blocks, snapshot, tensors
from fault_injection import FaultyNode, is_block
from hypothesis import given, settings
from hypothesis import strategies as st

from ems import CcKvOption, CcResult, EmsErrorCode, EmsException, KvBufferWrapper, PrimaryKey
from ems.records import timeout_seconds
from ems.store.kv_store import KvStore
from ems.transport.base import TransportError
from ems.transport.inprocess import InProcessNode
from ems.transport.protocol import RequestLimits
from ems.types import MAX_TIMEOUT_MS


class RecordingNode(FaultyNode):
    """Records the size of every request; can fail (or raise anything) from its n-th request on."""

    def __init__(self, capacity: int = 64 << 20, address: str = "recording:1") -> None:
        super().__init__(InProcessNode(KvStore(capacity)), address)
        self.requests: list[tuple[str, int, int]] = []  # (op, keys, data bytes)
        self.fail_from: int | None = None
        self.raise_on: dict[str, BaseException] = {}
        self.fail_blocks: set[int] = set()  # a request holding any of these blocks fails as a whole

    def _record(self, op: str, keys, data: int) -> None:
        self.requests.append((op, len(keys), data))
        if op in self.raise_on:
            raise self.raise_on[op]
        if self.fail_from is not None and len(self.requests) > self.fail_from:
            self.fail = True
        if self.fail_blocks and any(is_block(key, self.fail_blocks) for key in keys):
            raise TransportError(EmsErrorCode.EMS_IO_ERROR, f"{self.address}: injected failure")

    def put(self, keys, values, timeout_s):
        self._record("put", keys, sum(memoryview(p).nbytes for v in values for p in v))
        return super().put(keys, values, timeout_s)

    def get(self, keys, timeout_s):
        self._record("get", keys, 0)
        return super().get(keys, timeout_s)

    def exists(self, keys, timeout_s, hold=None):
        self._record("exists", keys, 0)
        return super().exists(keys, timeout_s, hold)


@pytest.fixture
def recording():
    made = []

    def make(limits=None, **settings_):
        node = RecordingNode()
        client = direct_cc([node], limits=limits, **settings_)
        made.append((node, client))
        return node, client

    yield make
    for node, client in made:
        node.release()
        client.close()


# ---------------------------------------------------------------- splitting at the protocol limits


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=60),
    max_keys=st.integers(1, 20),
    max_data=st.integers(1, 20000),
    max_meta=st.integers(1, 600),
)
def test_split_batches_cover_in_order_and_keep_every_limit(sizes, max_keys, max_data, max_meta):
    limits = RequestLimits(max_keys=max_keys, max_data_bytes=max_data, max_meta_bytes=max_meta, max_data_frames=7)
    data = np.asarray(sizes, dtype=np.int64)
    meta = data % 97 + 12
    chunks = data % 3 + 1
    batches = limits.batches((data, meta, chunks))
    assert batches[0].start == 0 and batches[-1].stop == len(sizes)
    assert all(a.stop == b.start for a, b in itertools.pairwise(batches))
    for b in batches:
        assert b.stop > b.start
        if b.stop - b.start > 1:  # a batch of one may exceed a limit by itself (the node refuses it)
            assert b.stop - b.start <= max_keys
            assert data[b].sum() <= max_data and meta[b].sum() <= max_meta and chunks[b].sum() <= 7
        # greedy: the next item would have broken a limit
        if b.stop < len(sizes):
            n = b.stop + 1 - b.start
            nxt = slice(b.start, b.stop + 1)
            assert n > max_keys or data[nxt].sum() > max_data or meta[nxt].sum() > max_meta or chunks[nxt].sum() > 7


def test_saves_loads_and_exists_are_split_at_the_limits(recording):
    limits = RequestLimits(max_keys=7, max_data_bytes=20_000, max_meta_bytes=1 << 20, max_data_frames=1 << 20)
    node, cc = recording(limits)
    cache = make_cache(layers=2, blocks=64, block_size=4, heads=2, head_size=32)  # 2 KiB per block
    cc.register_kvcache(cache)
    node.requests.clear()  # (registration read and wrote the namespace record: ems.client.namespaces)
    original = snapshot(cache)
    block_ids = list(range(60))
    hashes = [7000 + b for b in block_ids]
    slots = slots_of_blocks(block_ids, 4)
    assert cc.save(slots, hashes, [4] * 60) == CcResult(60, 60)
    puts = [r for r in node.requests if r[0] == "put"]
    assert len(puts) >= 9 and sum(r[1] for r in puts) == 60
    assert all(keys <= 7 and data <= 20_000 for _, keys, data in puts)
    assert cc.exists(hashes) == CcResult(60, 60)
    assert max(r[1] for r in node.requests if r[0] == "exists") <= 7
    for t in tensors(cache):
        fill_random(t)
    assert cc.load(slots, hashes, [4] * 60) == CcResult(60, 60)
    gets = [r for r in node.requests if r[0] == "get"]
    assert len(gets) >= 9 and all(keys <= 7 for _, keys, _ in gets)
    for t, o in zip(tensors(cache), original):
        assert torch.equal(t[:60].view(torch.uint8), o[:60].view(torch.uint8))


def test_a_node_failing_midway_keeps_the_acknowledged_prefix(recording):
    node, cc = recording(RequestLimits(max_keys=5))
    cc.register_kvcache(make_cache(layers=1, blocks=32, block_size=2))
    # the third request of five keys fails, and the fourth: by their keys, since requests of one call may arrive
    # in any order (chunks in flight at once)
    node.fail_blocks = set(range(10, 20))
    hashes = list(range(20))
    assert cc.save(slots_of_blocks(range(20), 2), hashes, [2] * 20) == CcResult(10, 20)
    node.fail_blocks = set()
    assert cc.exists(hashes) == CcResult(10, 20)


def test_v0_values_are_split_by_bytes(recording):
    node, cc = recording(RequestLimits(max_data_bytes=3000))
    buffers = [fill_random(torch.empty(1000, dtype=torch.uint8)) for _ in range(12)]
    keys = [PrimaryKey("one-node", f"k{i}") for i in range(12)]
    values = [[KvBufferWrapper(b.data_ptr(), 1000)] for b in buffers]
    assert cc.save(CcKvOption(), keys, values) == CcResult(12, 12)
    puts = [r for r in node.requests if r[0] == "put"]
    assert len(puts) >= 6 and all(data <= 3000 for _, _, data in puts)
    copies = [b.clone() for b in buffers]
    for b in buffers:
        b.zero_()
    assert cc.load(CcKvOption(), keys, values) == CcResult(12, 12)
    assert all(torch.equal(a, b) for a, b in zip(buffers, copies))


# ---------------------------------------------------------------- hashes, arrays, timeouts


@pytest.mark.parametrize("bad", [1 << 40000, 2**256, -(2**255) - 1, 2**300], ids=["2**40000", "2**256", "-2**255-1", "2**300"])
def test_hashes_outside_the_accepted_range_are_invalid_arguments(cc, bad):
    cc.register_kvcache(make_cache(layers=1, blocks=4, block_size=2))
    calls = [
        lambda: cc.save([0, 1], [5, bad], [1, 1]),
        lambda: cc.load([0, 1], [5, bad], [1, 1]),
        lambda: cc.save(hashes=[5, bad], chunk_descs=[[(0, 1), (2, 1)]]),
        lambda: cc.async_save([0, 1], [5, bad], [1, 1]),
    ]
    for call in calls:
        with pytest.raises(EmsException) as info:
            call()
        assert info.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
        assert "hashes[1]" in info.value.message() and len(info.value.message()) < 200
    # exists reports a bad argument like every other call (it never turns one into a miss)
    with pytest.raises(EmsException) as info:
        cc.exists([5, bad])
    assert "hashes[1]" in info.value.message()


def test_int64_u64_and_sha256_wide_hashes_are_accepted(cc):
    cache = make_cache(layers=1, blocks=8, block_size=2)
    cc.register_kvcache(cache)
    edges = [-(2**255), -(2**63), -1, 0, 2**63 - 1, 2**64 - 1, 2**200, 2**256 - 1]
    assert cc.save(list(range(8)), edges, [1] * 8) == CcResult(8, 8)
    assert cc.exists(edges) == CcResult(8, 8)
    assert cc.exists(np.array(edges[1:5], dtype=np.int64)) == CcResult(4, 4)
    assert cc.exists(np.array(edges, dtype=object)) == CcResult(8, 8)


def test_object_arrays_of_ints_are_accepted_and_checked_per_item(cc):
    cache = make_cache(layers=1, blocks=4, block_size=2)
    cc.register_kvcache(cache)
    original = snapshot(cache)
    slots = np.array([0, 1, 2], dtype=object)
    offsets = np.array([2, 1], dtype=object)
    assert cc.save(slots, np.array([11, 12], dtype=object), offsets) == CcResult(2, 2)
    for t in tensors(cache):
        fill_random(t)
    assert cc.load(slots, [11, 12], offsets) == CcResult(2, 2)
    for t, o in zip(tensors(cache), original):
        assert torch.equal(t.reshape(-1, *t.shape[2:])[:3].view(torch.uint8), o.reshape(-1, *o.shape[2:])[:3].view(torch.uint8))
    for value, words in [
        (np.array([0, 2**70], dtype=object), ["slot_mapping[1]", "int64"]),
        (np.array([0, "1"], dtype=object), ["slot_mapping[1]", "must be an int"]),
        (np.array([0, True], dtype=object), ["slot_mapping[1]", "must be an int"]),
        (np.array([0, 1.0], dtype=object), ["slot_mapping[1]", "must be an int"]),
    ]:
        with pytest.raises(EmsException) as info:
            cc.save(value, [1], [2])
        assert info.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
        assert all(w in info.value.message() for w in words), info.value.message()


@pytest.mark.parametrize("timeout", [2**62, 2**100, MAX_TIMEOUT_MS + 1, 0])
def test_huge_timeouts_wait_at_most_the_documented_maximum(timeout, recording):
    assert timeout_seconds(CcKvOption(timeout=timeout)) == MAX_TIMEOUT_MS / 1000
    _node, cc = recording()  # a remote-style pool: the timeout reaches locks and futures
    cc.register_kvcache(make_cache(layers=1, blocks=4, block_size=2))
    option = CcKvOption(timeout=timeout)
    assert cc.save([0, 1], [1, 2], [1, 1], option) == CcResult(2, 2)
    assert cc.load([2, 3], [1, 2], [1, 1], option) == CcResult(2, 2)
    assert cc.exists([1, 2], option) == CcResult(2, 2)


# ---------------------------------------------------------------- interrupts pass through, leases come back


def _idle(cc) -> None:
    """Every staging byte given back and every async slot free."""
    assert cc._staging._leased_bytes == 0
    assert cc._async.free_slots() == cc._settings.max_inflight


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_interrupts_are_not_turned_into_ems_errors(recording, interrupt):
    node, cc = recording(max_inflight=2)
    cc.register_kvcache(make_cache(layers=1, blocks=8, block_size=2))
    assert cc.save([0, 1], [1, 2], [1, 1]) == CcResult(2, 2)
    for op, call in [
        ("put", lambda: cc.save([0, 1], [3, 4], [1, 1])),
        ("get", lambda: cc.load([4, 5], [1, 2], [1, 1])),
        ("put", lambda: cc.get_result(cc.async_save([0, 1], [3, 4], [1, 1]))),
        ("get", lambda: cc.get_result(cc.async_load([4, 5], [1, 2], [1, 1]))),
    ]:
        node.raise_on = {op: interrupt()}
        with pytest.raises(interrupt):
            call()
        _idle(cc)
    node.raise_on = {"put": RuntimeError("a transport bug")}
    with pytest.raises(EmsException) as info:
        cc.save([0, 1], [3, 4], [1, 1])
    assert info.value.status_code() == EmsErrorCode.EMS_IO_ERROR  # a failing node fails its keys
    node.raise_on = {}
    _idle(cc)
    assert cc.load([4, 5], [1, 2], [1, 1]) == CcResult(2, 2)


def test_an_interrupt_while_gathering_gives_the_lease_back(recording, monkeypatch):
    _node, cc = recording()
    cc.register_kvcache(make_cache(layers=1, blocks=8, block_size=2))
    from ems.datapath.copier import Copier

    def interrupted(self, plan, staging, a, b):
        raise KeyboardInterrupt

    monkeypatch.setattr(Copier, "gather", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cc.save([0, 1], [3, 4], [1, 1])
    with pytest.raises(KeyboardInterrupt):
        cc.async_save([0, 1], [3, 4], [1, 1])
    _idle(cc)


# ---------------------------------------------------------------- re-registering never keeps old caches alive


def test_re_registering_caches_keeps_no_old_cache_alive(cc):
    """Per-layout tables (the torch backend's span tables, the Triton plane tables) live on the registered planes or
    hold addresses only: after many re-registrations every earlier cache can be freed, and each new one is exact."""
    import gc
    import weakref

    old: list[weakref.ref] = []
    for k in range(24):
        cache = make_cache(layers=2, blocks=4, block_size=2)
        cc.register_kvcache(cache)
        original = snapshot(cache)
        assert cc.save([0, 1], [k, k + 1000], [1, 1]) == CcResult(2, 2)
        for t in tensors(cache):
            fill_random(t)
        assert cc.load([0, 1], [k, k + 1000], [1, 1]) == CcResult(2, 2)
        for t, o in zip(tensors(cache), original):
            assert torch.equal(t[0, :1].view(torch.uint8), o[0, :1].view(torch.uint8))
        old += [weakref.ref(t) for t in tensors(cache)]
        del cache, original, t, o
    gc.collect()
    alive = sum(r() is not None for r in old[:-8])  # all but the last registration's tensors
    assert alive == 0


def test_span_cache_is_safe_under_concurrent_calls(cc):
    cache = make_cache(layers=2, blocks=32, block_size=2)
    cc.register_kvcache(cache)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(30):
                h = t * 1000 + i
                assert cc.save([2 * t, 2 * t + 1], [h, h + 500], [1, 1]) == CcResult(2, 2)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors


def test_pool_client_measures_values_itself_when_not_told_their_sizes():
    from ems.backends.pool_client import PoolClient
    from ems.store.value_format import ExpectedValues, ValueKind, build_headers, checksum

    node = RecordingNode()
    pool = PoolClient([node], limits=RequestLimits(max_data_bytes=2500))
    keys = [b"k%d" % i for i in range(10)]
    payloads = [bytes([i]) * 960 for i in range(10)]
    expected = ExpectedValues(ValueKind.RAW_V0, 0, np.zeros(10, np.uint64), np.full(10, 960, np.int64))
    values = [[h, p] for h, p in zip(build_headers(expected, [checksum([p]) for p in payloads]), payloads)]
    outcome = pool.put(keyed(keys, CcKvOption()), values)
    assert outcome.results == [True] * 10 and not outcome.errors
    puts = [r for r in node.requests if r[0] == "put"]
    assert len(puts) == 5 and all(data <= 2500 for _, _, data in puts)
    got = pool.get(keyed(keys, CcKvOption()))
    assert [bytes(v) for v in got.results] == [b"".join(bytes(p) for p in v) for v in values]
    pool.close()

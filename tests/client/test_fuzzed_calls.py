"""Calls a fuzzer of the public API found breaking the contract, each through the public API: integers near the
int64 limits in chunk_descs and V0 ranges (refused before anything is written, never wrapped), a PrimaryKey that
cannot be encoded, async calls racing `Ems.shutdown`, a registered tensor whose storage the engine replaces, and
u64 hashes of 2**63 and above as a torch tensor. The contract: `EmsException` only, `EMS_INVALID_ARGUMENT` before
anything moves, never a write outside what the call names, never a crash."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from ems_testlib import assert_cache_equals, fill_random, make_cache, snapshot, store_of_ems
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ems import (
    CcConfig,
    CcKvOption,
    Ems,
    EmsConfig,
    EmsErrorCode,
    EmsException,
    KvBufferWrapper,
    PrimaryKey,
    StoreLayerGroupDesc,
)

BS, BLOCKS = 4, 6  # 24 slots per group
INT64_MAX = (1 << 63) - 1
METHODS = ["save", "load", "async_save", "async_load"]


def _call(cc, method: str, *args, **kwargs):
    """The call's result (an async call's, waited for)."""
    result = getattr(cc, method)(*args, **kwargs)
    return result.result(timeout=30) if method.startswith("async") else result


def _invalid(fn, *needles: str) -> EmsException:
    with pytest.raises(EmsException) as info:
        fn()
    assert info.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT, info.value
    for needle in needles:
        assert needle in info.value.message(), (needle, info.value.message())
    return info.value


@pytest.fixture
def two_groups(cc):
    """Two layer groups of one layer each, block 1 of both saved (so a load that slipped through would write)."""
    cache = make_cache(layers=2, blocks=BLOCKS, block_size=BS)
    cc.register_kvcache(cache, [StoreLayerGroupDesc(BS, [0]), StoreLayerGroupDesc(BS, [1])])
    assert cc.save(hashes=[1], chunk_descs=[[(0, BS)], [(0, BS)]]).success == 1
    for t in (t for pair in cache for t in pair):
        fill_random(t)
    return cc, cache


# ---- chunk_descs near 2**63: `start + length` wrapped in int64 and passed the bounds check ----

WRAPPING_RUNS = [(INT64_MAX - 3, 4), (INT64_MAX, 1), (INT64_MAX - 1, BS), (1 << 62, BS)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("run", WRAPPING_RUNS)
def test_chunk_runs_near_the_int64_limit_are_refused_before_anything_is_written(two_groups, method, run):
    cc, cache = two_groups
    store = store_of_ems()
    before, stats = snapshot(cache), store.stats()
    _invalid(lambda: _call(cc, method, hashes=[1], chunk_descs=[[(0, BS)], [run]]), "chunk_descs[1][0]", "leaves")
    assert_cache_equals(cache, before)  # group 0's rows too: the load used to write them before it raised
    after = store.stats()
    assert (after.entries, after.puts, after.hits) == (stats.entries, stats.puts, stats.hits)


_INT64 = st.integers(-(1 << 63), INT64_MAX)
_EDGES = st.sampled_from([0, 1, BS, BS * BLOCKS - 1, BS * BLOCKS, INT64_MAX, INT64_MAX - 1, -(1 << 63), 1 << 62])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(runs=st.lists(st.tuples(_INT64 | _EDGES, _INT64 | _EDGES), min_size=2, max_size=2), method=st.sampled_from(METHODS))
def test_any_int64_chunk_run_is_served_or_refused_whole(two_groups, runs, method):
    """Any int64 (start, length) in either group: a run inside the registered cache is served, anything else is
    refused before a byte moves; never another exception."""
    cc, cache = two_groups
    before = snapshot(cache)
    valid = all(s >= 0 and 1 <= n <= BS and s + n <= BS * BLOCKS for s, n in runs)
    descs = [[runs[0]], [runs[1]]]
    if valid:
        assert _call(cc, method, hashes=[99], chunk_descs=descs).total == 1
        return
    _invalid(lambda: _call(cc, method, hashes=[99], chunk_descs=descs), "chunk_descs")
    assert_cache_equals(cache, before)


# ---- V0 ranges: a length past int64, ranges adding up past it, a range ending above 2**63 ----


def _v0_cases(t: torch.Tensor) -> list[tuple[str, list[KvBufferWrapper], str]]:
    ptr = t.data_ptr()
    return [
        ("length-2**63", [KvBufferWrapper(ptr, 1 << 63)], "value_list[0][0]"),
        ("end-above-2**63", [KvBufferWrapper(INT64_MAX - 7, 64)], "value_list[0][0]"),
        ("sum-past-int64", [KvBufferWrapper(ptr, 1 << 62), KvBufferWrapper(ptr, 1 << 62)], "2**63 - 1"),
    ]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", range(3))
def test_v0_ranges_past_the_int64_limit_are_refused(cc, method, case):
    t = fill_random(torch.empty(4096, dtype=torch.int8))
    before = t.clone()
    _, wrappers, needle = _v0_cases(t)[case]
    entries = store_of_ems().stats().entries
    _invalid(lambda: _call(cc, method, CcKvOption(), ["k"], [wrappers]), needle)
    assert store_of_ems().stats().entries == entries and torch.equal(t, before)


_HUGE = st.integers((1 << 63) - (1 << 40), (1 << 64) - 1)  # past 2**63 from any user-space address


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 256) | _HUGE, min_size=1, max_size=3), method=st.sampled_from(METHODS))
def test_any_u64_v0_length_is_served_or_refused(cc, lengths, method):
    """Lengths anywhere in u64 over a real 256-byte buffer: ranges inside it are served; one that ends above 2**63
    (or ranges adding up past int64) is refused before anything moves, never another exception."""
    t = fill_random(torch.empty(256, dtype=torch.int8))
    before = t.clone()
    wrappers = [KvBufferWrapper(t.data_ptr(), n) for n in lengths]
    if all(n <= 256 for n in lengths):
        assert _call(cc, method, CcKvOption(), ["fits"], [wrappers]).total == 1
        return
    _invalid(lambda: _call(cc, method, CcKvOption(), ["huge"], [wrappers]), "value_list")
    assert torch.equal(t, before)


# ---- a PrimaryKey that cannot be encoded ----


@pytest.mark.parametrize("method", METHODS + ["exists"])
@pytest.mark.parametrize("fields", [("\ud800", "a"), ("a", "b\udfff"), ("x\udc80y", "z")])
def test_a_primary_key_with_a_lone_surrogate_is_an_invalid_argument(cc, method, fields):
    t = fill_random(torch.empty(64, dtype=torch.int8))
    w = [[KvBufferWrapper(t.data_ptr(), 64)]]
    if method == "exists":
        _invalid(lambda: cc.exists([PrimaryKey(*fields)]), "PrimaryKey", "UTF-8")
    else:
        _invalid(lambda: _call(cc, method, CcKvOption(), [PrimaryKey(*fields)], w), "PrimaryKey", "UTF-8")
    assert store_of_ems().stats().entries == 0


# ---- u64 hashes of 2**63 and above, as a torch tensor ----


@pytest.mark.parametrize("dtype", [torch.uint64, torch.uint32])
def test_unsigned_hash_tensors_take_every_value_their_dtype_holds(cc, dtype):
    cache = make_cache(layers=1, blocks=BLOCKS, block_size=BS)
    cc.register_kvcache(cache)
    top = (1 << 64) - 1 if dtype == torch.uint64 else (1 << 32) - 1
    values = [top, top - 1, (top >> 1) + 1]  # for uint64: 2**64 - 1, 2**64 - 2, 2**63
    slots = list(range(3 * BS))
    assert cc.save(slots, torch.tensor(values, dtype=dtype), [BS] * 3).success == 3
    # the same hashes as an np.uint64 array and as Python ints name the same blocks
    assert cc.exists(np.array(values, dtype=np.uint64)).success == 3
    assert cc.exists(values).success == 3
    saved = [t[:3].clone() for t in snapshot(cache)]  # blocks 0-2: the slots above
    for t in (t for pair in cache for t in pair):
        fill_random(t)
    assert cc.load(slots, torch.tensor(values, dtype=dtype), [BS] * 3).success == 3
    assert all(torch.equal(t[:3], s) for t, s in zip((t for pair in cache for t in pair), saved))


# ---- async calls racing Ems.shutdown ----


def test_calls_racing_shutdown_raise_only_ems_exceptions():
    """Threads issuing async saves and loads (and sync ones, and exists) while the main thread shuts the SDK down:
    every call returns or raises `EmsException`; nothing else escapes, and every future handed out resolves. A short
    switch interval makes the threads interleave inside the calls (as a loaded host does)."""
    escaped: list[BaseException] = []
    futures = []
    rng = random.Random(35)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for _ in range(20):
            Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="race"), pool_capacity="16MiB"))
            cc = Ems.get_cc()
            cc.register_kvcache(make_cache(layers=1, blocks=BLOCKS, block_size=BS))
            stop = threading.Event()

            def hammer(seed: int, cc=cc, stop=stop) -> None:
                i = seed
                while not stop.is_set():
                    i += 1
                    block = i % BLOCKS
                    slots = list(range(block * BS, (block + 1) * BS))
                    try:
                        kind = i % 5
                        if kind < 2:
                            futures.append(cc.async_save(slots, [block], [BS]))
                        elif kind < 4:
                            futures.append(cc.async_load(slots, [block], [BS]))
                        else:
                            cc.load(slots, [block], [BS]) if i % 2 else cc.exists([block])
                    except EmsException:
                        pass
                    except BaseException as error:  # what the test looks for
                        escaped.append(error)

            threads = [threading.Thread(target=hammer, args=(k * 3,)) for k in range(4)]
            for thread in threads:
                thread.start()
            time.sleep(rng.uniform(0.01, 0.05))
            Ems.shutdown()
            time.sleep(0.01)  # the threads go on calling the closed client a moment
            stop.set()
            for thread in threads:
                thread.join(60)
                assert not thread.is_alive()
    finally:
        sys.setswitchinterval(interval)
    assert not escaped, escaped[:3]
    for future in futures:  # every future handed out resolves (a result or an EmsException)
        try:
            future.result(timeout=30)
        except EmsException:
            pass


# ---- a registered tensor whose storage is replaced ----

_REPLACED_STORAGE = """
import gc, sys, torch
sys.path.insert(0, {testlib!r})
from ems import CcConfig, Ems, EmsConfig
from ems_testlib import make_cache
Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m"), pool_capacity="64MiB"))
cc = Ems.get_cc()
cache = make_cache(layers=1, blocks=64, block_size=16, heads=4, head_size=64, dtype=torch.float32)  # 1 MiB each
cc.register_kvcache(cache)
saved = cache[0][0][:1].clone()
assert cc.save(list(range(16)), [7], [16]).success == 1
K = cache[0][0]
K.set_(torch.zeros(64, 16, 4, 64))  # the engine replaces K's storage; the old one has no other owner
gc.collect()
canaries = [torch.full((64, 16, 4, 64), 3.0) for _ in range(8)]  # memory the freed storage may be reused for
assert cc.load(list(range(16)), [7], [16]).success == 1
assert all(bool((c == 3.0).all()) for c in canaries), "the load wrote memory it does not own"
assert not K.any(), "the registration moved to the new storage by itself"
cc.register_kvcache(cache)  # registered again: the new storage is the cache now
assert cc.load(list(range(16)), [7], [16]).success == 1 and torch.equal(K[:1], saved)
Ems.shutdown()
print("ok")
"""


def test_a_tensor_whose_storage_is_replaced_after_registration_never_has_freed_memory_written():
    """The host path kept the planes' addresses without holding their storage: a load wrote the freed block and
    the process died at exit. In a child process, so that a crash fails this test instead of the run."""
    script = _REPLACED_STORAGE.format(testlib=str(Path(__file__).resolve().parent.parent))  # tests/: ems_testlib
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.split()[-1:] == ["ok"], (run.returncode, run.stdout[-500:], run.stderr[-2000:])

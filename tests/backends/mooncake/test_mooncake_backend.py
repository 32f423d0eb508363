"""The Mooncake backend's own cases, on a real Mooncake Store on 127.0.0.1 (tests/mooncake_testlib.py): values a
raw Mooncake client damaged or wrote are misses, tenants stay apart, a full store gives partial results that agree,
a storage process killed or stopped mid-run gives misses and errors within the timeout (never a wrong block, never a
hang), and an engine starts before its master answers. The API's general suites run on this backend too
(`@on_both_pools`, the compat adapters)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import numpy as np
import pytest
import torch
from ems_testlib import assert_cache_equals, expected_after_load, keyed, make_cache, poison, slots_of_blocks, snapshot

from ems import CcConfig, CcKvOption, CcResult, ContextCaching, Ems, EmsConfig, EmsErrorCode, EmsException
from ems.backends.mooncake import MooncakePool, mooncake_key
from ems.datapath.keys import v1_keys

BS = 4


def _init(settings: dict, model_id: str = "moon", access_id=None) -> ContextCaching:
    Ems.init(EmsConfig(access_id=access_id, cc_config=CcConfig(0, 0, model_id), **settings))
    cc = Ems.get_cc()
    assert cc is not None
    return cc


def _save(cc, cache, block_ids, hashes, option=None) -> CcResult:
    return cc.save(slots_of_blocks(block_ids, BS), hashes, [BS] * len(hashes), option)


def _load(cc, block_ids, hashes, option=None) -> CcResult:
    return cc.load(slots_of_blocks(block_ids, BS), hashes, [BS] * len(hashes), option)


def _raw_client(master: str):
    from mooncake.store import MooncakeDistributedStore

    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) == 0
    return raw


@pytest.mark.parametrize("attack", ["flip_payload", "flip_header", "foreign", "truncated"])
def test_values_damaged_or_written_by_a_raw_client_are_misses(mooncake, attack):
    """Block 1 of 3 is altered through Mooncake's own client under our key: loads stop before it, blocks after it
    are not written, and the untouched prefix is exact."""
    cc = _init(mooncake.settings())
    cache = make_cache(blocks=8, block_size=BS)
    cc.register_kvcache(cache)
    original = snapshot(cache)
    hashes = [101, 102, 103]
    assert _save(cc, cache, [0, 1, 2], hashes) == CcResult(3, 3)
    name = mooncake_key(v1_keys(cc._v1_namespace, [102])[0][0])
    raw = _raw_client(mooncake.master)
    try:
        value = bytearray(raw.get(name))
        assert len(value) > 40
        if attack == "flip_payload":
            value[-1] ^= 0x40
        elif attack == "flip_header":
            value[12] ^= 0x01  # the layout signature
        elif attack == "foreign":
            value = bytearray(os.urandom(len(value)))
        else:
            value = value[:-8]
        assert raw.upsert(name, bytes(value)) == 0
    finally:
        raw.close()
    poisoned = poison(cache)
    assert _load(cc, [0, 1, 2], hashes) == CcResult(1, 3)
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots_of_blocks([0], BS)))


def test_tenants_and_models_are_apart_in_the_key_space(mooncake):
    """The same block hashes saved by one tenant are misses for another tenant and for another model."""
    cc = _init(mooncake.settings(), access_id="tenant-a")
    cache = make_cache(blocks=4, block_size=BS)
    cc.register_kvcache(cache)
    assert _save(cc, cache, [0, 1], [7, 8]) == CcResult(2, 2)
    settings = Ems.settings()
    for tenant, model in (("tenant-b", "moon"), ("tenant-a", "other-model")):
        other = ContextCaching(CcConfig(0, 0, model), tenant, Ems._pool, settings)
        other.register_kvcache(make_cache(blocks=4, block_size=BS))
        try:
            assert other.exists([7, 8]) == CcResult(0, 2)
            assert _load(other, [0, 1], [7, 8]) == CcResult(0, 2)
        finally:
            other.close()
    assert cc.exists([7, 8]) == CcResult(2, 2)


def test_a_lookup_lease_is_mooncakes_own_and_a_pin_finds_nothing(mooncake):
    """On Mooncake a lease asked for by a lookup is its master's own (every object an exists finds): the blocks are
    counted; a pin cannot be added to an object Mooncake already holds, so a pinning lookup counts none."""
    cc = _init(mooncake.settings())
    cache = make_cache(blocks=4, block_size=BS)
    cc.register_kvcache(cache)
    assert _save(cc, cache, [0, 1], [31, 32]) == CcResult(2, 2)
    assert cc.exists([31, 32], lease_ms=1000) == CcResult(2, 2)
    assert cc.exists([31, 32], pin=True) == CcResult(0, 2)
    assert cc.exists([31, 32]) == CcResult(2, 2)


def test_storage_killed_mid_run_gives_misses_never_a_wrong_block():
    """Saves and loads run in threads while the storage process is killed: every result is a prefix whose blocks
    are byte-exact, every call returns within its timeout (plus scheduling slack), and afterwards loads miss."""
    from mooncake_testlib import MooncakeCluster, mooncake_missing

    if mooncake_missing():
        pytest.skip(mooncake_missing())
    Ems.shutdown()
    cluster = MooncakeCluster(segment_bytes=128 << 20)
    try:
        cc = _init(cluster.settings())
        blocks = 64
        cache = make_cache(blocks=blocks, block_size=BS, heads=2, head_size=64)
        cc.register_kvcache(cache)
        rows = {}  # hash -> the block's bytes when saved (each hash saved once, by one thread)
        lock = threading.Lock()
        stop = threading.Event()
        failures: list = []
        timeout_ms = 800
        option = CcKvOption(timeout=timeout_ms)

        def worker(index: int) -> None:
            rng = random.Random(index)
            own = list(range(index * 16, index * 16 + 16))  # this thread's blocks
            next_hash = index * 1_000_000
            saved: list[int] = []
            while not stop.is_set():
                started = time.monotonic()
                try:
                    if saved and rng.random() < 0.5:
                        pick = saved[-rng.randint(1, min(8, len(saved))) :]
                        ids = own[: len(pick)]
                        result = _load(cc, ids, pick, option)
                        for i, h in enumerate(pick[: result.success]):
                            got = [t[ids[i]].clone() for pair in cache for t in pair]
                            if not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, rows[h])):
                                failures.append(f"wrong block for hash {h}")
                    else:
                        n = rng.randint(1, 8)
                        ids = own[:n]
                        hashes = list(range(next_hash, next_hash + n))
                        next_hash += n
                        for b in ids:
                            for pair in cache:
                                for t in pair:
                                    t[b].copy_(torch.randn_like(t[b].float()).to(t.dtype))
                        content = {h: [t[b].clone() for pair in cache for t in pair] for h, b in zip(hashes, ids)}
                        result = _save(cc, cache, ids, hashes, option)
                        with lock:
                            rows.update({h: content[h] for h in hashes[: result.success]})
                        saved += hashes[: result.success]
                except EmsException as error:
                    if error.status_code() not in (EmsErrorCode.EMS_IO_ERROR, EmsErrorCode.EMS_IO_TIMEOUT):
                        failures.append(f"unexpected {error}")
                elapsed = time.monotonic() - started
                if elapsed > timeout_ms / 1000 + 3.0:  # the deadline, the fence's grace and a loaded host's slack
                    failures.append(f"a call took {elapsed:.2f} s")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        cluster.kill_storage()
        time.sleep(2.0)
        stop.set()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        assert not failures, failures[:5]
        assert rows, "nothing was saved before the kill"
        some = list(rows)[:4]
        try:
            result = _load(cc, list(range(len(some))), some, option)
            assert result.success == 0
        except EmsException as error:
            assert error.status_code() in (EmsErrorCode.EMS_IO_ERROR, EmsErrorCode.EMS_IO_TIMEOUT)
        assert cc._staging.leased_bytes == 0
    finally:
        Ems.shutdown()
        cluster.close()


def test_a_full_store_gives_partial_results_that_agree():
    """A 16 MiB store filled by saves whose blocks are then read (a read's lease keeps Mooncake from evicting them):
    a later save is refused part-way (a partial CcResult, not an error), and exists and load report exactly the
    saved prefix, byte-exact."""
    from mooncake_testlib import MooncakeCluster, mooncake_missing

    if mooncake_missing():
        pytest.skip(mooncake_missing())
    Ems.shutdown()
    cluster = MooncakeCluster(segment_bytes=16 << 20)
    try:
        cc = _init(cluster.settings())
        block_size = 16
        cache = make_cache(layers=4, blocks=80, block_size=block_size, heads=8, head_size=128)  # 256 KiB a block
        cc.register_kvcache(cache)
        results = []
        for round_ in range(3):
            hashes = [round_ * 1000 + i for i in range(40)]
            original = snapshot(cache)
            saved = cc.save(slots_of_blocks(list(range(40)), block_size), hashes, [block_size] * 40)
            assert cc.exists(hashes) == saved
            poisoned = poison(cache)
            loaded = cc.load(slots_of_blocks(list(range(40, 80)), block_size), hashes, [block_size] * 40)
            assert loaded == saved
            want = expected_after_load(poisoned, poisoned, [])
            for t, o in zip(want, original):  # blocks 40.. now hold blocks 0.. of the save, for the saved prefix
                t[40 : 40 + saved.success] = o[: saved.success]
            assert_cache_equals(cache, want)
            results.append(saved.success)
        assert results[0] == 40 and min(results) < 40, results
    finally:
        Ems.shutdown()
        cluster.close()


def test_a_stopped_storage_process_costs_a_timeout_not_a_hang():
    """SIGSTOP the storage process: a load and a save return by their timeout (EMS_IO_TIMEOUT, or misses), staging
    is given back; after SIGCONT the pool serves again and nothing wrong was written meanwhile."""
    from mooncake_testlib import MooncakeCluster, mooncake_missing

    if mooncake_missing():
        pytest.skip(mooncake_missing())
    Ems.shutdown()
    cluster = MooncakeCluster(segment_bytes=64 << 20)
    try:
        cc = _init(cluster.settings())
        cache = make_cache(blocks=8, block_size=BS)
        cc.register_kvcache(cache)
        original = snapshot(cache)
        assert _save(cc, cache, [0, 1, 2], [1, 2, 3]) == CcResult(3, 3)
        assert cluster.storage is not None
        os.kill(cluster.storage.pid, signal.SIGSTOP)
        try:
            option = CcKvOption(timeout=400)
            poisoned = poison(cache)
            for call in (lambda: _load(cc, [0, 1, 2], [1, 2, 3], option), lambda: _save(cc, cache, [3], [9], option)):
                started = time.monotonic()
                try:
                    result = call()
                    assert result.success == 0
                except EmsException as error:
                    assert error.status_code() in (EmsErrorCode.EMS_IO_TIMEOUT, EmsErrorCode.EMS_IO_ERROR)
                assert time.monotonic() - started < 0.4 + 2.5
            assert_cache_equals(cache, poisoned)  # nothing was written by the load that timed out
            assert cc._staging.leased_bytes == 0
        finally:
            os.kill(cluster.storage.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while _load(cc, [0, 1, 2], [1, 2, 3]).success != 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert_cache_equals(cache, expected_after_load(original, poisoned, slots_of_blocks([0, 1, 2], BS)))
    finally:
        Ems.shutdown()
        cluster.close()


def test_init_before_the_master_answers_is_recoverable():
    """No master at the address: Ems.init raises EMS_RECOVERD_ERROR within about connect_timeout_ms, check_health
    is False (and never raises), and a call on the backend meanwhile is a miss, not a hang; once a master starts
    there, check_health turns True and Ems.init succeeds."""
    from mooncake_testlib import MooncakeCluster, free_port, mooncake_missing

    if mooncake_missing():
        pytest.skip(mooncake_missing())
    port = free_port()
    master = f"127.0.0.1:{port}"
    config = EmsConfig(cc_config=CcConfig(0, 0, "m"), pool_backend="mooncake", mooncake_master=master, connect_timeout_ms=300)
    started = time.monotonic()
    with pytest.raises(EmsException) as raised:
        Ems.init(config)
    assert raised.value.status_code() == EmsErrorCode.EMS_RECOVERD_ERROR
    assert master in raised.value.message()
    assert time.monotonic() - started < 3.0
    assert Ems.check_health() is False
    cluster = MooncakeCluster(segment_bytes=32 << 20, port=port)
    try:
        deadline = time.monotonic() + 20
        while not Ems.check_health() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert Ems.check_health()
        Ems.init(config)
        cc = Ems.get_cc()
        cc.register_kvcache(make_cache(blocks=4, block_size=BS))
        assert _save(cc, None, [0], [5]) == CcResult(1, 1) and cc.exists([5]) == CcResult(1, 1)
    finally:
        Ems.shutdown()
        cluster.close()
    from ems.settings import MooncakeSettings

    pool = MooncakePool(MooncakeSettings(master=master), connect_timeout_s=0.2)
    try:
        started = time.monotonic()
        outcome = pool.exists(keyed([b"k"], CcKvOption(timeout=200)))
        assert outcome.results == [False] and outcome.unreachable
        assert time.monotonic() - started < 2.0
    finally:
        pool.close()


def test_staging_is_registered_once_and_zero_copy(mooncake):
    """Requests reuse registered staging: after many calls the backend holds one registration per staging buffer,
    values went straight from and to it (no bounce buffer was needed for V1), and registrations end at shutdown."""
    cc = _init(mooncake.settings())
    cache = make_cache(blocks=16, block_size=BS)
    cc.register_kvcache(cache)
    pool = Ems._pool
    assert isinstance(pool, MooncakePool)
    memory = pool._memory
    # (the engine's namespace record, put at registration from its own bytes, may have taken a bounce buffer)
    bounced_before = len(memory.bounce._free)
    for round_ in range(5):
        hashes = [round_ * 100 + i for i in range(8)]
        assert _save(cc, cache, list(range(8)), hashes) == CcResult(8, 8)
        assert _load(cc, list(range(8, 16)), hashes) == CcResult(8, 8)
    assert 1 <= len(memory.registered) <= 3
    assert memory.bounce.leased_bytes == 0 and len(memory.bounce._free) == bounced_before  # V1 never bounced
    bases = np.array(sorted(memory.registered), dtype=np.int64)
    assert memory.registry.covers(bases, np.ones_like(bases)).all()

"""The V1 generation of SDK engines: slot_mapping saves and loads, futures polled from the engine loop
(`is_ready` / `get_result`) or resolved with `future.result()`, `Ems.check_health()` from a daemon thread while
saves run; Python `hash()` block hashes (signed, any int64). Embedded pool and two real pool nodes."""

from __future__ import annotations

import random
import time

import torch
from cachelib import (
    all_blocks_except,
    as_dict,
    assert_blocks_equal,
    assert_poisoned,
    make_cache,
    poison,
)
from sdk_engines import V1Engine, chained_block_hashes, option, whole_block_slots

BS = 4


def _hashes(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return chained_block_hashes([rng.randrange(32000) for _ in range(n * BS)], BS, seed)


def test_v1_slot_mapping_async_polling_with_health_checks(pool):
    seed = random.randrange(1 << 30)
    engine = V1Engine(pool_nodes=pool, health_interval_s=0.005)
    try:
        assert engine.context_caching is not None, engine.init_error
        cache = make_cache(4, 24, BS, (2, 16), (2, 16), torch.float16, torch.float16, seed)  # GQA-shaped
        engine.register_kv_caches(as_dict(cache))
        original = [(k.clone(), v.clone()) for k, v in cache]
        requests = {f"req-{r}": (_hashes(3, seed + r), [3 * r + 1, 3 * r + 2, 3 * r + 3]) for r in range(5)}
        saved: dict[str, int] = {}
        for step, (req_id, (hashes, ids)) in enumerate(requests.items()):
            engine.async_save(req_id, hashes, ids)  # blocks copied out: the engine may overwrite them now
            if step % 2:
                saved.update(engine.drain()[0])  # resolve some while others are still pending
        saved.update(engine.drain()[0])
        assert saved == {req_id: 3 * BS for req_id in requests}
        deadline = time.monotonic() + 5
        while len(engine.health.answers) < 3 and time.monotonic() < deadline:
            engine.async_save("extra", _hashes(1, seed + 99), [23])  # saves keep running meanwhile
            engine.drain()
        assert engine.health.answers and all(engine.health.answers) and not engine.health.errors

        poison(cache)
        miss_hashes = requests["req-2"][0][:1] + _hashes(2, seed + 1000)  # block 1 was never saved
        for req_id, (hashes, ids) in requests.items():
            engine.async_load(req_id, hashes, ids, computed_blocks=1 if req_id == "req-0" else 0)
        engine.async_load("miss", miss_hashes, [16, 17, 18])
        _, loaded = engine.drain()
        expected = {req_id: 3 * BS for req_id in requests}
        expected["req-0"] += BS  # locally computed blocks are added by the engine, not by the SDK
        expected["miss"] = 1 * BS
        assert loaded == expected
        for _, ids in requests.values():
            assert_blocks_equal(cache, ids, original, ids)
        assert_blocks_equal(cache, [16], original, requests["req-2"][1][:1])
        assert_poisoned(cache, [0, 17, 18] + list(range(19, 24)))  # nothing after the first miss

        # future.result() straight on the returned future (the other adapter style)
        poison(cache)
        hashes, ids = requests["req-4"]
        future = engine.context_caching.async_load(
            slot_mapping=whole_block_slots(ids, BS), hashes=hashes, offsets=[BS] * 3, option=option()
        )
        assert future.result().success == 3
        assert_blocks_equal(cache, ids, original, ids)
        assert_poisoned(cache, all_blocks_except(cache, ids))
    finally:
        engine.close()


def test_v1_hashes_any_int64(pool):
    """Python's hash() is any int64: negative, the extremes, zero."""
    engine = V1Engine(pool_nodes=pool)
    seed = random.randrange(1 << 30)
    cache = make_cache(2, 8, BS, (1, 8), (1, 8), torch.bfloat16, torch.bfloat16, seed)
    engine.register_kv_caches(as_dict(cache))
    salt = random.randrange(1 << 20)
    hashes = [-(2**63) + salt, 2**63 - 1 - salt, -1 - salt, salt, hash(("neg", seed)) | -(2**62)]
    assert min(hashes) < 0
    cc = engine.context_caching
    ids = [0, 1, 2, 3, 4]
    assert cc.save(whole_block_slots(ids, BS), hashes, [BS] * 5, option()).success == 5
    original = [(k.clone(), v.clone()) for k, v in cache]
    poison(cache)
    assert cc.load(whole_block_slots([7, 6, 5, 4, 3], BS), hashes, [BS] * 5, option()).success == 5
    assert_blocks_equal(cache, [7, 6, 5, 4, 3], original, ids)

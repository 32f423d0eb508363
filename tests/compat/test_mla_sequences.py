"""Long random sequences of saves and loads on an MLA split K/V cache (K latent and V rope of different dtypes),
through both V1 forms (slot_mapping, chunk_descs), against a model of what the pool holds: every load writes
exactly the verified hit prefix, byte-exact, and nothing else."""

from __future__ import annotations

import random

import pytest
import torch
from cachelib import (
    all_blocks_except,
    as_dict,
    assert_poisoned,
    block_bytes,
    mla_cache,
    poison,
    random_tensor,
)
from sdk_engines import V1Engine, whole_block_slots

from ems import CcKvOption

BS, BLOCKS, LAYERS = 4, 16, 2


def _fill_block(cache, block: int, gen: torch.Generator) -> None:
    for pair in cache:
        for t in pair:
            t[block] = random_tensor(list(t[block].shape), t.dtype, gen)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_save_load_sequence(seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    engine = V1Engine(is_mla=True)
    cache = mla_cache(LAYERS, BLOCKS, BS, torch.bfloat16, torch.float32, seed)
    engine.register_kv_caches(as_dict(cache))
    cc = engine.context_caching
    stored: dict[int, bytes] = {}  # block hash -> the block's bytes (all layers, K then V)
    option = CcKvOption(timeout=5000)
    for _ in range(40):
        n = rng.randint(1, 5)
        ids = rng.sample(range(BLOCKS), n)
        chunk_form = rng.random() < 0.5
        if rng.random() < 0.5 or not stored:  # save fresh blocks
            hashes = [rng.randrange(-(2**63), 2**63) for _ in range(n)]
            for b in ids:
                _fill_block(cache, b, gen)
            if chunk_form:
                result = cc.save(hashes=hashes, chunk_descs=[[(b * BS, BS) for b in ids]], option=option)
            else:
                result = cc.save(whole_block_slots(ids, BS), hashes, [BS] * n, option)
            assert (result.success, result.total) == (n, n)
            stored.update({h: block_bytes(cache, b) for h, b in zip(hashes, ids)})
        else:  # load a mix of stored and unknown hashes
            known = list(stored)
            hashes = [rng.choice(known) if rng.random() < 0.8 else rng.randrange(2**62) for _ in range(n)]
            hashes = list(dict.fromkeys(hashes))  # keys are unique within a call
            ids = ids[: len(hashes)]
            hits = next((i for i, h in enumerate(hashes) if h not in stored), len(hashes))
            poison(cache)
            if chunk_form:
                future = cc.async_load(hashes=hashes, chunk_descs=[[(b * BS, BS) for b in ids]], option=option)
            else:
                future = cc.async_load(whole_block_slots(ids, BS), hashes, [BS] * len(ids), option)
            assert future.result().success == hits
            for h, b in zip(hashes[:hits], ids[:hits]):
                assert block_bytes(cache, b) == stored[h]
            assert_poisoned(cache, all_blocks_except(cache, ids[:hits]))
            assert cc.exists(hashes).success == hits

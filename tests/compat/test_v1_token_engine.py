"""The token semantics of the SDK's 2025-09 edition, as an engine uses them: prompts given as token ids with a mask
of the prefix the engine holds already, no hashes; the engine takes `held + success` tokens as computed. Prompts
that share a prefix meet in the pool, whichever request saved it. Embedded pool, two real pool nodes, Mooncake."""

from __future__ import annotations

import random

import torch
from cachelib import POISON, as_dict, assert_poisoned, make_cache, poison
from sdk_engines import V1TokenEngine

BS = 4


def _assert_tokens_equal(cache, block_ids, original, source_ids, first: int, end: int) -> None:
    """Tokens first..end-1 of a request in `block_ids` hold what tokens first..end-1 held in `source_ids`."""
    for t in range(first, end):
        b, o = block_ids[t // BS], t % BS
        sb = source_ids[t // BS]
        for (k, v), (ok, ov) in zip(cache, original):
            assert torch.equal(k[b, o].view(torch.uint8), ok[sb, o].view(torch.uint8)), (t, "K")
            assert torch.equal(v[b, o].view(torch.uint8), ov[sb, o].view(torch.uint8)), (t, "V")


def test_prompts_sharing_a_prefix_meet_by_tokens(pool):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    engine = V1TokenEngine(pool_nodes=pool)
    try:
        assert engine.context_caching is not None, engine.init_error
        cache = make_cache(3, 16, BS, (2, 16), (2, 16), torch.bfloat16, torch.bfloat16, seed)
        engine.register_kv_caches(as_dict(cache))
        original = [(k.clone(), v.clone()) for k, v in cache]
        a = [rng.randrange(32000) for _ in range(13)]  # 3 full blocks and 1 token
        b = a[:8] + [rng.randrange(32000) for _ in range(3)]  # shares a's first 2 blocks; 11 tokens
        a_ids, b_ids, c_ids = [1, 2, 3, 4], [5, 6, 7], [8, 9, 10]

        # request a: nothing held, nothing in the pool; computed, then saved whole
        engine.async_load_tokens("a", a, a_ids, held=0)
        assert engine.drain()[1] == {"a": 0}
        engine.async_save_tokens("a", torch.tensor(a), a_ids, held=0)
        assert engine.drain()[0] == {"a": 13}

        # request b: the engine holds its first block in its own prefix cache (block 5); the pool has a's second
        # block (same tokens, same prefix), not b's third: 4 tokens loaded, the engine starts computing at 8
        poison(cache)
        engine.async_load_tokens("b", b, b_ids, held=BS)
        assert engine.drain()[1] == {"b": 8}
        _assert_tokens_equal(cache, b_ids, original, a_ids, BS, 8)
        assert_poisoned(cache, [i for i in range(16) if i != 6])  # the held block and the missed one untouched
        # b's last 3 tokens are computed (new bytes in block 7), then saved: the 8 it held or loaded are in the pool
        computed = make_cache(3, 16, BS, (2, 16), (2, 16), torch.bfloat16, torch.bfloat16, seed + 1)
        for (k, v), (ck, cv) in zip(cache, computed):
            k[7], v[7] = ck[7], cv[7]
        engine.async_save_tokens("b", b, b_ids, held=8)
        assert engine.drain()[0] == {"b": 11}

        # request c = b in other blocks, nothing held: a's two blocks and b's partial third, 11 tokens
        poison(cache)
        engine.async_load_tokens("c", torch.tensor(b, dtype=torch.int32), c_ids, held=0)
        assert engine.drain()[1] == {"c": 11}
        _assert_tokens_equal(cache, c_ids, original, a_ids, 0, 8)
        _assert_tokens_equal(cache, c_ids, computed, [0, 0, 7], 8, 11)
        assert_poisoned(cache, [i for i in range(16) if i not in c_ids])
        for k, v in cache:  # the partial block's 4th slot is not c's: untouched
            assert bool((k[c_ids[2], 3].view(torch.uint8) == POISON).all() and (v[c_ids[2], 3].view(torch.uint8) == POISON).all())
    finally:
        engine.close()

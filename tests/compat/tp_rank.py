"""One TP rank of an MLA engine as its own process, for test_v1_mla_tp: `python tp_rank.py JSON`.

JSON: {"nodes": [...], "rank": r, "seed": s, "k_dtype": "bfloat16", "v_dtype": "float32"}. Every rank builds the
same KV content (seeded) at its own block ids, runs the SDK-shaped V1 engine with `kvcache_type=MLA` set after
construction: save, exists, then load into its poisoned cache; prints one JSON line of results.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cachelib import (
    all_blocks_except,
    as_dict,
    block_bytes,
    copy_blocks,
    mla_cache,
    poison,
)
from sdk_engines import V1Engine, chained_block_hashes

BS, LAYERS, BLOCKS = 4, 3, 12
IDS = {0: [1, 3, 5, 7, 9], 1: [10, 8, 6, 4, 2]}


def main() -> None:
    args = json.loads(sys.argv[1])
    rank, seed = args["rank"], args["seed"]
    k_dtype, v_dtype = getattr(torch, args["k_dtype"]), getattr(torch, args["v_dtype"])
    rng = random.Random(seed)
    hashes = chained_block_hashes([rng.randrange(32000) for _ in range(5 * BS)], BS, seed)
    content = mla_cache(LAYERS, BLOCKS, BS, k_dtype, v_dtype, seed)
    cache = mla_cache(LAYERS, BLOCKS, BS, k_dtype, v_dtype, seed + 1 + rank)
    ids = IDS[rank]
    copy_blocks(cache, ids, content, IDS[0])
    engine = V1Engine(rank_in_tp=rank, tp_size=2, is_mla=True, pool_nodes=args["nodes"])
    out: dict = {"init_error": str(engine.init_error) if engine.init_error else None}
    if engine.context_caching is not None:
        engine.register_kv_caches(as_dict(cache))
        engine.async_save("save", hashes, ids)
        out["save_tokens"] = engine.drain()[0]["save"]
        out["exists"] = engine.context_caching.exists(hashes).success
        poison(cache)
        engine.async_load("load", hashes, ids)
        out["load_tokens"] = engine.drain()[1]["load"]
        out["exact"] = all(block_bytes(cache, d) == block_bytes(content, s) for d, s in zip(ids, IDS[0]))
        out["untouched"] = all(
            bool((t[b].contiguous().view(torch.uint8) == 0xA5).all())
            for b in all_blocks_except(cache, ids)
            for pair in cache
            for t in pair
        )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

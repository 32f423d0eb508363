"""The V1 generation with DeepSeek-style MLA: `CcConfig_v1` with `kvcache_type = KVCacheType.MLA` set after
construction, split K/V registered per layer (K = latent `[blocks, bs, 1, 512]`, V = rope `[blocks, bs, 1, 64]`,
possibly of different dtypes), two TP ranks holding the same KV at different block ids: both save the same blocks,
they are stored once, and both load them byte-exact. Embedded pool (two ranks on one pool), two real nodes (the
ranks as successive inits of this process, sharing the nodes), and two rank processes saving at once."""

from __future__ import annotations

import random

import pytest
import torch
from cachelib import (
    all_blocks_except,
    as_dict,
    assert_blocks_equal,
    assert_poisoned,
    copy_blocks,
    mla_cache,
    poison,
)
from sdk_engines import (
    ACCESS_ID,
    V1Engine,
    chained_block_hashes,
    option,
    whole_block_slots,
)

from ems import Ems
from ems.client.context_caching import ContextCaching

BS = 4
LAYERS, BLOCKS = 3, 12


def _stored_entries() -> int:
    return Ems._pool.store.stats().entries  # white-box: the embedded store


class _Rank:
    """One TP rank: its engine-side cache and the SDK client it talks to."""

    def __init__(self, cc: ContextCaching, cache) -> None:
        self.cc, self.cache = cc, cache
        cc.register_kvcache([list(kv) for kv in as_dict(cache).values()])

    def save(self, hashes, ids) -> int:
        return (
            self.cc.async_save(slot_mapping=whole_block_slots(ids, BS), hashes=hashes, offsets=[BS] * len(ids), option=option())
            .result()
            .success
        )

    def load(self, hashes, ids) -> int:
        future = self.cc.async_load(
            slot_mapping=whole_block_slots(ids, BS), hashes=hashes, offsets=[BS] * len(ids), option=option()
        )
        while not self.cc.is_ready(future):
            pass
        return self.cc.get_result(future).success


def _rank(pool, rank: int, cache, embedded_peer: V1Engine = None) -> _Rank:
    """Rank `rank` of TP 2 with MLA: on the embedded pool a second client over the same pool (two ranks of one
    host); with nodes a fresh `Ems.init` of this process (as a rank's own process would do)."""
    if pool is None and embedded_peer is not None:
        peer = embedded_peer.config
        config = type(peer)(
            rank_id=rank,
            device_id=rank,
            model_id=peer.model_id,
            tp_world_size=2,
            rank_in_tp_group=rank,
            llm_engine=peer.llm_engine,
        )
        config.kvcache_type = peer.kvcache_type
        return _Rank(ContextCaching(config, ACCESS_ID, Ems._pool, Ems.settings()), cache)
    Ems.shutdown()
    engine = V1Engine(rank_in_tp=rank, tp_size=2, is_mla=True, pool_nodes=pool)
    assert engine.context_caching is not None, engine.init_error
    return _Rank(engine.context_caching, cache)


@pytest.mark.parametrize(
    "k_dtype,v_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)], ids=["bf16", "fp16_k-fp32_v"]
)
def test_mla_split_kv_two_tp_ranks_store_once_both_load(pool, k_dtype, v_dtype):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    hashes = chained_block_hashes([rng.randrange(32000) for _ in range(5 * BS)], BS, seed)
    content = mla_cache(LAYERS, BLOCKS, BS, k_dtype, v_dtype, seed)  # the KV every TP rank computed
    ids0, ids1 = [1, 3, 5, 7, 9], [10, 8, 6, 4, 2]
    cache0 = mla_cache(LAYERS, BLOCKS, BS, k_dtype, v_dtype, seed + 1)
    cache1 = mla_cache(LAYERS, BLOCKS, BS, k_dtype, v_dtype, seed + 2)
    copy_blocks(cache0, ids0, content, ids0)
    copy_blocks(cache1, ids1, content, ids0)

    engine0 = V1Engine(rank_in_tp=0, tp_size=2, is_mla=True, pool_nodes=pool)
    assert engine0.context_caching is not None, engine0.init_error
    assert engine0.config.shares_kv_across_tp
    rank0 = _Rank(engine0.context_caching, cache0)
    group = rank0.cc.layout.groups[0]
    assert group.planes.plane_row_bytes[:2] == (512 * cache0[0][0].element_size(), 64 * cache0[0][1].element_size())
    assert rank0.save(hashes, ids0) == 5
    entries = _stored_entries() if pool is None else None

    rank1 = _rank(pool, 1, cache1, engine0)
    assert rank1.cc.exists(hashes).success == 5  # rank 0's blocks under the shared keys, before rank 1 saves
    assert rank1.save(hashes, ids1) == 5
    if pool is None:
        assert _stored_entries() == entries == 5  # stored once

    poison(cache1)
    assert rank1.load(hashes, ids1) * BS == 5 * BS
    assert_blocks_equal(cache1, ids1, content, ids0)
    assert_poisoned(cache1, all_blocks_except(cache1, ids1))

    if pool is None:
        rank1.cc.close()  # the second client of this process
    else:  # rank 0 again, as its own init
        rank0 = _rank(pool, 0, cache0)
    poison(cache0)
    prefix = hashes[:2] + [hashes[2] ^ 1] + hashes[3:]  # block 2 missing: 2 hits, nothing written after
    assert rank0.load(prefix, ids0) == 2
    assert_blocks_equal(cache0, ids0[:2], content, ids0[:2])
    assert_poisoned(cache0, all_blocks_except(cache0, ids0[:2]))
    assert rank0.load(hashes, ids0) == 5
    assert_blocks_equal(cache0, ids0, content, ids0)


def test_without_mla_tp_ranks_keep_their_own_keys():
    """The contrast: MHA ranks of one TP group hold different heads, so they must not share keys."""
    engine0 = V1Engine(rank_in_tp=0, tp_size=2)
    cache = mla_cache(1, 4, BS, torch.bfloat16, torch.bfloat16, 1)
    rank0 = _Rank(engine0.context_caching, cache)
    hashes = [-5, 7]
    assert rank0.save(hashes, [0, 1]) == 2
    config = type(engine0.config)(
        rank_id=1,
        device_id=1,
        model_id=engine0.config.model_id,
        tp_world_size=2,
        rank_in_tp_group=1,
        llm_engine=engine0.config.llm_engine,
    )
    rank1 = _Rank(
        ContextCaching(config, ACCESS_ID, Ems._pool, Ems.settings()), mla_cache(1, 4, BS, torch.bfloat16, torch.bfloat16, 2)
    )
    assert rank1.cc.exists(hashes).success == 0
    rank1.cc.close()


def test_mla_two_rank_processes_concurrently(two_nodes):
    """Each TP rank its own process, as engines run them, saving the same blocks at once on two real nodes; both
    load them byte-exact."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("ucxx")
    script = Path(__file__).resolve().parent / "tp_rank.py"
    seed = random.randrange(1 << 30)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                json.dumps(
                    {
                        "nodes": [n.address for n in two_nodes],
                        "rank": rank,
                        "seed": seed,
                        "k_dtype": "bfloat16",
                        "v_dtype": "float32",
                    }
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    for out in outs:
        assert out == {
            "init_error": None,
            "save_tokens": 5 * BS,
            "exists": 5,
            "load_tokens": 5 * BS,
            "exact": True,
            "untouched": True,
        }

"""The V0 generation of SDK engines: plain `str` keys and raw `KvBufferWrapper` buffers over the engine's cache
tensors, with MLA's different K and V sizes per block; on the embedded pool and on two real pool nodes."""

from __future__ import annotations

import random

import pytest
import torch
from cachelib import (
    all_blocks_except,
    assert_blocks_equal,
    assert_poisoned,
    make_cache,
    mla_cache,
    poison,
)
from sdk_engines import V0Engine, chained_block_hashes

BS = 4


def _tokens(n_blocks: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n_blocks * BS)]


@pytest.mark.parametrize(
    "k_dtype,v_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)], ids=["bf16", "fp16_k-fp32_v"]
)
def test_v0_str_keys_raw_buffers_split_kv(pool, k_dtype, v_dtype):
    seed = random.randrange(1 << 30)  # fresh keys on the shared nodes
    writer = mla_cache(layers=3, blocks=10, block_size=BS, k_dtype=k_dtype, v_dtype=v_dtype, seed=seed)
    engine = V0Engine(writer, pool_nodes=pool)
    assert engine.k_bytes != engine.v_bytes  # MLA: K and V buffers of different sizes per block
    tokens = _tokens(6, seed)
    hashes = chained_block_hashes(tokens, BS, seed)
    src_ids = [5, 1, 6, 2, 7, 3]
    assert engine.save(hashes, src_ids) == 6
    assert engine.cc.exists(engine.keys(hashes)).success == 6  # str keys in exists too

    # another cache (a new request's blocks): the engine points its buffers at it and loads
    reader = mla_cache(layers=3, blocks=10, block_size=BS, k_dtype=k_dtype, v_dtype=v_dtype, seed=seed + 1)
    poison(reader)
    engine.kv_caches = reader
    dst_ids = [0, 2, 4, 6, 8, 9]
    loaded = engine.load(hashes, dst_ids)
    assert loaded * BS == 6 * BS
    assert_blocks_equal(reader, dst_ids, writer, src_ids)
    assert_poisoned(reader, all_blocks_except(reader, dst_ids))

    # a prompt sharing the first 3 blocks, then diverging: 3 hits, nothing written from the first miss on
    poison(reader)
    other = tokens[: 3 * BS] + _tokens(3, seed + 2)
    hashes2 = chained_block_hashes(other, BS, seed)
    assert hashes2[:3] == hashes[:3] and not set(hashes2[3:]) & set(hashes)
    assert engine.load(hashes2, dst_ids) == 3
    assert_blocks_equal(reader, dst_ids[:3], writer, src_ids[:3])
    assert_poisoned(reader, all_blocks_except(reader, dst_ids[:3]))


def test_v0_mha_and_primary_keys_coexist(pool):
    """Equal K and V sizes (MHA), str keys next to PrimaryKeys of the same text: distinct keys, both load."""
    from ems import CcKvOption, PrimaryKey

    seed = random.randrange(1 << 30)
    writer = make_cache(2, 6, BS, (2, 8), (2, 8), torch.float16, torch.float16, seed)
    engine = V0Engine(writer, pool_nodes=pool)
    hashes = chained_block_hashes(_tokens(2, seed), BS, seed)
    assert engine.save(hashes, [1, 2]) == 2
    text_keys = engine.keys(hashes)
    as_primary = [PrimaryKey(k.rsplit("@", 1)[0], k.rsplit("@", 1)[1]) for k in text_keys]
    assert engine.cc.exists(as_primary).success == 0  # a str key is its own form, never a PrimaryKey's
    assert engine.cc.save(CcKvOption(), as_primary, engine.values([3, 4])).success == 2
    reader = make_cache(2, 6, BS, (2, 8), (2, 8), torch.float16, torch.float16, seed + 1)
    poison(reader)
    engine.kv_caches = reader
    assert engine.cc.load(CcKvOption(), as_primary, engine.values([0, 5])).success == 2
    assert_blocks_equal(reader, [0, 5], writer, [3, 4])
    assert engine.load(hashes, [2, 3]) == 2
    assert_blocks_equal(reader, [2, 3], writer, [1, 2])

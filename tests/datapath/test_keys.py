"""Storage keys: deterministic across processes, MLA shares keys across TP ranks (GQA does not), everything a value
depends on is in the namespace, any Python int works as a block hash."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from ems_testlib import assert_cache_equals, direct_cc, expected_after_load, fill_random, make_cache, poison, snapshot

from ems import CcConfig, CcConfig_v1, CcKvOption, KvBufferWrapper, PrimaryKey, StoreLayerGroupDesc
from ems.datapath.keys import encode_hash, namespace, route_key_of, v0_keys, v1_keys
from ems.datapath.layout import register_layout
from ems.store.ns_records import is_record_key

CHILD = r"""
import sys, torch
from ems import CcConfig, CcConfig_v1, PrimaryKey
from ems.datapath.keys import namespace, v0_keys, v1_keys
from ems.datapath.layout import register_layout
cache = [[torch.zeros(2, 4, 2, 8, dtype=torch.float16) for _ in range(2)] for _ in range(3)]
sig = register_layout(cache).signature
ns = namespace("tenant-a", CcConfig_v1(rank_id=1, device_id=0, model_id="llama", tp_world_size=2, rank_in_tp_group=1), sig)
keys, routes = v1_keys(ns, [0, -1, 2**70, 12345])
k0, r0 = v0_keys(namespace(None, CcConfig(0, 0, "llama"), None), [PrimaryKey("d", "a")])
sys.stdout.write((b"|".join([ns, *keys, *routes, *k0, *r0, str(sig).encode()])).hex())
"""


def _local() -> bytes:
    cache = [[torch.ones(2, 4, 2, 8, dtype=torch.float16) for _ in range(2)] for _ in range(3)]
    sig = register_layout(cache).signature
    ns = namespace("tenant-a", CcConfig_v1(rank_id=1, device_id=0, model_id="llama", tp_world_size=2, rank_in_tp_group=1), sig)
    keys, routes = v1_keys(ns, [0, -1, 2**70, 12345])
    k0, r0 = v0_keys(namespace(None, CcConfig(0, 0, "llama"), None), [PrimaryKey("d", "a")])
    return b"|".join([ns, *keys, *routes, *k0, *r0, str(sig).encode()])


def test_keys_are_deterministic_across_processes():
    expected = _local()
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"  # another str hash() than this process's
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert bytes.fromhex(out.stdout) == expected


def _ns(cc_config, tenant=None, sig=1):
    return namespace(tenant, cc_config, sig)


def test_mla_shares_keys_across_tp_ranks_gqa_does_not():
    def v1(kind, rank):
        return CcConfig_v1(rank_id=rank, device_id=rank, model_id="m", tp_world_size=2, rank_in_tp_group=rank, kvcache_type=kind)

    assert _ns(v1("MLA", 0)) == _ns(v1("MLA", 1))
    assert _ns(v1("GQA", 0)) != _ns(v1("GQA", 1))
    assert _ns(v1("MHA", 0)) != _ns(v1("MHA", 1))
    # PP ranks never share, MLA or not
    a = CcConfig_v1(0, 0, "m", pp_world_size=2, rank_in_pp_group=0, kvcache_type="MLA")
    b = CcConfig_v1(1, 0, "m", pp_world_size=2, rank_in_pp_group=1, kvcache_type="MLA")
    assert _ns(a) != _ns(b)
    # V0 CcConfig: rank_id derives the TP rank
    assert _ns(CcConfig(0, 0, "m", tp_world_size=2)) != _ns(CcConfig(1, 1, "m", tp_world_size=2))


def test_namespace_covers_tenant_model_layout():
    base = CcConfig(0, 0, "m")
    distinct = {
        _ns(base),
        _ns(base, tenant="t1"),
        _ns(base, tenant="t2"),
        _ns(CcConfig(0, 0, "m2")),
        _ns(base, sig=2),
        _ns(base, sig=None),
    }
    assert len(distinct) == 6


def _layout_sig(**kw):
    return register_layout(make_cache(**kw)).signature


def test_layout_signature_covers_dtype_heads_head_size_layers_groups():
    base = dict(layers=2, blocks=4, block_size=4, heads=2, head_size=8, dtype=torch.float16)
    sigs = {_layout_sig(**base)}
    for change in (dict(dtype=torch.bfloat16), dict(heads=4, head_size=4), dict(head_size=16, heads=1), dict(layers=3)):
        sigs.add(_layout_sig(**{**base, **change}))
    assert len(sigs) == 5
    # the number of blocks in the engine's cache is not part of what a value depends on
    assert _layout_sig(**base) == _layout_sig(**{**base, "blocks": 9})
    cache = make_cache(**base)
    one = register_layout(cache).signature
    two = register_layout(cache, [StoreLayerGroupDesc(4, [0]), StoreLayerGroupDesc(4, [1])]).signature
    assert one != two


def test_mla_ranks_share_blocks_end_to_end(fault_node_factory):
    node = fault_node_factory()

    def rank(r, kind):
        cfg = CcConfig_v1(rank_id=r, device_id=r, model_id="ds", tp_world_size=2, rank_in_tp_group=r, kvcache_type=kind)
        return direct_cc([node], cc_config=cfg)

    for kind, shared in (("MLA", True), ("GQA", False)):
        r0, r1 = rank(0, kind), rank(1, kind)
        try:
            c0 = make_cache(layers=2, blocks=4, block_size=4)
            c1 = make_cache(layers=2, blocks=4, block_size=4)
            r0.register_kvcache(c0)
            r1.register_kvcache(c1)
            original = snapshot(c0)
            assert r0.save(list(range(8)), [1, 2], [4, 4]).success == 2
            poisoned = poison(c1)
            n = r1.load(list(range(8)), [1, 2], [4, 4]).success
            if shared:
                assert n == 2
                assert_cache_equals(c1, expected_after_load(original, poisoned, list(range(8))))
            else:
                assert n == 0
                assert_cache_equals(c1, poisoned)
        finally:
            r0.close()
            r1.close()
        node.store.clear()


def test_tenants_are_isolated(fault_node_factory):
    node = fault_node_factory()
    a = direct_cc([node], tenant="alice")
    b = direct_cc([node], tenant="bob")
    try:
        for cc in (a, b):
            cc.register_kvcache(make_cache(layers=1, blocks=2, block_size=4))
        assert a.save([0, 1, 2, 3], [5], [4]).success == 1
        assert b.exists([5]).success == 0
        buf = fill_random(torch.empty(16, dtype=torch.int8))
        w = [[KvBufferWrapper(buf.data_ptr(), 16)]]
        assert a.save(CcKvOption(), [PrimaryKey("d", "a")], w).success == 1
        assert b.exists([PrimaryKey("d", "a")]).success == 0
        assert a.exists([PrimaryKey("d", "a")]).success == 1
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("h", [0, 1, -1, 255, -256, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**64), 2**200, -(2**200)])
def test_encode_hash_roundtrips(h):
    raw = encode_hash(h)
    assert int.from_bytes(raw, "little", signed=True) == h


def test_encode_hash_is_injective():
    values = list(range(-70000, 70000)) + [2**k + d for k in range(8, 130, 8) for d in (-1, 0, 1)]
    values += [-v for v in values]
    values = list(set(values))
    assert len({encode_hash(v) for v in values}) == len(values)


def test_v0_keys_injective_and_routed_by_distribute_key():
    ns = b"\x00" * 16
    keys = [PrimaryKey("ab", "c"), PrimaryKey("a", "bc"), PrimaryKey("abc", "x"), PrimaryKey("ab", "d")]
    storage, routes = v0_keys(ns, keys)
    assert len(set(storage)) == 4
    assert routes == [b"ab", b"a", b"abc", b"ab"]
    # a V0 key and a V1 hash never share a storage key
    v1, _ = v1_keys(ns, [int.from_bytes(b"\x02\x00abc", "little")])
    assert not set(v1) & set(storage)


def test_large_and_negative_hashes_end_to_end(cc):
    """The whole accepted range: int64 (Python hash() values) and u64 (engines' digests)."""
    cache = make_cache(layers=2, blocks=4, block_size=4)
    cc.register_kvcache(cache)
    hashes = [2**64 - 1, -(2**63), -1, 0, 2**63 - 1]
    slots = list(range(10))
    offsets = [2, 2, 2, 2, 2]
    original = snapshot(cache)
    assert cc.save(slots, hashes, offsets).success == 5
    assert cc.exists(hashes).success == 5
    assert cc.exists([2**64 - 2]).success == 0
    poisoned = poison(cache)
    assert cc.load(slots, hashes, offsets).success == 5
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots))
    import numpy as np

    assert cc.exists(np.array([-1, 0, 5], dtype=np.int64)).success == 2  # numpy hashes name the same keys


def test_u64_hash_arrays_name_the_same_keys_as_lists(cc):
    """Engines often hold u64 hashes in numpy arrays; values >= 2**63 are valid hashes."""
    cc.register_kvcache(make_cache(layers=1, blocks=2, block_size=4))
    hashes = [2**64 - 1, 2**63 + 5, 3]
    assert cc.save([0, 1, 2], hashes, [1, 1, 1]).success == 3
    import numpy as np

    assert cc.exists(np.array(hashes, dtype=np.uint64)).success == 3
    assert cc.exists([np.uint64(h) for h in hashes]).success == 3
    assert cc.load([4, 5, 6], np.array(hashes, dtype=np.uint64), [1, 1, 1]).success == 3


def test_v0_routing_by_distribute_key_and_v1_spread(fault_node_factory):
    nodes = [fault_node_factory(address=f"node-{i}:70{i}") for i in range(3)]
    cc = direct_cc(nodes)
    try:
        bufs = [fill_random(torch.empty(8, dtype=torch.int8)) for _ in range(12)]
        values = [[KvBufferWrapper(b.data_ptr(), 8)] for b in bufs]
        keys = [PrimaryKey(f"req-{i // 4}", f"layer-{i % 4}") for i in range(12)]
        assert cc.save(CcKvOption(), keys, values).success == 12
        for group in range(3):  # each distribute_key's 4 keys live on one node
            holders = [n for n in nodes if any(f"req-{group}".encode() in k for k in n.stored_keys())]
            assert len(holders) == 1
        cc.register_kvcache(make_cache(layers=1, blocks=16, block_size=4))
        assert cc.save(list(range(64)), list(range(64)), [1] * 64).success == 64
        counts = [sum(not is_record_key(k) for k in n.stored_keys()) for n in nodes]  # (not the namespace record)
        assert sum(counts) == 76 and min(counts) > 5  # 64 block hashes spread over all three nodes
        assert cc.exists(list(range(64))).success == 64
    finally:
        cc.close()


def test_a_models_namespace_records_route_together():
    """Every slot of a model's records routes by the model's digest (one set of owners: registering touches
    `pool_replicas` nodes on any pool), another model's elsewhere; a key that only looks like a record (wrong length)
    routes by itself."""
    from ems.store.ns_records import record_keys

    keys = record_keys("tenant", "model-a")
    routes = {route_key_of(k) for k in keys}
    assert len(routes) == 1 and len(next(iter(routes))) == 8
    assert route_key_of(record_keys("tenant", "model-b")[0]) not in routes
    assert route_key_of(record_keys("other", "model-a")[0]) not in routes
    assert route_key_of(keys[0] + b"x") == keys[0] + b"x"

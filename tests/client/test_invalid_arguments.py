"""Every bad input raises EmsException(EMS_INVALID_ARGUMENT) with a message naming the argument (and index), and
writes nothing: the pool holds no new entry and the engine's cache is unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ems_testlib import assert_cache_equals, fill_random, make_cache, snapshot, store_of_ems

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

BS, BLOCKS = 4, 4  # 16 slots


def _raises(fn, *needles):
    with pytest.raises(EmsException) as info:
        fn()
    exc = info.value
    assert exc.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT, exc
    for needle in needles:
        assert needle in exc.message(), f"{needle!r} not in {exc.message()!r}"
    return exc


@pytest.fixture
def registered(cc):
    cache = make_cache(layers=2, blocks=BLOCKS, block_size=BS, dtype=torch.float16)
    cc.register_kvcache(cache)
    # something valid already stored, so a wrong load would have something to write
    assert cc.save(list(range(16)), [1, 2, 3, 4], [4, 4, 4, 4]).success == 4
    fill_random(cache[0][0])
    return cc, cache


V1_ORDER = "(slot_mapping, hashes, offsets, option)"
V1_CASES = [
    ("sum_offsets", ([0, 1, 2], [1], [2]), {}, ["sum(offsets)", "len(slot_mapping)"]),
    ("len_hashes", ([0, 1], [1, 2], [2]), {}, ["len(hashes)", "len(offsets)"]),
    ("empty_slots", ([], [1], [1]), {}, ["slot_mapping"]),
    ("negative_slot", ([0, -1], [1], [2]), {}, ["slot_mapping[1]", "-1"]),
    ("slot_past_cache", ([0, 1, 2, 16], [1], [4]), {}, ["slot_mapping[3]", "16"]),
    ("huge_slot", ([0, 2**62], [1], [2]), {}, ["slot_mapping[1]"]),
    ("offset_zero", ([0, 1], [1, 2], [2, 0]), {}, ["offsets[1]"]),
    ("offset_negative", ([0, 1], [1, 2], [3, -1]), {}, ["offsets[1]"]),
    ("offset_past_block", ([0, 1, 2, 3, 4], [1], [5]), {}, ["offsets[0]"]),
    ("duplicate_hash", ([0, 1], [7, 7], [1, 1]), {}, ["hashes[1]"]),
    ("empty_hashes", ([0], [], [1]), {}, ["hashes"]),
    ("float_slot", ([0, 1.0], [1], [2]), {}, ["slot_mapping[1]"]),
    ("bool_slot", ([0, True], [1], [2]), {}, ["slot_mapping[1]"]),
    # long lists (past the short-list path): every kind of bad item is still found and named
    ("long_bool_slot", (list(range(2, 71)) + [True], [1], [70]), {}, ["slot_mapping[69]"]),
    ("long_bool_among_ones", ([1, 0] * 40 + [False], [1], [81]), {}, ["slot_mapping[80]"]),
    ("long_float_slot", (list(range(70)) + [3.0], [1], [71]), {}, ["slot_mapping[70]"]),
    ("long_string_slot", (list(range(70)) + ["7"], [1], [71]), {}, ["slot_mapping[70]"]),
    ("long_huge_slot", (list(range(70)) + [2**64], [1], [71]), {}, ["slot_mapping[70]"]),
    ("long_numpy_bool_slot", (list(range(70)) + [np.True_], [1], [71]), {}, ["slot_mapping[70]"]),
    ("numpy_bool_slot", ([0, np.True_], [1], [2]), {}, ["slot_mapping[1]"]),
    ("float_tensor_slots", (torch.tensor([0.0, 1.0]), [1], [2]), {}, ["slot_mapping"]),
    ("string_hash", ([0, 1], ["abc"], [2]), {}, ["hashes[0]"]),
    ("float_hash", ([0, 1], [1.5], [2]), {}, ["hashes[0]"]),
    ("bool_hash", ([0, 1], [True], [2]), {}, ["hashes[0]"]),
    ("bool_offset", ([0, 1], [1, 2], [True, 1]), {}, ["offsets[0]"]),
    ("string_slots", ("0123", [1], [4]), {}, ["slot_mapping"]),
    ("nested_slots", ([[0, 1]], [1], [2]), {}, ["slot_mapping"]),
    ("bad_option", ([0, 1], [1], [2]), {"option": "fast"}, ["option"]),
    ("bad_option_positional", ([0, 1], [1], [2], {"timeout": 5}), {}, ["option"]),
    ("unknown_kwarg", ([0, 1], [1], [2]), {"slots": [0]}, ["slots"]),
    ("both_semantics", ([0, 1], [1], [2]), {"chunk_descs": [[(0, 2)]]}, ["chunk_descs", "slot_mapping"]),
    ("chunk_group_count", (), {"hashes": [1], "chunk_descs": [[(0, 2)], [(0, 2)]]}, ["chunk_descs", "1"]),
    ("chunk_group_len", (), {"hashes": [1, 2], "chunk_descs": [[(0, 2)]]}, ["chunk_descs[0]", "len(hashes)"]),
    ("chunk_leaves_cache", (), {"hashes": [1, 2], "chunk_descs": [[(0, 2), (15, 2)]]}, ["chunk_descs[0][1]"]),
    ("chunk_negative_start", (), {"hashes": [1], "chunk_descs": [[(-1, 2)]]}, ["chunk_descs[0][0]"]),
    ("chunk_zero_length", (), {"hashes": [1, 2], "chunk_descs": [[(0, 2), (4, 0)]]}, ["chunk_descs[0][1]"]),
    ("chunk_past_block_size", (), {"hashes": [1], "chunk_descs": [[(0, 5)]]}, ["chunk_descs[0][0]"]),
    ("chunk_not_pairs", (), {"hashes": [1], "chunk_descs": [[(0, 2, 3)]]}, ["chunk_descs[0][0]"]),
    ("chunk_float", (), {"hashes": [1], "chunk_descs": [[(0, 2.0)]]}, ["chunk_descs[0][0]"]),
    ("chunk_bool", (), {"hashes": [1], "chunk_descs": [[(0, True)]]}, ["chunk_descs[0][0]"]),
    ("chunk_not_list", (), {"hashes": [1], "chunk_descs": "x"}, ["chunk_descs"]),
    ("chunk_without_hashes", (), {"chunk_descs": [[(0, 2)]]}, ["hashes"]),
    ("only_hashes", (), {"hashes": [1]}, ["slot_mapping"]),
    # a V1 call given its option first is told the V1 form's order, not the V0 form's arity
    ("option_first", (CcKvOption(), [0, 1, 2, 3], [1], [4]), {}, ["option", V1_ORDER]),
    ("option_first_no_offsets", (CcKvOption(), [0, 1, 2, 3], [1]), {}, ["option", V1_ORDER]),
    ("option_first_tensor", (CcKvOption(), torch.arange(4), [1], [4]), {}, ["option", V1_ORDER]),
    ("option_first_keywords", (CcKvOption(),), {"hashes": [1], "chunk_descs": [[(0, 4)]]}, ["option", V1_ORDER]),
]

METHODS = ["save", "load", "async_save", "async_load"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("args,kwargs,needles", [c[1:] for c in V1_CASES], ids=[c[0] for c in V1_CASES])
def test_bad_v1_arguments(registered, method, args, kwargs, needles):
    cc, cache = registered
    store = store_of_ems()
    before_stats = store.stats()
    before = snapshot(cache)
    _raises(lambda: getattr(cc, method)(*args, **kwargs), *needles)
    after_stats = store.stats()
    assert (after_stats.entries, after_stats.puts, after_stats.hits) == (
        before_stats.entries,
        before_stats.puts,
        before_stats.hits,
    )
    assert_cache_equals(cache, before)


@pytest.mark.parametrize("method", ["load", "async_load"])
def test_load_refuses_a_slot_twice(registered, method):
    cc, cache = registered
    before = snapshot(cache)
    _raises(lambda: getattr(cc, method)([0, 1, 2, 0], [1], [4]), "slot_mapping", "3")
    _raises(lambda: getattr(cc, method)(hashes=[1, 2], chunk_descs=[[(0, 4), (2, 2)]]), "chunk_descs[0]")
    assert_cache_equals(cache, before)


def _buf(n=16):
    t = fill_random(torch.empty(n, dtype=torch.int8))
    return t, KvBufferWrapper(t.data_ptr(), n)


V0_CASES = [
    ("duplicate_keys", lambda w: (CcKvOption(), [PrimaryKey("a", "b"), PrimaryKey("a", "b")], [[w], [w]]), ["key_list[1]"]),
    ("len_values", lambda w: (CcKvOption(), [PrimaryKey("a", "b")], [[w], [w]]), ["len(value_list)"]),
    ("empty_keys", lambda w: (CcKvOption(), [], []), ["key_list"]),
    ("key_not_primary", lambda w: (CcKvOption(), [b"a"], [[w]]), ["key_list[0]", "PrimaryKey or a str"]),
    ("key_empty_str", lambda w: (CcKvOption(), [""], [[w]]), ["key_list[0]", "empty"]),
    ("key_long_str", lambda w: (CcKvOption(), ["k" * 1025], [[w]]), ["key_list[0]", "1024"]),
    ("key_long_utf8_str", lambda w: (CcKvOption(), ["\u00e9" * 513], [[w]]), ["key_list[0]", "1026 bytes"]),
    ("key_surrogate_str", lambda w: (CcKvOption(), ["a\udc80"], [[w]]), ["key_list[0]", "UTF-8"]),
    ("duplicate_str_keys", lambda w: (CcKvOption(), ["k", "k"], [[w], [w]]), ["key_list[1]"]),
    ("value_not_wrapper", lambda w: (CcKvOption(), [PrimaryKey("a", "b")], [[(1, 2)]]), ["value_list[0][0]"]),
    ("value_empty", lambda w: (CcKvOption(), [PrimaryKey("a", "b")], [[]]), ["value_list[0]"]),
    ("value_not_list", lambda w: (CcKvOption(), [PrimaryKey("a", "b")], "x"), ["value_list"]),
    ("option_none", lambda w: (None, [PrimaryKey("a", "b")], [[w]]), ["option"]),
]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("make,needles", [c[1:] for c in V0_CASES], ids=[c[0] for c in V0_CASES])
def test_bad_v0_arguments(cc, method, make, needles):
    t, w = _buf()
    before = t.clone()
    store = store_of_ems()
    entries = store.stats().entries
    args = make(w)
    if args[0] is None:  # V0 is recognised by its keywords when option is missing
        _raises(lambda: getattr(cc, method)(option=None, key_list=args[1], value_list=args[2]), *needles)
    else:
        _raises(lambda: getattr(cc, method)(*args), *needles)
    assert store.stats().entries == entries
    assert torch.equal(t, before)


def test_bad_value_types():
    _raises(lambda: PrimaryKey("a" * 128, "b"), "distribute_key", "128")
    _raises(lambda: PrimaryKey("a", "b" * 200), "attribute_key")
    PrimaryKey("a" * 127, "b" * 127)  # under 128 characters is fine
    _raises(lambda: PrimaryKey("", "b"), "distribute_key")
    _raises(lambda: PrimaryKey(1, "b"), "distribute_key")
    _raises(lambda: KvBufferWrapper(0, 8), "data_ptr")
    _raises(lambda: KvBufferWrapper(-8, 8), "data_ptr")
    _raises(lambda: KvBufferWrapper(4096, 0), "length")
    _raises(lambda: KvBufferWrapper(4096, -1), "length")
    _raises(lambda: KvBufferWrapper(4096, 1.5), "length")
    _raises(lambda: CcKvOption(timeout=-1), "timeout")
    _raises(lambda: CcKvOption(timeout=1.5), "timeout")
    _raises(lambda: CcKvOption(write_rcache=1), "write_rcache")
    _raises(lambda: CcKvOption(read_local_only="no"), "read_local_only")
    assert CcKvOption(timeout=0).timeout == 0
    _raises(lambda: StoreLayerGroupDesc(0, [0]), "store_block_size")
    _raises(lambda: StoreLayerGroupDesc(4, []), "layer_ids")
    _raises(lambda: StoreLayerGroupDesc(4, [0, -1]), "layer_ids[1]")


def test_v0_wrapping_address_refused(cc):
    _raises(lambda: cc.save(CcKvOption(), [PrimaryKey("a", "b")], [[KvBufferWrapper(2**64 - 8, 16)]]), "value_list[0][0]")
    assert store_of_ems().stats().entries == 0


def test_exists_arguments(registered):
    cc, _ = registered
    _raises(lambda: cc.exists([]), "hashes")
    _raises(lambda: cc.exists([1, "x"]), "hashes[1]")
    _raises(lambda: cc.exists([1, 1]), "hashes[1]")
    _raises(lambda: cc.exists([1], option=3), "option")
    _raises(lambda: cc.exists([1], timeout=3), "timeout")
    _raises(lambda: cc.exists(5), "hashes")


def test_future_arguments(cc):
    _raises(lambda: cc.is_ready("future"), "future")
    _raises(lambda: cc.get_result(None), "future")


# ------------------------------------------------------------------ before init / before registration


def test_calls_before_init():
    assert Ems.get_cc() is None
    assert Ems.check_health() is False


def test_v1_calls_before_register(cc):
    for method in METHODS:
        _raises(lambda: getattr(cc, method)([0, 1], [1], [2]), "register_kvcache")
        _raises(lambda: getattr(cc, method)(hashes=[1], chunk_descs=[[(0, 2)]]), "register_kvcache")
    _raises(lambda: cc.exists([1]), "register_kvcache")
    assert store_of_ems().stats().entries == 0


def test_second_init():
    config = EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m"), pool_capacity="8MiB")
    Ems.init(config)
    cc = Ems.get_cc()
    assert Ems.check_health() is True
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m"), pool_capacity="8MiB"))  # equal: no-op
    assert Ems.get_cc() is cc
    _raises(lambda: Ems.init(EmsConfig(cc_config=CcConfig(rank_id=1, device_id=0, model_id="m"))), "Ems.shutdown() first")
    assert Ems.get_cc() is cc
    _raises(lambda: Ems.init("config"), "config")
    Ems.shutdown()
    assert Ems.get_cc() is None and Ems.check_health() is False
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=1, device_id=0, model_id="m")))  # after shutdown: allowed
    assert Ems.get_cc() is not None and Ems.get_cc() is not cc


def test_calls_after_shutdown_refused():
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m"), pool_capacity="8MiB"))
    cc = Ems.get_cc()
    cc.register_kvcache(make_cache(blocks=2, block_size=2))
    Ems.shutdown()
    with pytest.raises(EmsException):
        cc.save([0, 1], [1], [2])


# ------------------------------------------------------------------ register_kvcache


def _kv(shape=(BLOCKS, BS, 2, 8), dtype=torch.float16, device="cpu"):
    return torch.ones(shape, dtype=dtype, device=device)


REGISTER_CASES = [
    ("not_list", lambda: (_kv(), None), ["kvcache"]),
    ("empty", lambda: ([], None), ["kvcache"]),
    ("three_tensors", lambda: ([[_kv(), _kv(), _kv()]], None), ["kvcache[0]"]),
    ("one_tensor", lambda: ([[_kv(), _kv()], [_kv()]], None), ["kvcache[1]"]),
    ("not_tensor", lambda: ([[_kv(), np.ones((4, 4, 2, 8))]], None), ["kvcache[0][1]"]),
    ("three_dims", lambda: ([[_kv((4, 4, 16)), _kv((4, 4, 16))]], None), ["kvcache[0][0]"]),
    ("empty_dim", lambda: ([[_kv((0, 4, 2, 8)), _kv((0, 4, 2, 8))]], None), ["kvcache[0][0]"]),
    # heads, head_size and dtype may differ inside a group (MLA split K/V); blocks and block_size may not
    ("blocks_differ", lambda: ([[_kv(), _kv()], [_kv(), _kv((BLOCKS + 1, BS, 2, 4))]], None), ["kvcache[1][1]", "block"]),
    ("block_size_differs", lambda: ([[_kv(), _kv((BLOCKS, BS * 2, 2, 8), torch.bfloat16)]], None), ["kvcache[0][1]"]),
    (
        "row_not_contiguous",
        lambda: ([[_kv(), torch.ones(BLOCKS, BS, 8, 2, dtype=torch.float16).transpose(2, 3)]], None),
        ["kvcache[0][1]", "contiguous"],
    ),
    ("meta_device", lambda: ([[_kv(device="meta"), _kv(device="meta")]], None), ["kvcache[0][0]", "meta"]),
    ("bool_dtype", lambda: ([[_kv(dtype=torch.bool), _kv(dtype=torch.bool)]], None), ["kvcache[0][0]"]),
    (
        "group_repeats_layer",
        lambda: ([[_kv(), _kv()], [_kv(), _kv()]], [StoreLayerGroupDesc(BS, [0, 1]), StoreLayerGroupDesc(BS, [1])]),
        ["store_layer_group_desc[1]", "1"],
    ),
    (
        "group_misses_layer",
        lambda: ([[_kv(), _kv()], [_kv(), _kv()], [_kv(), _kv()]], [StoreLayerGroupDesc(BS, [0, 2])]),
        ["store_layer_group_desc", "1"],
    ),
    (
        "group_names_missing_layer",
        lambda: ([[_kv(), _kv()]], [StoreLayerGroupDesc(BS, [0, 1])]),
        ["store_layer_group_desc[0]", "1"],
    ),
    ("groups_empty", lambda: ([[_kv(), _kv()]], []), ["store_layer_group_desc"]),
    ("groups_not_desc", lambda: ([[_kv(), _kv()]], [(BS, [0])]), ["store_layer_group_desc[0]"]),
    (
        "group_shapes_differ",
        lambda: ([[_kv(), _kv()], [_kv((BLOCKS, 2 * BS, 4, 8)), _kv((BLOCKS, 2 * BS, 4, 8))]], [StoreLayerGroupDesc(BS, [0, 1])]),
        ["kvcache[1][0]"],
    ),
]


@pytest.mark.parametrize("make,needles", [c[1:] for c in REGISTER_CASES], ids=[c[0] for c in REGISTER_CASES])
def test_bad_register(cc, make, needles):
    good = make_cache(layers=1, blocks=BLOCKS, block_size=BS)
    cc.register_kvcache(good)
    layout = cc.layout
    kvcache, groups = make()
    _raises(lambda: cc.register_kvcache(kvcache, groups), *needles)
    assert cc.layout is layout  # a refused registration keeps the previous one


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs two device types with real memory")
def test_register_refuses_mixed_devices(cc):
    _raises(lambda: cc.register_kvcache([[_kv(), _kv(device="cuda")]]), "kvcache[0][1]")


def test_register_accepts_layer_groups_with_different_shapes(cc):
    cache = [[_kv(), _kv()], [_kv((2, 8, 1, 4), torch.float32), _kv((2, 8, 1, 4), torch.float32)]]
    cc.register_kvcache(cache, [StoreLayerGroupDesc(BS, [0]), StoreLayerGroupDesc(8, [1])])
    assert len(cc.layout.groups) == 2

"""The token form (the SDK's 2025-09 edition): save and load by `slot_mapping` + `token_ids` + `mask`, keys derived
from the tokens (`ems.datapath.tokens`), results in tokens. Through the public API, checked byte for byte: what a
load writes (exactly the mask-1 tokens of the blocks found, consecutively from the first) and what it must not touch
(the masked prefix, everything after the first miss, every other slot)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ems_testlib import (
    DTYPES,
    assert_cache_equals,
    direct_cc,
    expected_after_load,
    make_cache,
    on_both_pools,
    poison,
    snapshot,
    store_of_ems,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ems import CcConfig, CcKvOption, CcResult, Ems, EmsConfig, EmsErrorCode, EmsException, StoreLayerGroupDesc
from ems.datapath.tokens import chain_digests

BS, BLOCKS = 4, 8  # 32 slots
OPTION = CcKvOption(timeout=5000)


def _paged_slots(block_ids: list[int], n: int, block_size: int = BS) -> list[int]:
    """Where an engine keeps n tokens: token t at slot block_ids[t // bs] * bs + t % bs."""
    return [block_ids[t // block_size] * block_size + t % block_size for t in range(n)]


def _mask(n: int, masked: int) -> list[int]:
    return [0] * masked + [1] * (n - masked)


def _digest_ints(tokens: list[int], block_size: int = BS) -> list[int]:
    """The derived block hashes as ints (what an engine would pass if it guessed them): for the mixed-use tests."""
    return [int.from_bytes(bytes(row), "big") for row in chain_digests(np.array(tokens, dtype=np.int64), block_size)]


@pytest.fixture
def registered(cc):
    cache = make_cache(layers=2, blocks=BLOCKS, block_size=BS, heads=2, head_size=8)
    cc.register_kvcache(cache)
    return cc, cache


# ---------------------------------------------------------------- the SDK's sample and the result semantics


@on_both_pools
def test_the_sdk_sample_saves_and_loads_the_partial_suffix(registered):
    """The pages' sample: block_size 4, six tokens, mask [0, 0, 0, 0, 1, 1]: the suffix is the last two tokens, a
    partial block, stored as a value of two tokens; the result counts tokens."""
    cc, cache = registered
    original = snapshot(cache)
    slot_mapping, token_ids, mask = [0, 1, 2, 3, 4, 5], [101, 102, 103, 104, 105, 106], [0, 0, 0, 0, 1, 1]
    assert cc.save(slot_mapping=slot_mapping, token_ids=token_ids, mask=mask, option=OPTION) == CcResult(2, 2)
    poisoned = poison(cache)
    assert cc.get_result(cc.async_load(slot_mapping=slot_mapping, token_ids=token_ids, mask=mask, option=OPTION)) == CcResult(
        2, 2
    )
    assert_cache_equals(cache, expected_after_load(original, poisoned, [4, 5]))
    # block 0 was never saved (masked): asking for all six tokens misses at once and writes nothing
    poisoned = poison(cache)
    assert cc.load(slot_mapping, token_ids=token_ids, mask=[1] * 6, option=OPTION) == CcResult(0, 6)
    assert_cache_equals(cache, poisoned)


@on_both_pools
def test_masks_of_every_length(registered):
    """For every prefix length P of a 10-token sequence (blocks 4 + 4 + 2): a save by tokens reports the n - P
    tokens asked for; a load with the same mask writes exactly slots[P:], never the masked prefix (not even inside
    the block it shares with the suffix), and a load asking for more than was saved stops at the first block that
    was not."""
    cc, cache = registered
    n = 10
    slot_mapping = _paged_slots([6, 1, 3], n)
    for masked in range(n + 1):
        token_ids = [1000 * masked + t for t in range(n)]  # new tokens for each P: nothing saved before
        original = snapshot(cache)
        assert cc.save(slot_mapping, token_ids=token_ids, mask=_mask(n, masked), option=OPTION) == CcResult(
            n - masked, n - masked
        )
        poisoned = poison(cache)
        assert cc.load(slot_mapping, token_ids=token_ids, mask=_mask(n, masked), option=OPTION) == CcResult(
            n - masked, n - masked
        )
        assert_cache_equals(cache, expected_after_load(original, poisoned, slot_mapping[masked:]))
        # everything asked for: only the blocks the save stored (from block P // 4 on) can be found
        poisoned = poison(cache)
        result = cc.load(slot_mapping, token_ids=token_ids, mask=_mask(n, 0), option=OPTION)
        hits = n if masked < BS else 0
        assert result == CcResult(hits, n), (masked, result)
        assert_cache_equals(cache, expected_after_load(original, poisoned, slot_mapping[:hits]))


def test_a_mask_of_zeros_moves_nothing(registered):
    cc, cache = registered
    before, stats = snapshot(cache), store_of_ems().stats()
    for call in (cc.save, cc.load):
        assert call([0, 1, 2], token_ids=[5, 6, 7], mask=[0, 0, 0]) == CcResult(0, 0)
    for call in (cc.async_save, cc.async_load):
        assert cc.get_result(call([0, 1, 2], token_ids=[5, 6, 7], mask=[False] * 3)) == CcResult(0, 0)
    after = store_of_ems().stats()
    assert (after.entries, after.puts, after.hits, after.misses) == (stats.entries, stats.puts, stats.hits, stats.misses)
    assert_cache_equals(cache, before)


def test_a_partial_last_block_is_its_own_value(registered):
    """A sequence saved with a partial last block, then grown: the grown block (full now) has another key, so it
    misses, while the full blocks before it still hit; the old partial block is still found by the old sequence."""
    cc, cache = registered
    original = snapshot(cache)
    slots = _paged_slots([2, 5, 7], 12)
    tokens = list(range(50, 62))
    assert cc.save(slots[:6], token_ids=tokens[:6], mask=[1] * 6) == CcResult(6, 6)
    poisoned = poison(cache)
    assert cc.load(slots[:8], token_ids=tokens[:8], mask=[1] * 8) == CcResult(4, 8)
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots[:4]))
    poisoned = poison(cache)
    assert cc.load(slots[:6], token_ids=tokens[:6], mask=[0, 0, 0, 1, 1, 1]) == CcResult(3, 3)
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots[3:6]))


def test_a_token_changes_the_keys_of_its_block_and_every_block_after(registered):
    cc, _ = registered
    slots = _paged_slots([0, 1, 2], 12)
    tokens = list(range(200, 212))
    assert cc.save(slots, token_ids=tokens, mask=[1] * 12) == CcResult(12, 12)
    for position in range(12):
        changed = list(tokens)
        changed[position] += 1
        hits = position // BS * BS  # the blocks before the changed token's
        assert cc.load(slots, token_ids=changed, mask=[1] * 12) == CcResult(hits, 12), position


def test_lists_arrays_and_tensors_of_any_integer_dtype_meet(registered):
    """The keys depend on the token values only: a list, a numpy array and tensors of several integer dtypes (and a
    mask of bools or ints, as a list, array or tensor) all name the same blocks."""
    cc, cache = registered
    original = snapshot(cache)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    slots = _paged_slots([4, 7], 8)
    assert cc.save(torch.tensor(slots), token_ids=tokens, mask=np.ones(8, dtype=np.int64)) == CcResult(8, 8)
    forms = [
        (np.array(tokens, dtype=np.int32), [True] * 8),
        (torch.tensor(tokens, dtype=torch.int16), torch.ones(8, dtype=torch.bool)),
        (torch.tensor(tokens, dtype=torch.int64), torch.ones(8, dtype=torch.int32)),
        (tuple(tokens), (1,) * 8),
        (torch.tensor(tokens, dtype=torch.uint8), np.ones(8, dtype=bool)),
    ]
    for token_ids, mask in forms:
        poisoned = poison(cache)
        assert cc.load(slots, token_ids=token_ids, mask=mask) == CcResult(8, 8), type(token_ids)
        assert_cache_equals(cache, expected_after_load(original, poisoned, slots))


def test_positional_none_hashes_and_offsets(registered):
    """The SDK's method definition `save(slot_mapping, hashes, offsets, option, **kwargs)`: an engine may pass the
    token form with hashes and offsets as positional Nones and the option fourth."""
    cc, _ = registered
    assert cc.save([0, 1, 2, 3], None, None, OPTION, token_ids=[1, 2, 3, 4], mask=[0, 1, 1, 1]) == CcResult(3, 3)
    assert cc.load([4, 5, 6, 7], None, None, OPTION, token_ids=[1, 2, 3, 4], mask=[0, 1, 1, 1]) == CcResult(3, 3)


def test_layer_groups_of_different_block_sizes_use_the_smallest(cc):
    """With layer groups of store block sizes 4 and 8 the token form cuts blocks of 4 (the most tokens the hash
    form's offsets allow)."""
    cache = [make_cache(layers=1, blocks=4, block_size=4)[0], make_cache(layers=1, blocks=2, block_size=8)[0]]
    cc.register_kvcache(cache, [StoreLayerGroupDesc(4, [0]), StoreLayerGroupDesc(8, [1])])
    original = snapshot(cache)
    tokens = list(range(10))
    assert cc.save(list(range(10)), token_ids=tokens, mask=[1] * 10) == CcResult(10, 10)
    poisoned = poison(cache)
    assert cc.load(list(range(10)), token_ids=tokens, mask=[0] * 5 + [1] * 5) == CcResult(5, 5)
    assert_cache_equals(cache, expected_after_load(original, poisoned, list(range(5, 10))))
    assert cc.load(list(range(8)), token_ids=tokens[:8], mask=[1] * 8) == CcResult(8, 8)  # blocks of 4 each


# ---------------------------------------------------------------- mixed use, namespaces


@on_both_pools
def test_the_token_and_hash_forms_never_read_each_other(registered):
    """Blocks the token form saved are not found by the hash forms, even under the very hashes the token form
    derived, and the reverse: neither form can read bytes the other wrote (they do not meet, even for the same
    tokens)."""
    cc, cache = registered
    tokens = list(range(300, 308))
    slots = _paged_slots([0, 1], 8)
    derived = _digest_ints(tokens)
    assert cc.save(slots, token_ids=tokens, mask=[1] * 8) == CcResult(8, 8)
    before = snapshot(cache)
    assert cc.load(slots, derived, [BS, BS]) == CcResult(0, 2)
    assert cc.load(hashes=derived, chunk_descs=[[(0, BS), (BS, BS)]]) == CcResult(0, 2)
    assert cc.exists(derived) == CcResult(0, 2)
    assert_cache_equals(cache, before)
    # the reverse: the hash form stores under the derived hashes; the token form does not find them
    other = list(range(400, 408))
    assert cc.save(slots, _digest_ints(other), [BS, BS]) == CcResult(2, 2)
    assert cc.load(slots, token_ids=other, mask=[1] * 8) == CcResult(0, 8)
    assert_cache_equals(cache, before)


def test_another_model_or_tenant_does_not_find_the_tokens():
    """The derived keys live in the caller's namespace: over one shared store, clients of another model or another
    tenant miss the same tokens, and one of the same model and tenant (another process's client) finds them."""
    from ems.store.kv_store import KvStore
    from ems.transport.inprocess import InProcessNode

    node = InProcessNode(KvStore(16 << 20))
    tokens, slots = list(range(8)), list(range(8))
    clients = {
        name: direct_cc([node], model_id=model, tenant=tenant)
        for name, model, tenant in (
            ("writer", "alpha", "t1"),
            ("twin", "alpha", "t1"),
            ("model", "beta", "t1"),
            ("tenant", "alpha", "t2"),
        )
    }
    try:
        for client in clients.values():
            client.register_kvcache(make_cache(layers=1, blocks=2, block_size=BS))
        assert clients["writer"].save(slots, token_ids=tokens, mask=[1] * 8) == CcResult(8, 8)
        assert clients["twin"].load(slots, token_ids=tokens, mask=[1] * 8) == CcResult(8, 8)
        assert clients["model"].load(slots, token_ids=tokens, mask=[1] * 8) == CcResult(0, 8)
        assert clients["tenant"].load(slots, token_ids=tokens, mask=[1] * 8) == CcResult(0, 8)
    finally:
        for client in clients.values():
            client.close()


# ---------------------------------------------------------------- bad input writes nothing

TOKEN_CASES = [
    ("missing_mask", ([0, 1],), {"token_ids": [1, 2]}, ["mask"]),
    ("missing_tokens", ([0, 1],), {"mask": [1, 1]}, ["token_ids"]),
    ("missing_slots", (), {"token_ids": [1, 2], "mask": [1, 1]}, ["slot_mapping"]),
    ("mask_none", ([0, 1],), {"token_ids": [1, 2], "mask": None}, ["mask"]),
    ("with_hashes", ([0, 1], [7]), {"token_ids": [1, 2], "mask": [1, 1]}, ["hashes", "not both"]),
    ("with_offsets", ([0, 1],), {"offsets": [2], "token_ids": [1, 2], "mask": [1, 1]}, ["offsets"]),
    (
        "with_chunks",
        (),
        {"chunk_descs": [[(0, 2)]], "slot_mapping": [0, 1], "token_ids": [1, 2], "mask": [1, 1]},
        ["chunk_descs"],
    ),
    ("with_v0", (CcKvOption(), [], []), {"token_ids": [1], "mask": [1]}, ["V0"]),
    ("empty", ([],), {"token_ids": [], "mask": []}, ["slot_mapping"]),
    ("short_tokens", ([0, 1, 2],), {"token_ids": [1, 2], "mask": [1, 1, 1]}, ["len(token_ids)", "len(slot_mapping)"]),
    ("long_mask", ([0, 1],), {"token_ids": [1, 2], "mask": [1, 1, 1]}, ["len(mask)"]),
    ("mask_two", ([0, 1, 2],), {"token_ids": [1, 2, 3], "mask": [0, 1, 2]}, ["mask[2]", "0 or 1"]),
    ("mask_negative", ([0, 1],), {"token_ids": [1, 2], "mask": torch.tensor([-1, 1])}, ["mask[0]"]),
    ("mask_not_prefix", ([0, 1, 2, 3],), {"token_ids": [1, 2, 3, 4], "mask": [0, 1, 0, 1]}, ["mask[2]", "0…0 1…1"]),
    ("mask_ones_then_zeros", ([0, 1, 2],), {"token_ids": [1, 2, 3], "mask": [True, False, False]}, ["mask[1]"]),
    ("mask_float", ([0, 1],), {"token_ids": [1, 2], "mask": [0, 1.0]}, ["mask[1]"]),
    ("mask_float_tensor", ([0, 1],), {"token_ids": [1, 2], "mask": torch.ones(2)}, ["mask"]),
    ("mask_string", ([0, 1],), {"token_ids": [1, 2], "mask": "01"}, ["mask"]),
    ("mask_nested", ([0, 1],), {"token_ids": [1, 2], "mask": [[0, 1]]}, ["mask"]),
    ("mask_huge", ([0, 1],), {"token_ids": [1, 2], "mask": [0, 2**70]}, ["mask[1]"]),
    ("token_float", ([0, 1],), {"token_ids": [1, 2.5], "mask": [1, 1]}, ["token_ids[1]"]),
    ("token_bool", ([0, 1],), {"token_ids": [1, True], "mask": [1, 1]}, ["token_ids[1]"]),
    ("token_float_tensor", ([0, 1],), {"token_ids": torch.ones(2), "mask": [1, 1]}, ["token_ids"]),
    ("token_huge", ([0, 1],), {"token_ids": [1, 2**64], "mask": [1, 1]}, ["token_ids[1]"]),
    ("token_nested", ([0, 1],), {"token_ids": [[1, 2]], "mask": [1, 1]}, ["token_ids"]),
    ("slot_outside", ([0, 32],), {"token_ids": [1, 2], "mask": [1, 1]}, ["slot_mapping[1]", "32"]),
    ("masked_slot_outside", ([-1, 1],), {"token_ids": [1, 2], "mask": [0, 1]}, ["slot_mapping[0]"]),
    ("slot_float", ([0, 1.5],), {"token_ids": [1, 2], "mask": [1, 1]}, ["slot_mapping[1]"]),
    ("bad_option", ([0, 1],), {"token_ids": [1, 2], "mask": [1, 1], "option": 5000}, ["option"]),
    ("unknown_kwarg", ([0, 1],), {"token_ids": [1, 2], "mask": [1, 1], "masks": [1, 1]}, ["masks"]),
]

METHODS = ["save", "load", "async_save", "async_load"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("args,kwargs,needles", [c[1:] for c in TOKEN_CASES], ids=[c[0] for c in TOKEN_CASES])
def test_bad_token_arguments_write_nothing(registered, method, args, kwargs, needles):
    cc, cache = registered
    assert cc.save(list(range(8)), token_ids=[1, 2, 3, 4, 5, 6, 7, 8], mask=[1] * 8) == CcResult(8, 8)  # something to find
    store = store_of_ems()
    stats, before = store.stats(), snapshot(cache)
    with pytest.raises(EmsException) as info:
        getattr(cc, method)(*args, **kwargs)
    assert info.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    for needle in needles:
        assert needle in info.value.message(), (needle, info.value.message())
    after = store.stats()
    assert (after.entries, after.puts, after.hits) == (stats.entries, stats.puts, stats.hits)
    assert_cache_equals(cache, before)


@pytest.mark.parametrize("method", ["load", "async_load"])
def test_a_load_writes_no_slot_twice_but_the_masked_prefix_may_repeat(registered, method):
    cc, cache = registered
    tokens = [9, 8, 7, 6, 5, 4]
    assert cc.save([0, 1, 2, 3, 4, 5], token_ids=tokens, mask=[1] * 6) == CcResult(6, 6)
    before = snapshot(cache)
    with pytest.raises(EmsException) as info:
        getattr(cc, method)([8, 9, 10, 11, 12, 11], token_ids=tokens, mask=[0, 0, 1, 1, 1, 1])
    assert "slot_mapping" in info.value.message() and "index 5 repeats index 3" in info.value.message()
    assert_cache_equals(cache, before)
    # a repeat among the masked tokens is never written: allowed
    result = getattr(cc, method)([8, 8, 10, 11, 12, 13], token_ids=tokens, mask=[0, 0, 1, 1, 1, 1])
    assert (cc.get_result(result) if method == "async_load" else result) == CcResult(4, 4)


def test_token_form_before_register(cc):
    for method in METHODS:
        with pytest.raises(EmsException, match="register_kvcache"):
            getattr(cc, method)([0, 1], token_ids=[1, 2], mask=[1, 1])
    assert store_of_ems().stats().entries == 0


def test_exists_has_no_token_form(registered):
    cc, _ = registered
    with pytest.raises(EmsException, match="token_ids"):
        cc.exists([1], token_ids=[1], mask=[1])


# ---------------------------------------------------------------- properties over random caches and calls

PROPERTY_SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def token_calls(draw):
    block_size = draw(st.integers(1, 6))
    blocks = draw(st.integers(2, 8))
    n = draw(st.integers(1, blocks * block_size))
    # the engine's tokens at distinct slots, in any order (a load writes each slot once)
    slots = draw(st.permutations(list(range(blocks * block_size))))[:n]
    tokens = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n))
    return dict(
        shape=dict(
            layers=draw(st.integers(1, 2)),
            blocks=blocks,
            block_size=block_size,
            heads=draw(st.integers(1, 2)),
            head_size=draw(st.integers(1, 9)),
            dtype=draw(st.sampled_from(DTYPES)),
            interleaved=draw(st.booleans()),
        ),
        slots=slots,
        tokens=tokens,
        saved=draw(st.integers(0, n)),  # the save's masked prefix
        loaded=draw(st.integers(0, n)),  # the load's
        load_n=draw(st.integers(1, n)),  # the load asks for the first load_n tokens
        form=draw(st.sampled_from(["list", "tensor", "numpy"])),
        use_async=draw(st.booleans()),
    )


def _as_form(values: list[int], form: str):
    if form == "tensor":
        return torch.tensor(values, dtype=torch.int64)
    if form == "numpy":
        return np.array(values, dtype=np.int64)
    return list(values)


@PROPERTY_SETTINGS
@given(call=token_calls())
def test_save_poison_load_by_tokens(call):
    """Save by tokens with one mask, poison, load a prefix of the sequence with another mask: the result is the
    model's (blocks found consecutively from the load's first block, counted in tokens) and the cache holds the
    saved rows at exactly the loaded tokens' slots, the poison everywhere else."""
    Ems.shutdown()
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="tokens-prop"), pool_capacity="32MiB"))
    cc = Ems.get_cc()
    cache = make_cache(**call["shape"])
    cc.register_kvcache(cache)
    bs, n, slots, tokens = call["shape"]["block_size"], len(call["slots"]), call["slots"], call["tokens"]
    saved, loaded, load_n, form = call["saved"], min(call["loaded"], call["load_n"]), call["load_n"], call["form"]
    run = (lambda f: cc.get_result(f)) if call["use_async"] else (lambda r: r)
    save = cc.async_save if call["use_async"] else cc.save
    load = cc.async_load if call["use_async"] else cc.load
    original = snapshot(cache)
    mask = _as_form(_mask(n, saved), form)
    assert run(save(_as_form(slots, form), token_ids=_as_form(tokens, form), mask=mask)) == CcResult(n - saved, n - saved)
    poisoned = poison(cache)
    # the model: block j (tokens [j*bs, min((j+1)*bs, n))) is stored iff the save moved it (the save asked for a
    # token and j >= saved // bs) with the same tokens, i.e. the load's block has the saved block's end (a shorter
    # last block is another value)
    stored = {(j, min((j + 1) * bs, n)) for j in range(saved // bs, -(-n // bs))} if saved < n else set()
    first = loaded // bs
    found = first
    while found < -(-load_n // bs) and (found, min((found + 1) * bs, load_n)) in stored:
        found += 1
    success = min(load_n, found * bs) - loaded if found > first else 0
    result = run(load(_as_form(slots[:load_n], form), token_ids=_as_form(tokens[:load_n], form), mask=_mask(load_n, loaded)))
    assert result == CcResult(success, load_n - loaded)
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots[loaded : loaded + success]))
    Ems.shutdown()


def test_digests_do_not_depend_on_the_process(tmp_path):
    """The same tokens give the same keys in a process with another hash seed and without the compiled host copy
    (the Python path): keys are never Python's hash()."""
    import subprocess
    import sys

    tokens = list(range(-5, 40, 3))
    code = (
        "import json, numpy as np\n"
        "from ems.datapath.tokens import chain_digests\n"
        f"print(chain_digests(np.array({tokens}), 4).tobytes().hex())\n"
    )
    here = chain_digests(np.array(tokens), 4).tobytes().hex()
    for env in ({"PYTHONHASHSEED": "1"}, {"PYTHONHASHSEED": "2", "EMS_HOST_COPY": "off"}):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env={**_env(), **env}
        )
        assert out.stdout.strip() == here


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("EMS_")}


@pytest.mark.parametrize("backend", ["host", "torch", "memcpy"])
@pytest.mark.parametrize("path", ["embedded", "pipelined"])
def test_every_copy_backend_and_path_writes_only_the_mask_ones(clean_ems, fault_node_factory, backend, path):
    """A load whose mask starts inside a block writes part of that block's value: on each copy backend, on the
    embedded one-pass path and on the pipelined one (a node, chunks of one value), with K and V interleaved per
    block (strided views)."""
    from ems_testlib import set_chunk_bytes

    from ems.records import JobKind

    if path == "embedded":
        Ems.init(
            EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m"), pool_capacity="16MiB", kernel_backend=backend)
        )
        cc = Ems.get_cc()
    else:
        cc = direct_cc([fault_node_factory()], kernel_backend=backend)  # a node of its own: the pipelined path
        set_chunk_bytes(cc, "1KiB")
    try:
        cache = make_cache(layers=2, blocks=6, block_size=BS, dtype=torch.bfloat16, interleaved=True)
        cc.register_kvcache(cache)
        assert cc.kernel_backend == backend
        n, tokens = 11, [17 * t for t in range(11)]
        slots = _paged_slots([5, 0, 3], n)
        original = snapshot(cache)
        assert cc.save(slots, token_ids=tokens, mask=[1] * n) == CcResult(n, n)
        for masked in (0, 2, 5, 9, 11):
            poisoned = poison(cache)
            assert cc.load(slots, token_ids=tokens, mask=_mask(n, masked)) == CcResult(n - masked, n - masked)
            assert_cache_equals(cache, expected_after_load(original, poisoned, slots[masked:]))
            record = cc.jobs.last(JobKind.LOAD)
            assert record is not None and record.path == ("none" if masked == n else {"embedded": "one-pass"}.get(path, path))
    finally:
        if path == "embedded":
            Ems.shutdown()
        else:
            cc.close()


# ---------------------------------------------------------------- any arguments: a result, or a refusal that writes nothing

_ITEMS = st.one_of(
    st.integers(-2, 40), st.integers(-(2**70), 2**70), st.booleans(), st.floats(allow_nan=True), st.none(), st.text(max_size=2)
)
_SEQUENCES = st.one_of(
    st.lists(st.integers(0, 31), min_size=1, max_size=12),  # mostly well formed
    st.lists(st.integers(0, 1), min_size=1, max_size=12).map(sorted),  # masks of the right shape
    st.lists(_ITEMS, max_size=12),
    st.lists(st.integers(0, 31), min_size=1, max_size=12).map(lambda v: torch.tensor(v, dtype=torch.int32)),
    st.lists(st.floats(0, 2), min_size=1, max_size=4).map(torch.tensor),
    st.lists(st.integers(0, 1), min_size=1, max_size=12).map(lambda v: np.array(sorted(v), dtype=np.uint8)),
    _ITEMS,
)


@st.composite
def token_arguments(draw):
    """A well-formed (slot_mapping, token_ids, mask) of one length, then (mostly) one or two of them replaced by
    anything: wrong lengths, types, values, shapes."""
    n = draw(st.integers(1, 12))
    args = {
        "slot_mapping": draw(st.lists(st.integers(0, 31), min_size=n, max_size=n, unique=True)),
        "token_ids": draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n)),
        "mask": _mask(n, draw(st.integers(0, n))),
    }
    for name in draw(st.lists(st.sampled_from(sorted(args)), max_size=2, unique=True)):
        args[name] = draw(_SEQUENCES)
    return args


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    method=st.sampled_from(METHODS),
    args=token_arguments(),
    extra=st.dictionaries(st.sampled_from(["hashes", "offsets", "chunk_descs", "option", "key_list"]), _ITEMS, max_size=1),
)
def test_any_token_call_is_a_result_or_a_refusal_that_writes_nothing(registered, method, args, extra):
    cc, cache = registered
    slot_mapping = args.pop("slot_mapping")
    store = store_of_ems()
    stats, before = store.stats(), snapshot(cache)
    try:
        result = getattr(cc, method)(slot_mapping, **args, **extra)
    except EmsException as exc:
        event("refused")
        assert exc.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT, exc
        after = store.stats()
        assert (after.entries, after.puts, after.hits) == (stats.entries, stats.puts, stats.hits)
        assert_cache_equals(cache, before)
        return
    if method.startswith("async"):
        result = cc.get_result(result)
    event("a result")
    assert 0 <= result.success <= result.total <= len(slot_mapping)

"""Property tests: over random caches and random slot mappings, save → poison → load is the identity on the named
slots and touches nothing else; a load into a prefix of the blocks loads exactly that prefix."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from ems_testlib import DTYPES, assert_cache_equals, expected_after_load, make_cache, poison, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ems import CcConfig, Ems, EmsConfig

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def requests(draw):
    block_size = draw(st.integers(1, 8))
    blocks = draw(st.integers(1, 8))
    layers = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 3))
    head_size = draw(st.integers(1, 9))
    dtype = draw(st.sampled_from(DTYPES))
    interleaved = draw(st.booleans())
    num_slots = blocks * block_size
    # unique slots, in any order, cut into blocks of 1..block_size tokens
    count = draw(st.integers(1, num_slots))
    perm = draw(st.permutations(list(range(num_slots))))
    slots = list(perm[:count])
    offsets = []
    left = count
    while left:
        n = draw(st.integers(1, min(block_size, left)))
        offsets.append(n)
        left -= n
    hashes = draw(st.lists(st.integers(-(2**63), 2**64 - 1), min_size=len(offsets), max_size=len(offsets), unique=True))
    return dict(
        shape=dict(
            layers=layers,
            blocks=blocks,
            block_size=block_size,
            heads=heads,
            head_size=head_size,
            dtype=dtype,
            interleaved=interleaved,
        ),
        slots=slots,
        offsets=offsets,
        hashes=hashes,
    )


def _fresh_cc():
    Ems.shutdown()
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="prop"), pool_capacity="32MiB"))
    return Ems.get_cc()


@SETTINGS
@given(req=requests(), use_chunks=st.booleans())
def test_save_poison_load_is_identity_on_named_slots(req, use_chunks):
    cc = _fresh_cc()
    cache = make_cache(**req["shape"])
    cc.register_kvcache(cache)
    slots, offsets, hashes = req["slots"], req["offsets"], req["hashes"]
    if use_chunks:
        # the same shape of request as runs: block i is the run starting at its first slot, clipped to the cache
        num_slots = req["shape"]["blocks"] * req["shape"]["block_size"]
        runs, slots = [], []
        taken = set()
        for i, n in enumerate(offsets):
            start = (abs(hashes[i]) * 7919) % num_slots
            n = min(n, num_slots - start)
            run = list(range(start, start + n))
            if taken.intersection(run):
                break
            taken.update(run)
            runs.append((start, n))
            slots += run
        hashes = hashes[: len(runs)]
        if not runs:
            return
        kwargs = dict(hashes=hashes, chunk_descs=[runs])
        save = lambda: cc.save(**kwargs)
        load = lambda: cc.load(**kwargs)
    else:
        save = lambda: cc.save(slots, hashes, offsets)
        load = lambda: cc.load(slots, hashes, offsets)
    original = snapshot(cache)
    assert save().success == len(hashes)
    poisoned = poison(cache)
    result = load()
    assert (result.success, result.total) == (len(hashes), len(hashes))
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots))
    Ems.shutdown()


@SETTINGS
@given(req=requests(), data=st.data())
def test_load_stops_at_the_first_unsaved_block(req, data):
    cc = _fresh_cc()
    cache = make_cache(**req["shape"])
    cc.register_kvcache(cache)
    slots, offsets, hashes = req["slots"], req["offsets"], req["hashes"]
    n = len(hashes)
    saved = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    bounds = np.concatenate([[0], np.cumsum(offsets)]).tolist()
    original = snapshot(cache)
    for i in range(n):
        if saved[i]:
            assert cc.save(slots[bounds[i] : bounds[i + 1]], [hashes[i]], [offsets[i]]).success == 1
    prefix = saved.index(False) if False in saved else n
    assert cc.exists(hashes).success == prefix
    poisoned = poison(cache)
    assert cc.load(slots, hashes, offsets).success == prefix
    assert_cache_equals(cache, expected_after_load(original, poisoned, slots[: bounds[prefix]]))
    Ems.shutdown()


@SETTINGS
@given(data=st.data())
def test_v0_ranges_roundtrip_and_nothing_else(data):
    """V0: random non-overlapping ranges of one arena, grouped into keys; load writes exactly those ranges."""
    from ems_testlib import fill_random

    from ems import CcKvOption, KvBufferWrapper, PrimaryKey

    cc = _fresh_cc()
    arena_size = 4096
    cuts = sorted(data.draw(st.sets(st.integers(1, arena_size - 1), min_size=2, max_size=24)))
    pieces = [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
    keep = data.draw(st.lists(st.booleans(), min_size=len(pieces), max_size=len(pieces)))
    ranges = [p for p, k in zip(pieces, keep) if k] or pieces[:1]
    order = data.draw(st.permutations(ranges))
    # group consecutive ranges of the shuffled order into keys of 1..3 buffers
    groups, i = [], 0
    while i < len(order):
        n = data.draw(st.integers(1, 3))
        groups.append(order[i : i + n])
        i += n
    arena = fill_random(torch.empty(arena_size, dtype=torch.int8))
    base = arena.data_ptr()
    keys = [PrimaryKey(f"d{data.draw(st.integers(0, 2))}", f"a{j}") for j in range(len(groups))]
    values = [[KvBufferWrapper(base + a, b - a) for a, b in g] for g in groups]
    original = arena.clone()
    assert cc.save(CcKvOption(), keys, values).success == len(keys)
    fill_random(arena)
    expected = arena.clone()
    for a, b in order:
        expected[a:b] = original[a:b]
    assert cc.load(CcKvOption(), keys, values).success == len(keys)
    assert torch.equal(arena, expected)
    Ems.shutdown()

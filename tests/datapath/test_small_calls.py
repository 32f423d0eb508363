"""The small call's shortcuts give exactly what the general path gives: one-run plans from the layout's cache,
slot tensors read through a view, payload sums in Python, and the store's buffers as numpy staging."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ems_testlib import make_cache
from hypothesis import given, settings
from hypothesis import strategies as st

from ems import EmsException
from ems.datapath.arguments import Operation, int_array
from ems.datapath.calls import bind_call
from ems.datapath.layout import register_layout
from ems.datapath.planning import _MAX_ONE_RUN_PLANS, BlockPlan, _shape_and_regions, plan_blocks
from ems.store.value_format import ExpectedValues, ValueKind


def _plan(layout, slots, hashes, offsets) -> BlockPlan:
    request = bind_call(Operation.SAVE, (slots, hashes, offsets), {}, layout)
    return plan_blocks(request, layout, b"ns")


def _same_plan(a: BlockPlan, b: BlockPlan) -> None:
    assert a.keys == b.keys and a.staging_bytes == b.staging_bytes
    assert np.array_equal(a.value_start, b.value_start)
    assert np.array_equal(a.expected.payload_len, b.expected.payload_len)
    assert np.array_equal(a.expected.tokens_digest, b.expected.tokens_digest)
    for ra, rb in zip(a.regions, b.regions, strict=True):
        assert ra.group is rb.group
        assert np.array_equal(ra.pieces, rb.pieces)
        assert np.array_equal(ra.piece_start, rb.piece_start)
        assert np.array_equal(ra.piece_value, rb.piece_value)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_one_run_plans_from_the_cache_equal_fresh_ones(data: st.DataObject) -> None:
    """Runs inside a block, across block edges (a store block larger than the cache's), partial and whole: the
    cached plan of a run, asked twice, equals the plan computed from scratch; other requests never hit the cache."""
    bs = data.draw(st.sampled_from([1, 2, 4]))
    blocks = 6
    layout = register_layout(make_cache(layers=2, blocks=blocks, block_size=bs))
    count = data.draw(st.integers(1, bs))
    first = data.draw(st.integers(0, blocks * bs - count))
    slots = list(range(first, first + count))
    shorter = slots[:-1] or slots  # a run from the same slot, one token shorter: a different plan
    for run, hashes in ((slots, [1]), (slots, [2]), (shorter, [3])):  # the second call hits the cache
        plan = _plan(layout, run, hashes, [len(run)])
        request = bind_call(Operation.SAVE, (run, hashes, [len(run)]), {}, layout)
        shape, regions = _shape_and_regions(request, layout)
        fresh = BlockPlan(plan.keys, plan.route_keys, plan.expected, regions, shape.value_start, shape.staging_bytes)
        _same_plan(plan, fresh)
        assert all(not r.pieces.flags.writeable for r in plan.regions)  # shared by later plans: read-only
    assert (first, count) in layout.one_run_plans
    reversed_slots = slots[::-1]
    if count > 1:  # not a run: planned from scratch, not cached
        cached = len(layout.one_run_plans)
        _plan(layout, reversed_slots, [3], [count])
        assert len(layout.one_run_plans) == cached


def test_one_run_plans_belong_to_their_layout_and_stay_bounded() -> None:
    """Two registrations of caches of one shape never share pieces (they name different planes); the cache holds
    at most _MAX_ONE_RUN_PLANS runs."""
    first, second = (register_layout(make_cache(layers=1, blocks=4, block_size=4)) for _ in range(2))
    a, b = _plan(first, [4, 5, 6, 7], [1], [4]), _plan(second, [4, 5, 6, 7], [1], [4])
    assert a.regions[0].group.planes is first.groups[0].planes
    assert b.regions[0].group.planes is second.groups[0].planes
    big = register_layout(make_cache(layers=1, blocks=_MAX_ONE_RUN_PLANS + 8, block_size=1))
    for slot in range(_MAX_ONE_RUN_PLANS + 8):
        _plan(big, [slot], [slot], [1])
    assert 0 < len(big.one_run_plans) <= _MAX_ONE_RUN_PLANS


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_int_array_reads_tensors_of_every_int_dtype_as_a_copy(dtype: torch.dtype) -> None:
    values = torch.tensor([3, 1, 0, 7, 2, 5], dtype=dtype)
    for tensor in (values, values[::2], values[1:4]):  # strided and offset views too
        array = int_array("slot_mapping", tensor)
        assert array.dtype == np.int64 and array.tolist() == tensor.tolist()
        tensor.add_(1)  # the caller reuses its tensor: the request keeps what it was given
        assert array.tolist() == (tensor - 1).tolist()
        tensor.sub_(1)


def test_int_array_refuses_tensors_by_name() -> None:
    cases = (
        (torch.zeros(2, 3, dtype=torch.int64), "flat"),
        (torch.zeros(3), "integers"),
        (torch.zeros(2, dtype=torch.bool), "integers"),
    )
    for bad, why in cases:
        with pytest.raises(EmsException, match=f"slot_mapping.*{why}|{why}.*slot_mapping"):
            int_array("slot_mapping", bad)


@pytest.mark.parametrize("n", [1, 3, 64, 65, 200])
def test_payload_bytes_sums_like_numpy(n: int) -> None:
    rng = np.random.default_rng(n)
    lengths = rng.integers(1, 1 << 40, size=n, dtype=np.int64)
    expected = ExpectedValues(ValueKind.BLOCKS_V1, 0, np.zeros(n, dtype=np.uint64), lengths)
    for a, b in ((0, None), (0, n), (1, n - 1), (n // 2, n), (0, 0)):
        assert expected.payload_bytes(a, b) == int(lengths[a:b].sum())

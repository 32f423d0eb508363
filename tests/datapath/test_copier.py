"""The two copiers (`ems.datapath.copier`): one interface, the fused and the separate implementation, chosen once.

Random requests, values damaged at random: both copiers check and scatter exactly the same prefix (nothing of the
first damaged value, nothing after it), and their gathers leave the same stored values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ems_testlib import assert_cache_equals, expected_after_load, make_cache, poison, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from ems.datapath.arguments import Operation
from ems.datapath.calls import bind_call
from ems.datapath.copier import FusedCopier, Gathered, SeparateCopier, copier_for, encode_values
from ems.datapath.jobs.transfer import ReceivedValues
from ems.datapath.layout import register_layout
from ems.datapath.planning import plan_blocks
from ems.kernels import get_backend
from ems.kernels.base import Fusion
from ems.kernels.torch_backend import TorchBackend
from ems.records import JobKind, JobRecord
from ems.store.value_format import HEADER_SIZE, PAYLOAD_HASH_ADDRESS, matches

CPU = torch.device("cpu")


def _fused() -> FusedCopier:
    copier = copier_for(get_backend(CPU), CPU)
    if not isinstance(copier, FusedCopier):
        pytest.skip("the compiled host copy is not built here")
    return copier


def test_the_copier_is_chosen_once_from_the_backend_and_the_device():
    assert isinstance(copier_for(TorchBackend(), CPU), SeparateCopier)  # no one-pass copies
    host = get_backend(CPU)
    assert isinstance(copier_for(host, torch.device("cuda")), SeparateCopier)  # values apart from the cache's memory
    fused = host.fusion is Fusion.FUSED and PAYLOAD_HASH_ADDRESS is not None
    assert isinstance(copier_for(host, CPU), FusedCopier if fused else SeparateCopier)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_both_copiers_write_the_same_verified_prefix(data):
    fused = _fused()
    separate = SeparateCopier(fused.backend)
    bs = data.draw(st.sampled_from([1, 2, 4]))
    blocks = 8
    cache = make_cache(layers=data.draw(st.integers(1, 3)), blocks=blocks, block_size=bs, interleaved=data.draw(st.booleans()))
    n = data.draw(st.integers(1, 6))
    offsets = [data.draw(st.integers(1, bs)) for _ in range(n)]
    slots = list(data.draw(st.permutations(range(blocks * bs)))[: sum(offsets)])
    if len(slots) < sum(offsets):
        return
    layout = register_layout(cache, None)
    plan = plan_blocks(bind_call(Operation.SAVE, (slots, list(range(n)), offsets), {}, layout), layout, b"ns")
    staged = []
    for copier in (separate, fused):  # the same stored values from either gather
        staging = torch.zeros(plan.staging_bytes, dtype=torch.uint8)
        gathered = copier.gather(plan, staging, 0, n)
        assert gathered is (Gathered.VALUES if copier is fused and len(layout.groups) == 1 else Gathered.PAYLOADS)
        host = memoryview(staging.numpy())
        staged.append([bytes(v[0]) for v in encode_values(plan, host, 0, n, gathered)])
    assert staged[0] == staged[1] and all(matches(v, plan.expected, i) for i, v in enumerate(staged[0]))
    # damage one value (its payload or its header) or none
    damaged = data.draw(st.one_of(st.none(), st.integers(0, n - 1)))
    flat = staging.numpy()
    if damaged is not None:
        start = int(plan.value_start[damaged])
        byte = data.draw(
            st.sampled_from([0, 8, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + int(plan.expected.payload_len[damaged]) - 1])
        )
        flat[start + byte] ^= 0x5A
    valid = n if damaged is None else damaged
    original = snapshot(cache)
    for copier in (separate, fused):
        poisoned = poison(cache)
        values = plan.value_views(memoryview(flat), 0, n)
        checked = copier.check(ReceivedValues(values, plan.expected), JobRecord(JobKind.LOAD))
        assert checked.scatter(copier, plan, staging, plan.value_start, 0) == valid
        written = slots[: sum(offsets[:valid])]
        assert_cache_equals(cache, expected_after_load(original, poisoned, written))
        for t, o in zip((t for pair in cache for t in pair), original):
            t.copy_(o)
    assert np.array_equal(flat, staging.numpy())  # a scatter never writes its source

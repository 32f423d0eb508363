"""off_step_saves: saves copied out off the caller's thread, their blocks held until the copy-out has ended, through
the real embedded pool. An engine overwrites a block only once the hold is released (a finished request's blocks
once `take_released` names it, a preempted one's once `wait_copied` returns): what the pool then serves is always
the block as it was when the save was submitted, never the bytes written after."""

from __future__ import annotations

import hashlib
import random
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ems import CcConfig, Ems, EmsConfig
from ems.integrations import kv_layouts
from ems.integrations.block_transfer import BlockMover
from ems.integrations.off_step_saves import OffStepSaves

BLOCKS = 24


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"copier-{i}".encode()).digest()


@pytest.fixture
def engine_cache():
    """A registered engine cache (two layers of BLOCKS blocks) and its mover, on the embedded pool."""
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="copier"), pool_capacity="128MiB"))
    cc = Ems.get_cc()
    gen = torch.Generator().manual_seed(3)
    layers = [torch.randn((BLOCKS, 2, 16, 64), generator=gen).to(torch.bfloat16) for _ in range(2)]
    planes = [kv_layouts.block_planes(layer, BLOCKS) for layer in layers]
    shapes = [kv_layouts.shape_of(p) for p in planes]
    cc.register_kvcache([list(p) for p in planes], kv_layouts.store_groups(shapes))
    mover = BlockMover(cc, sum(s.block_bytes for s in shapes), inflight_budget=64)
    yield layers, mover
    Ems.shutdown()


def overwrite(layers: list[torch.Tensor], block_ids: list[int], gen: torch.Generator) -> None:
    for layer in layers:
        layer[block_ids] = torch.randn(layer[block_ids].shape, generator=gen).to(layer.dtype)


def served(layers: list[torch.Tensor], mover: BlockMover, hashes: list[bytes], scratch: list[int]) -> list[list[torch.Tensor]]:
    """What the pool serves for `hashes`, loaded into the `scratch` blocks (one per hash)."""
    outcome = mover.load(scratch, hashes)
    assert outcome.loaded == len(hashes), outcome
    return [[layer[b].clone() for layer in layers] for b in scratch]


def test_a_finished_requests_blocks_are_held_until_copied_then_an_overwrite_cannot_reach_the_pool(engine_cache):
    layers, mover = engine_cache
    gen = torch.Generator().manual_seed(4)
    copier = OffStepSaves(mover)
    try:
        gate = threading.Event()  # the accelerator's "the step's kernels are done" event, held shut
        blocks, hashes = [0, 1, 2, 3], [block_hash(i) for i in range(4)]
        snapshot = [[layer[b].clone() for layer in layers] for b in blocks]
        copier.submit("r", blocks, hashes, ready=gate.wait)  # returns at once: the copy waits for the gate
        copier.release_when_copied({"r"})  # the request finished: the engine holds its blocks for us
        time.sleep(0.05)
        assert copier.copying("r") and copier.take_released() == set()  # not copied: still held
        assert not copier.wait_copied({"r"}, 0.05)
        gate.set()
        assert copier.wait_copied({"r"}, 10)
        assert copier.take_released() == {"r"} and copier.take_released() == set()  # named once
        overwrite(layers, blocks, gen)  # the engine reuses the blocks at once
        assert mover.wait(30)
        got = served(layers, mover, hashes, [20, 21, 22, 23])
        for want, have in zip(snapshot, got):
            assert all(torch.equal(w, h) for w, h in zip(want, have))
    finally:
        assert copier.close()


def test_a_copy_out_that_fails_releases_its_hold_and_counts_failed_blocks(engine_cache):
    _, mover = engine_cache
    copier = OffStepSaves(mover)
    try:

        def broken() -> None:
            raise RuntimeError("device lost")

        copier.submit("r", [0, 1], [block_hash(100), block_hash(101)], ready=broken)
        copier.release_when_copied({"r"})
        assert copier.wait_copied({"r"}, 10) and copier.take_released() == {"r"}
        assert mover.stats.totals().save_failed_blocks == 2
        with pytest.raises(ValueError):
            copier.submit("r", [0], [])
    finally:
        assert copier.close()
    with pytest.raises(RuntimeError):
        copier.submit("r", [0], [block_hash(1)])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_random_saves_finishes_and_preemptions_never_serve_a_block_written_after_its_save(engine_cache, data):
    """Random steps, as the connector drives the copier: requests save their new blocks (copy-outs delayed at
    random, so they race the caller), finish (their blocks are overwritten as soon as the copier names them) or
    are preempted (overwritten once `wait_copied` returns). Every saved hash then serves the bytes its block held
    when the save was submitted."""
    layers, mover = engine_cache
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    gen = torch.Generator().manual_seed(rng.randrange(2**16))
    copier = OffStepSaves(mover)
    free = list(range(BLOCKS - 4))  # the last 4 blocks are scratch for the final loads
    owned: dict[str, list[int]] = {}
    finished: set[str] = set()
    expected: dict[bytes, list[torch.Tensor]] = {}
    counter = 0

    def jitter() -> None:
        time.sleep(rng.choice((0.0, 0.0, 0.001, 0.004)))

    try:
        for step in range(data.draw(st.integers(4, 14))):
            action = data.draw(st.sampled_from(("save", "save", "finish", "preempt")))
            if action == "save" and free:
                rid = f"r{step}"
                n = rng.randint(1, min(3, len(free)))
                blocks = [free.pop(rng.randrange(len(free))) for _ in range(n)]
                overwrite(layers, blocks, gen)  # the step's forward wrote them
                hashes = []
                for b in blocks:
                    counter += 1
                    h = block_hash(10_000 + counter)
                    expected[h] = [layer[b].clone() for layer in layers]
                    hashes.append(h)
                copier.submit(rid, blocks, hashes, ready=jitter)
                owned[rid] = blocks
            elif action == "finish" and owned:
                rid = rng.choice(sorted(owned))
                copier.release_when_copied({rid})
                finished.add(rid)
            elif action == "preempt" and owned:
                rid = rng.choice(sorted(set(owned) - finished) or [""])
                if rid:
                    assert copier.wait_copied({rid}, 10)
                    blocks = owned.pop(rid)
                    overwrite(layers, blocks, gen)  # handed to another request at once
                    free.extend(blocks)
            for rid in copier.take_released():  # finished requests the copier is done with: blocks reused
                blocks = owned.pop(rid)
                overwrite(layers, blocks, gen)
                free.extend(blocks)
                finished.discard(rid)
        assert copier.wait_copied(set(owned), 10) and mover.wait(30)
        hashes = list(expected)
        for i in range(0, len(hashes), 4):
            chunk = hashes[i : i + 4]
            for h, have in zip(chunk, served(layers, mover, chunk, list(range(BLOCKS - 4, BLOCKS))[: len(chunk)])):
                assert all(torch.equal(w, x) for w, x in zip(expected[h], have)), h.hex()[:8]
    finally:
        assert copier.close()


def test_a_save_is_settled_once_it_has_ended_in_the_pool_stored_or_dropped(engine_cache):
    """`wait_settled` returns once the pool has the saves (stored: a load serves them at once), and a save the
    in-flight budget drops is settled too (nothing to wait for): a waiting caller is never held by it."""
    layers, mover = engine_cache
    copier = OffStepSaves(mover)
    released = threading.Event()
    hashes = [block_hash(100 + i) for i in range(3)]
    try:
        ticket = copier.submit("a", [0, 1, 2], hashes, ready=lambda: released.wait(10))
        assert not copier.settled([ticket]) and not copier.wait_settled([ticket], 0.1)  # its copy-out is held
        released.set()
        assert copier.wait_settled([ticket], 10) and copier.settled([ticket])
        served(layers, mover, hashes, [20, 21, 22])  # in the pool when it settled
        full = BlockMover(Ems.get_cc(), mover._block_bytes, inflight_budget=0)  # every save dropped
        dropping = OffStepSaves(full)
        try:
            dropped = dropping.submit("b", [3], [block_hash(200)])
            assert dropping.wait_settled([dropped], 10) and full.stats.totals().save_failed_blocks == 1
        finally:
            dropping.close()
    finally:
        copier.close()

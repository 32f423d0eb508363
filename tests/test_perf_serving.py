"""perf/bench_serving.py without servers: it imports without vLLM (this venv has none), its arguments parse (and
bad ones are refused naming the argument), a round's ratios and their spread over rounds are what the issue's
figure says, and a running request's token gaps are split by whether another request was admitted in them."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parent.parent / "perf"
sys.path.insert(0, str(PERF))

from bench_serving import Run, gaps_by_admission, parse_args, pool_blocks, round_ratios, spread, step_table  # noqa: E402


def test_the_full_run_and_the_quick_one_parse():
    full = parse_args([])
    assert full.concurrency_list == [1, 4, 16, 64] and full.rounds == 5 and full.rounds_64 == 2
    assert full.settings == ["off", "on"] and full.prompts_by_concurrency[64] == 64
    quick = parse_args(["--quick"])
    assert quick.rounds == 1 and quick.concurrency_list == [4] and quick.settings == ["off"]
    assert parse_args(["--quick", "--competitor", "on"]).settings == ["on"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--concurrency", "1,8"], "no prompt count for concurrency 8"),
        (["--concurrency", "0"], "not a positive number"),
        (["--rounds", "2", "--rounds-64", "3"], "--rounds-64"),
        (["--prompts", "1:6,4:16,16:32,64:64"], "not a multiple of --num-prefixes"),
        (["--competitor-threads", "0"], "--competitor-threads"),
    ],
)
def test_bad_arguments_are_refused_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def run(ttft: float, tpot: float, throughput: float) -> Run:
    return Run(ttft, tpot, throughput, 0.0, 8)


def test_a_round_ratio_and_the_median_over_rounds():
    ratios = round_ratios(run(120.0, 30.0, 90.0), run(100.0, 20.0, 100.0))
    assert ratios == pytest.approx({"ttft": 1.2, "tpot": 1.5, "throughput": 0.9})
    assert math.isnan(round_ratios(run(1.0, 1.0, 1.0), run(0.0, 1.0, 1.0))["ttft"])
    s = spread([1.3, 0.9, float("nan"), 1.1, 2.0])
    assert (s.median, s.low, s.high, s.rounds) == (pytest.approx(1.2), 0.9, 2.0, 4)
    assert spread([]).rounds == 0


def test_token_gaps_split_by_admissions():
    # request 0 starts at 0, first token at 1, then gaps of 1 s (tokens at 2, 3); request 1's first token at 2.5
    requests = [(0.0, 1.0, [1.0, 1.0]), (2.0, 0.5, [0.25])]
    admitted, other = gaps_by_admission(requests)
    # request 0's gap (2, 3] holds request 1's first token (2.5); its gap (1, 2] none; request 1's own first token
    # does not count for its own gap (2.5, 2.75]
    assert admitted == [1.0] and sorted(other) == [0.25, 1.0]


def test_step_table_splits_steps_by_load_starts():
    def worker(at: float, started: int, inflight: int = 0) -> dict:
        zero = dict.fromkeys(("loads_done", "load_s", "call_s", "wait_s", "in_step_loads", "in_step_load_s", "inflight"), 0)
        return {**zero, "at_s": at, "loads_started": started, "inflight": inflight}

    records = [worker(10.0, 0), worker(10.1, 1, 1), worker(10.15, 0), worker(10.2, 0), worker(50.0, 0)]
    table = step_table(records, [], [(10.0, 10.3)])
    assert table["steps"] == 4 and table["steps_with_load_start"] == 1
    assert table["step_ms_with_load_start"] == pytest.approx(100.0)
    assert table["step_ms_other"] == pytest.approx(50.0)
    assert table["step_ms_calls_in_flight"] == pytest.approx(100.0) and table["steps_with_calls_in_flight"] == 1
    assert table["step_ms_no_calls_in_flight"] == pytest.approx(50.0)
    assert table["loads_started"] == 1


def test_the_blocks_a_pooled_run_can_load():
    # 4 prefixes of 1024 tokens (32 blocks each, loaded once) and 8 prompts whose 128-token suffixes end in 4 blocks,
    # the last (it holds the prompt's last token) never claimed
    assert pool_blocks(parse_args([]), 1) == 4 * 32 + 8 * 3
    assert pool_blocks(parse_args(["--quick"]), 4) == 2 * 32 + 8 * 3


def test_the_recorded_command_drops_results_and_keeps_a_run_without_arguments():
    from bench_serving import shown_arguments

    assert shown_arguments([]) == []
    assert shown_arguments(["--results", "/tmp/r.md", "--rounds", "3"]) == ["--rounds", "3"]
    assert shown_arguments(["--rounds", "3", "--results", ""]) == ["--rounds", "3"]

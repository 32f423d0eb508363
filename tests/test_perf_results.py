"""perf/results.py, the format every benchmark's results take: figures read as ratios next to their anchors, goals
applied to the ratio (or to the value without an anchor), a round trip through the file, refusals naming the file,
and every results file in perf/results/ readable."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parent.parent / "perf"
sys.path.insert(0, str(PERF))

from results import SCHEMA, Figure, Goal, Run, load, load_all, markdown, record  # noqa: E402


def test_a_figure_is_read_as_a_ratio_to_its_anchor():
    figure = Figure("API load", 6.0, "GB/s", "raw UCXX", 4.0, Goal(">=", 0.8))
    assert figure.ratio == pytest.approx(1.5) and figure.met is True
    slow = Figure("API load", 3.0, "GB/s", "raw UCXX", 4.0, Goal(">=", 0.8))
    assert slow.ratio == pytest.approx(0.75) and slow.met is False
    alone = Figure("exists, median", 240.0, "µs", goal=Goal("<=", 250))  # no anchor: the goal is on the value
    assert alone.ratio is None and alone.met is True
    assert Figure("no goal", 1.0, "x").met is None
    with pytest.raises(ValueError, match="anchor"):
        Figure("half an anchor", 1.0, "x", anchor="copy")
    with pytest.raises(ValueError, match="op"):
        Goal("=>", 1.0)


def test_a_run_round_trips_through_its_file(tmp_path):
    run = Run(
        "pool",
        "python perf/bench_pool.py --quick",
        [
            Figure("API save", 4.2, "GB/s", "raw UCXX", 4.0, Goal(">=", 0.8), plot="perf/pool.png", note="48 x 1 MiB"),
            Figure("exists", 390.0, "µs", goal=Goal("<=", 250)),
        ],
        machine="2 cores",
    )
    path = record(run, tmp_path)
    assert path == tmp_path / "pool.json"
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["figures"][0]["ratio"] == pytest.approx(1.05)
    back = load(path)
    assert back == run
    assert [f.met for f in back.figures] == [True, False]
    assert "| API save | 4.2 GB/s | raw UCXX: 4 GB/s | 1.05x | >= 0.8 | yes |" in markdown(back)
    record(Run("pool", "again", []), tmp_path)  # the latest run replaces the previous one
    assert load(path).command == "again" and sorted(p.name for p in tmp_path.iterdir()) == ["pool.json"]


@pytest.mark.parametrize(
    "content, message",
    [("{", "not JSON"), ('{"schema": "other/1"}', "not a results file"), (json.dumps({"schema": SCHEMA}), "malformed")],
)
def test_a_file_of_another_format_is_refused_naming_it(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        load(path)
    assert str(path) in str(info.value)


def test_every_recorded_results_file_is_readable():
    for run in load_all():
        assert run.figures, run.bench
        assert all(f.unit for f in run.figures)

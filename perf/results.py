"""The benchmarks' results in one machine-readable format: what a benchmark in perf/ writes, and what the docs'
benchmarks page and the goals tables read.

Contract:
* A run of a benchmark is a `Run`: the benchmark's name, the command that ran it, when (UTC), the commit and the
  machine it ran on, and its `Figure`s. `record(run)` writes it to `perf/results/<bench>.json` (the latest run of
  each benchmark; git keeps the older ones), atomically; `load(path)` / `load_all()` read runs back and raise
  `ValueError` naming the file when one is not of this format (`SCHEMA`).
* A `Figure` is one figure as this project reads figures: a value next to the anchor it was measured beside in the
  same run (a plain copy, raw UCXX, iperf3, the prefix cache, ...), their `ratio` (value / anchor; which way is
  better is the goal's to say), the `goal` it is held to (`Goal`: an operator and a target for the ratio, or for
  the value itself when there is no anchor), whether it was `met`, the plot that shows it, and a short note (what
  ran, how many rounds). A figure measured without an anchor has `anchor` None and `ratio` None.
* The format is JSON (one object per file: `schema`, `bench`, `command`, `date`, `commit`, `machine`, `figures`),
  every field named as in these dataclasses, so any tool reads it without this module.

Why: the figures used to live only in tables appended to perf/RESULTS.md, readable by people but not by a program;
the benchmarks page and the goals tables need the current figure of each goal, with its anchor and its plot.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "ems-perf-results/1"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
_OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, "<": lambda a, b: a < b}


@dataclass(frozen=True)
class Goal:
    """What a figure is held to: `op` (one of >=, <=, >, <) and `target`, applied to the ratio when the figure has
    an anchor, else to its value."""

    op: str
    target: float

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"goal op must be one of {sorted(_OPS)}, got {self.op!r}")

    def holds(self, measured: float) -> bool:
        return bool(_OPS[self.op](measured, self.target))

    def __str__(self) -> str:
        return f"{self.op} {self.target:g}"


@dataclass(frozen=True)
class Figure:
    """One measured figure next to its anchor (see the module docstring)."""

    name: str
    value: float
    unit: str
    anchor: str | None = None  # what the value was measured next to, in the same run
    anchor_value: float | None = None
    goal: Goal | None = None
    plot: str | None = None  # a path relative to the repository root
    note: str = ""
    ratio: float | None = field(init=False, default=None)
    met: bool | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if (self.anchor is None) != (self.anchor_value is None):
            raise ValueError(f"{self.name}: anchor and anchor_value go together")
        ratio = None
        if self.anchor_value is not None and self.anchor_value != 0 and self.value == self.value:
            ratio = self.value / self.anchor_value
        object.__setattr__(self, "ratio", ratio)
        measured = ratio if self.anchor is not None else self.value
        met = None if self.goal is None or measured is None or measured != measured else self.goal.holds(measured)
        object.__setattr__(self, "met", met)


@dataclass(frozen=True)
class Run:
    """One run of one benchmark and its figures."""

    bench: str
    command: str
    figures: list[Figure]
    date: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    commit: str = field(default_factory=lambda: _commit())
    machine: str = ""


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, cwd=RESULTS_DIR.parent
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def command_line() -> str:
    """The command that runs this process, as a user would type it from the repository root."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(RESULTS_DIR.parent.parent)
    except ValueError:
        pass
    return " ".join(["python", str(script), *sys.argv[1:]])


def to_json(run: Run) -> dict[str, Any]:
    return {"schema": SCHEMA, **asdict(run)}


def from_json(data: dict[str, Any], where: str = "results") -> Run:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{where}: not a results file of schema {SCHEMA} (found {found!r})")
    try:
        figures = []
        for f in data["figures"]:
            goal = Goal(**f["goal"]) if f.get("goal") else None
            figure = Figure(
                f["name"],
                float(f["value"]),
                f["unit"],
                f.get("anchor"),
                f.get("anchor_value"),
                goal,
                f.get("plot"),
                f.get("note", ""),
            )
            figures.append(figure)
        return Run(data["bench"], data["command"], figures, data["date"], data["commit"], data.get("machine", ""))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{where}: malformed results: {error!r}") from None


def record(run: Run, directory: Path = RESULTS_DIR) -> Path:
    """Write `run` to `<directory>/<bench>.json` (replacing the benchmark's previous run) and return the path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{run.bench}.json"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{run.bench}.", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(to_json(run), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load(path: Path) -> Run:
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not JSON: {error}") from None
    return from_json(data, str(path))


def load_all(directory: Path = RESULTS_DIR) -> list[Run]:
    """Every benchmark's latest run, by benchmark name."""
    return [load(p) for p in sorted(directory.glob("*.json"))]


def markdown(run: Run) -> str:
    """The run as a table: figure, measured, anchor, ratio, goal, met."""
    lines = [
        f"`{run.command}` at {run.commit}, {run.date}" + (f"; {run.machine}" if run.machine else ""),
        "",
        "| figure | measured | next to | ratio | goal | met |",
        "|---|---|---|---|---|---|",
    ]
    for f in run.figures:
        anchor = "—" if f.anchor is None else f"{f.anchor}: {_num(f.anchor_value)} {f.unit}"
        ratio = "—" if f.ratio is None else f"{f.ratio:.2f}x"
        met = "—" if f.met is None else "yes" if f.met else "no"
        lines.append(f"| {f.name} | {_num(f.value)} {f.unit} | {anchor} | {ratio} | {f.goal or '—'} | {met} |")
    return "\n".join(lines)


def _num(x: float | None) -> str:
    if x is None or x != x:
        return "—"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"

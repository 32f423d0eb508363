"""Engine-side counters of one `ContextCaching`: calls, blocks, hits, misses, bytes, seconds and stage times.

Contract:
* Saves and loads are counted from ONE account: the `ems.records.JobLedger` that every finished job's record
  goes to (`ContextCaching.jobs`); these counters read its sums, they keep no second copy. `record_exists(hits,
  total)` once per `exists` and `record_error()` once per call that raised are counted here (they run no job).
* `snapshot()` returns a flat dict (`ContextCaching.metrics()`): for op in save/load: `{op}_calls`, `{op}_blocks`
  (requested), `{op}_blocks_ok` (saved, or loaded hits), `{op}_bytes` (moved), `{op}_seconds` (wall time of the
  calls), `{op}_gbps` (bytes / seconds / 1e9), `{op}_stage_{stage}_seconds` and `_bytes` (per stage, summed:
  plan, gather, copy, encode, send for saves; plan, receive, verify, copy, scatter for loads); plus
  `load_misses` (requested − hit), `exists_calls`, `exists_hits`, `exists_misses`, `errors` (calls that raised).
* `register()` adds a collector to `prometheus_client`'s default registry when it is installed (names
  `ems_cc_*`, a `rank` label), `unregister()` removes it; without prometheus_client both do nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from ems.records import JobKind, JobLedger


class CcMetrics:
    """See the module docstring."""

    def __init__(self, jobs: JobLedger, rank: int = 0) -> None:
        self.rank = rank
        self._jobs = jobs
        self._lock = threading.Lock()
        self._values: dict[str, float] = {"exists_calls": 0, "exists_hits": 0, "exists_misses": 0, "errors": 0}
        self._collector: Any | None = None

    def record_exists(self, hits: int, total: int) -> None:
        with self._lock:
            self._values["exists_calls"] += 1
            self._values["exists_hits"] += hits
            self._values["exists_misses"] += total - hits

    def record_error(self) -> None:
        with self._lock:
            self._values["errors"] += 1

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self._values)
        for kind in JobKind:
            op, totals = kind.value, self._jobs.totals(kind)
            out[f"{op}_calls"] = totals.jobs
            out[f"{op}_blocks"] = totals.blocks_total
            out[f"{op}_blocks_ok"] = totals.blocks_ok
            out[f"{op}_bytes"] = totals.nbytes
            out[f"{op}_seconds"] = totals.seconds
            out[f"{op}_gbps"] = totals.nbytes / totals.seconds / 1e9 if totals.seconds > 0 else 0.0
            for stage, stage_record in totals.stages.items():
                out[f"{op}_stage_{stage.value}_seconds"] = stage_record.seconds
                out[f"{op}_stage_{stage.value}_bytes"] = stage_record.nbytes
        out["load_misses"] = out["load_blocks"] - out["load_blocks_ok"]
        return out

    # ---- prometheus ----

    def register(self) -> None:
        try:
            from prometheus_client import REGISTRY
        except ImportError:
            return
        collector = _Collector(self)
        try:
            REGISTRY.register(collector)
        except ValueError:  # another ContextCaching of this rank is registered: keep its series
            return
        self._collector = collector

    def unregister(self) -> None:
        if self._collector is None:
            return
        from prometheus_client import REGISTRY

        try:
            REGISTRY.unregister(self._collector)
        except KeyError:
            pass
        self._collector = None


class _Collector:
    def __init__(self, metrics: CcMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list:
        return []  # generated on collect; no name clash checks needed beyond register's

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily

        s = self.metrics.snapshot()
        rank = str(self.metrics.rank)
        calls = CounterMetricFamily("ems_cc_calls", "Save/load/exists calls finished", labels=["rank", "op"])
        blocks = CounterMetricFamily("ems_cc_blocks", "Blocks by operation and result", labels=["rank", "op", "result"])
        nbytes = CounterMetricFamily("ems_cc_bytes", "Bytes moved to or from the pool", labels=["rank", "op"])
        seconds = CounterMetricFamily("ems_cc_seconds", "Wall time of save/load calls", labels=["rank", "op"])
        stages = CounterMetricFamily("ems_cc_stage_seconds", "Time per pipeline stage", labels=["rank", "op", "stage"])
        for op in ("save", "load"):
            calls.add_metric([rank, op], s[f"{op}_calls"])
            nbytes.add_metric([rank, op], s[f"{op}_bytes"])
            seconds.add_metric([rank, op], s[f"{op}_seconds"])
        calls.add_metric([rank, "exists"], s["exists_calls"])
        blocks.add_metric([rank, "save", "stored"], s["save_blocks_ok"])
        blocks.add_metric([rank, "save", "not_stored"], s["save_blocks"] - s["save_blocks_ok"])
        blocks.add_metric([rank, "load", "hit"], s["load_blocks_ok"])
        blocks.add_metric([rank, "load", "miss"], s["load_misses"])
        blocks.add_metric([rank, "exists", "hit"], s["exists_hits"])
        blocks.add_metric([rank, "exists", "miss"], s["exists_misses"])
        for key, value in s.items():
            if "_stage_" in key and key.endswith("_seconds"):
                op, _, rest = key.partition("_stage_")
                stages.add_metric([rank, op, rest[: -len("_seconds")]], value)
        errors = CounterMetricFamily("ems_cc_errors", "Calls that raised", labels=["rank"])
        errors.add_metric([rank], s["errors"])
        yield from (calls, blocks, nbytes, seconds, stages, errors)

"""Engine-side counters of one `ContextCaching`: calls, blocks, hits, misses, bytes, seconds and stage times.

Contract:
* `record_job(record)` is called once per finished save or load (never per block) with its `ems.job_records.JobRecord`
  (blocks, bytes, and bytes and seconds per stage); `record(op, success, total, nbytes, marks)` takes the same
  from bare stage marks; `record_exists(hits, total)` once per `exists`. Updates take one lock.
* `snapshot()` returns a flat dict (`ContextCaching.metrics()`): for op in save/load: `{op}_calls`, `{op}_blocks`
  (requested), `{op}_blocks_ok` (saved, or loaded hits), `{op}_bytes` (moved), `{op}_seconds` (wall time of the
  calls), `{op}_gbps` (bytes / seconds / 1e9), `{op}_stage_{stage}_seconds` and `_bytes` (per stage, summed:
  plan, gather, copy, encode, send for saves; plan, receive, verify, copy, scatter for loads); plus
  `load_misses` (requested − hit), `exists_calls`, `exists_hits`, `exists_misses`, `errors` (calls that raised).
* `register()` adds a collector to `prometheus_client`'s default registry when it is installed (names
  `ems_cc_*`, a `rank` label), `unregister()` removes it; without prometheus_client both do nothing.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ems.job_records import JobRecord


class CcMetrics:
    """See the module docstring."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}
        for op in ("save", "load"):
            for name in ("calls", "blocks", "blocks_ok", "bytes", "seconds"):
                self._values[f"{op}_{name}"] = 0
        for name in ("exists_calls", "exists_hits", "exists_misses", "errors"):
            self._values[name] = 0
        self._collector: Any | None = None

    def record(self, op: str, success: int, total: int, nbytes: int, marks: Sequence[tuple[str, float]]) -> None:
        v = self._values
        with self._lock:
            v[f"{op}_calls"] += 1
            v[f"{op}_blocks"] += total
            v[f"{op}_blocks_ok"] += success
            v[f"{op}_bytes"] += nbytes
            if len(marks) > 1:
                v[f"{op}_seconds"] += marks[-1][1] - marks[0][1]
            for (_, before), (stage, at) in itertools.pairwise(marks):
                key = f"{op}_stage_{stage}_seconds"
                v[key] = v.get(key, 0.0) + (at - before)

    def record_job(self, record: JobRecord) -> None:
        """Add one finished job (see `ems.jobs`): its blocks, bytes and per-stage bytes and seconds."""
        op = record.kind.value
        v = self._values
        with self._lock:
            v[f"{op}_calls"] += 1
            v[f"{op}_blocks"] += record.blocks_total
            v[f"{op}_blocks_ok"] += record.blocks_ok
            v[f"{op}_bytes"] += record.nbytes
            v[f"{op}_seconds"] += record.seconds
            for stage, stage_record in record.stages.items():
                key = f"{op}_stage_{stage.value}"
                v[f"{key}_seconds"] = v.get(f"{key}_seconds", 0.0) + stage_record.seconds
                v[f"{key}_bytes"] = v.get(f"{key}_bytes", 0) + stage_record.nbytes

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
            out = dict(self._values)
        out["load_misses"] = out["load_blocks"] - out["load_blocks_ok"]
        for op in ("save", "load"):
            seconds = out[f"{op}_seconds"]
            out[f"{op}_gbps"] = out[f"{op}_bytes"] / seconds / 1e9 if seconds > 0 else 0.0
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

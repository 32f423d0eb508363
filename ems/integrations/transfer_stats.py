"""What an engine integration counts of its transfers: `TransferStats`, and `StatsSink`, its thread-safe account.

Contract: `TransferStats` counts lookups (hit/miss blocks, skipped, breaker trips, save waits), loads and saves
(blocks, failed blocks, bytes, seconds); `summary()` is what an operator reads. `StatsSink.add(**counts)` adds to it,
`drain()` hands over and resets what was counted since the last call, `totals()` is everything ever counted.
Thread-safe. A load's or save's blocks, bytes and seconds are its call's job record (`CcFuture.job`, the
`ems.records` record that also feeds `ContextCaching.jobs` and its metrics): one account of each transfer; the
block mover (`ems.integrations.block_transfer`) adds only what never became a job and what a job did not do.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class TransferStats:
    lookup_hit_blocks: int = 0
    lookup_miss_blocks: int = 0
    lookup_skipped_blocks: int = 0  # not asked: the pool counted as down (`lookup_breaker`)
    breaker_trips: int = 0
    lookup_save_waits: int = 0  # lookups asked again: short of blocks still being saved (`save_wait_ms`)
    load_blocks: int = 0
    load_failed_blocks: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    # in-step loads that ran out of their timeout (twice `in_step_ms`): the bytes they asked for and the seconds they took
    # (the step policy's rate learns from them: `StepPolicy.record_late_load`)
    load_late_bytes: int = 0
    load_late_seconds: float = 0.0
    # in-step loads (vLLM's step mode): the bytes loaded and the seconds from their start to the last one's end, per
    # step (timed alone, before the forward: the step policy's rate, `StepPolicy.record_transfer`)
    load_in_step_bytes: int = 0
    load_in_step_seconds: float = 0.0
    save_blocks: int = 0
    save_failed_blocks: int = 0
    save_bytes: int = 0
    save_seconds: float = 0.0

    def add(self, other: TransferStats) -> TransferStats:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def is_empty(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self))

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TransferStats:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def summary(self) -> dict[str, int | float]:
        """What an operator reads: hits, misses, bytes and GB/s each way."""
        return {
            "hit_blocks": self.lookup_hit_blocks,
            "miss_blocks": self.lookup_miss_blocks,
            "hit_rate": round(self.lookup_hit_blocks / max(1, self.lookup_hit_blocks + self.lookup_miss_blocks), 4),
            "skipped_blocks": self.lookup_skipped_blocks,
            "breaker_trips": self.breaker_trips,
            "save_waits": self.lookup_save_waits,
            "loaded_blocks": self.load_blocks,
            "load_failed_blocks": self.load_failed_blocks,
            "loaded_bytes": self.load_bytes,
            "load_GBps": round(self.load_bytes / self.load_seconds / 1e9, 3) if self.load_seconds > 0 else 0.0,
            "saved_blocks": self.save_blocks,
            "save_failed_blocks": self.save_failed_blocks,
            "saved_bytes": self.save_bytes,
            "save_GBps": round(self.save_bytes / self.save_seconds / 1e9, 3) if self.save_seconds > 0 else 0.0,
        }


@dataclass
class StatsSink:
    """Thread-safe `TransferStats` accumulator (`add(**counts)`, `drain()`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    stats: TransferStats = field(default_factory=TransferStats)
    total: TransferStats = field(default_factory=TransferStats)  # everything ever counted, never reset

    def add(self, **counts: Any) -> None:
        with self.lock:
            self.stats.add(TransferStats(**counts))
            self.total.add(TransferStats(**counts))

    def drain(self) -> TransferStats:
        with self.lock:
            out, self.stats = self.stats, TransferStats()
        return out

    def totals(self) -> TransferStats:
        with self.lock:
            return TransferStats.from_dict(self.total.to_dict())

"""`Deadline`: the one way a call's time limit travels between the layers (API option, jobs, pool client, node
clients, the node's waits).

Contract:
* A `Deadline` is a point on the `time.monotonic()` clock (`at`), fixed when the request starts (`of(option)`,
  `after(seconds)`) and handed down unchanged: every layer asks it what is `left()` at the moment it waits, so the
  layers below a request never restart its clock, and the chunks of one request share it.
* `of(option)`: the option's timeout in milliseconds, clamped to `MAX_TIMEOUT_MS` (0, or anything above it: that
  maximum; `ems.types` re-exports it with the option). `left()` is never negative; `expired()` says whether it has passed.
* `within(limit)`: a `Deadline` as it is, or seconds from now: the one place a span becomes a deadline below the
  API (a node client's entry, for callers that hold seconds).
* `extended(seconds)`: the same point moved later (a fence that waits a grace past a request's deadline).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

# A leaf module (the transport imports it): nothing of ems is imported, not even for type checking.
MAX_TIMEOUT_MS = 365 * 24 * 3600 * 1000  # the longest wait a request honours: larger timeouts (and 0) mean this


class TimedOption(Protocol):
    """What a deadline reads of a request's option (`ems.types.CcKvOption` is one)."""

    @property
    def timeout(self) -> int:
        """Milliseconds for the whole request; 0: no limit (`MAX_TIMEOUT_MS`)."""
        ...


@dataclass(frozen=True)
class Deadline:
    """A monotonic point in time by which something must be done; see the module docstring."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """The deadline `seconds` from now (a negative span is now)."""
        return cls(time.monotonic() + max(0.0, seconds))

    @classmethod
    def of(cls, option: TimedOption) -> Deadline:
        """The deadline of a request with `option` that starts now."""
        return cls.after(timeout_seconds(option))

    @classmethod
    def within(cls, limit: Deadline | float) -> Deadline:
        """`limit` itself, or the deadline `limit` seconds from now (a node client's callers outside the pool
        client, tools and tests, may give seconds; the pool client always hands a `Deadline` down)."""
        return limit if isinstance(limit, Deadline) else cls.after(limit)

    def left(self) -> float:
        """Seconds until the deadline, 0 once it has passed."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def extended(self, seconds: float) -> Deadline:
        """The same deadline `seconds` later."""
        return Deadline(self.at + seconds)


def timeout_seconds(option: TimedOption) -> float:
    """The option's timeout in seconds, clamped to `MAX_TIMEOUT_MS`; 0 (no limit) is that maximum too."""
    timeout_ms = option.timeout if 0 < option.timeout < MAX_TIMEOUT_MS else MAX_TIMEOUT_MS
    return timeout_ms / 1000.0

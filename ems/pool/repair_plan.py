"""What a repair pass decides, and how fast it goes: pure functions and values for `ems.pool.repair.Repairer`.

Contract:
* `asked(ranks, me, replicas)`: for a batch of keys this node holds, the rank positions whose node it asks about
  each key: every node ranked above it and every owner (the first `replicas`), never itself.
* `copy_plan(ranks, me, replicas, held)`: a key is this node's to copy when no node ranked above it holds it (of
  several holders, the highest ranked copies it; the others see its copy and leave it), and it is then copied to
  each owner that lacks it (a node that did not answer counts as not holding).
* Bandwidth (`TokenBucket`, `burst_bytes`): copies are paced to `rate` bytes per second (a token bucket whose burst
  is 100 ms at that rate, at least 64 KiB and at most one batch; a batch larger than the burst waits for its bytes
  before it is sent).
* `RepairSettings` (the node's `--replicas`, `--repair-rate`, `--repair-interval`, checked) and `RepairProgress`
  (what repair has done, for the node's metrics and `ems-pool status`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

BATCH_BYTES = 8 << 20  # value bytes per copy request (and the most the token bucket's burst can be)


@dataclasses.dataclass(frozen=True)
class RepairSettings:
    replicas: int = 1  # the engines' pool_replicas
    rate: int = 64 << 20  # bytes of copies per second; 0: no repair
    interval_s: float = 60.0  # a pass at least this often
    settle_s: float = 0.5  # after a membership change, wait this long for more changes before a pass

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.rate < 0 or self.interval_s <= 0 or self.settle_s < 0:
            raise ValueError("the repair rate must be >= 0 and its interval > 0")


@dataclasses.dataclass
class RepairProgress:
    """What repair has done since the node started, and where the pass under way stands."""

    running: bool = False
    passes: int = 0  # passes finished
    abandoned: int = 0  # passes stopped by a membership change
    pending_keys: int = 0  # keys of the pass under way not checked yet
    checked_keys: int = 0
    copied_values: int = 0
    copied_bytes: int = 0
    failed_copies: int = 0  # values a peer refused, or that a failing peer never acknowledged
    last_pass_seconds: float = 0.0
    last_pass_copied: int = 0
    incomplete: bool = False  # the last finished pass left checks or copies undone (a peer failed): it is retried


class TokenBucket:
    """Paces `spend(n)` to `rate` bytes per second with a burst of `burst` bytes; `wait` gives up (False) as soon as
    `cancelled()` is true."""

    def __init__(self, rate: int, burst: int) -> None:
        self.rate = float(rate)
        self.burst = float(burst)
        self._tokens = float(burst)
        self._at = time.monotonic()

    def spend(self, nbytes: int, cancelled: Callable[[], bool], sleep: Callable[[float], object]) -> bool:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= nbytes
        while self._tokens < 0:
            if cancelled():
                return False
            sleep(min(0.1, -self._tokens / self.rate))
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
        return True


def burst_bytes(rate: int) -> int:
    """The repair bucket's burst at `rate` bytes per second: 100 ms of it, within [64 KiB, one batch]."""
    return min(BATCH_BYTES, max(64 << 10, rate // 10))


def copy_plan(ranks: np.ndarray, me: int, replicas: int, held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a batch of keys this node holds: `ranks` int `[keys, nodes]`, each key's nodes best first; `me` this
    node's index (-1: not a member); `held` bool `[keys, nodes]`, by rank position, whether that node holds the key
    (what the checks found; this node's own position may be either). Returns (`mine` bool `[keys]`: this node
    copies the key, `targets` bool `[keys, nodes]`: to the nodes at those rank positions)."""
    nodes = ranks.shape[1]
    col = np.arange(nodes)[None, :]
    pos = np.where((ranks == me).any(axis=1), np.argmax(ranks == me, axis=1), nodes)  # this node's rank position
    above = held & (col < pos[:, None])
    # an array, whatever `any`'s stubs say (numpy 2.2 and 2.3 type it as `np.bool | ndarray`): indexed below
    mine = ~np.asarray(above.any(axis=1), dtype=np.bool_)
    targets = mine[:, None] & (col < replicas) & ~held & (ranks != me)
    return mine, targets


def asked(ranks: np.ndarray, me: int, replicas: int) -> np.ndarray:
    """bool `[keys, nodes]`: the rank positions whose node this node asks about each key: those above its own and
    the owners, never itself."""
    nodes = ranks.shape[1]
    col = np.arange(nodes)[None, :]
    pos = np.where((ranks == me).any(axis=1), np.argmax(ranks == me, axis=1), nodes)
    mask: np.ndarray = (col < np.maximum(pos, min(replicas, nodes))[:, None]) & (ranks != me)
    return mask

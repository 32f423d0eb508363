"""Blocks on their way to the pool, which a lookup short of them waits for (the scheduler half's view).

Contract (no vLLM imports; `scheduler.EmsScheduler` owns one):
* What a producer tells the consumer through vLLM's `kv_transfer_params` (the prefill engine's response, handed to
  the decode engine's request by a proxy): `announce(blocks)` is the producer's side, the request's full prompt
  blocks in the pool or on their way there (`PARAM_BLOCKS`) and the namespace they are keyed in (`PARAM_MODEL`);
  another namespace's announcement is ignored.
* `sent(hashes)` records block hashes this engine sent to be saved now; they count as on their way for
  `save_wait_ms` (another request of this engine is saving the prefix).
* `expected(params, start, full, hashes)`: how many of a request's blocks `start..full` are on their way: what its
  `params` (`kv_transfer_params`) announced, or up to the last of them this engine sent within `save_wait_ms`
  (`hashes()`: their engine hashes, asked for only when this engine has saves on their way); 0 with
  `save_wait_ms` 0 (never waits).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import repeat
from typing import Any

from ems.integrations.vllm.context import ConnectorContext

PARAM_BLOCKS = "ems_blocks"
PARAM_MODEL = "ems_model_id"


class OnTheirWay:
    """See the module contract."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self._model_id = ctx.model_id
        self._wait_s = ctx.config.save_wait_ms / 1000
        # block hashes sent to be saved in the last `save_wait_ms` -> when (insertion order = time order)
        self._sent: dict[bytes, float] = {}

    def announce(self, blocks: int) -> dict[str, Any]:
        """A producer's `kv_transfer_params`: `blocks` full prompt blocks in the pool or on their way there."""
        return {PARAM_BLOCKS: blocks, PARAM_MODEL: self._model_id}

    def sent(self, hashes: list[bytes]) -> None:
        if self._wait_s <= 0:
            return
        for h in hashes:
            self._sent.pop(h, None)  # keep the insertion order the time order
        self._sent.update(zip(hashes, repeat(time.monotonic())))

    def expected(self, params: object, start: int, full: int, hashes: Callable[[], list[bytes]]) -> int:
        if self._wait_s <= 0 or full <= start:
            return 0
        expect = 0
        if isinstance(params, dict) and params.get(PARAM_MODEL) == self._model_id:
            announced = params.get(PARAM_BLOCKS)
            if isinstance(announced, int) and not isinstance(announced, bool):
                expect = min(announced, full) - start
        self._expire(time.monotonic())
        if self._sent:
            sent, window = self._sent, hashes()
            expect = max(expect, next((len(window) - i for i, h in enumerate(reversed(window)) if h in sent), 0))
        return max(0, expect)

    def _expire(self, now: float) -> None:
        sent, oldest = self._sent, now - self._wait_s
        while sent:
            first = next(iter(sent))
            if sent[first] > oldest:
                return
            del sent[first]

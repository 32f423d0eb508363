"""Saves whose copy-out runs off the engine's step, and the hold on their blocks until it has finished.

Contract (no engine imports):
* `OffStepSaves(mover).submit(req_id, block_ids, hashes, epoch, ready=None, copied=None)` queues one save and returns
  at once, with the save's ticket (`copied()` is called once its copy-out has ended, raised or not: the buffer it
  copied from may be reused; `chain_prefix`: the keys' placement, `block_transfer`).
  One daemon thread runs the queued saves in order: it waits for `ready()` (on an accelerator, the event recorded
  after the step's kernels: the blocks are written), then calls `BlockMover.save_async`, which returns once the
  blocks are copied out of the engine's cache (the transfer to the pool goes on in the background, and a save
  beyond the mover's in-flight budget is dropped: a later miss). So the step never copies; the engine must not
  overwrite those blocks until their copy-out is done.
* The hold: `copying(req_id)` is True while any of the request's saves is queued or copying. A finished request
  whose blocks the engine keeps for us (vLLM's delayed free) is named with `release_when_copied`; `take_released()`
  returns each such request once, when its copy-outs are all done (vLLM's `finished_sending`); `wait_released`
  waits a little for one (an engine step with nothing else to do).
* A save is unsettled from `submit` until it has ended in the pool (`BlockMover.save_async`'s `on_end`: the pool
  acknowledged it, or it failed, or it was never sent: dropped by the in-flight budget, or its copy-out raised).
  `wait_settled(tickets, timeout_s)` waits for those saves (False when some are still unsettled after `timeout_s`);
  `settled(tickets)` never blocks. (A producer's step waits so, `vllm.worker_saves`.)
* `wait_copied(req_ids, timeout_s)` waits until those requests' copy-outs are done: their blocks are about to be
  reused (a preemption). It returns False only when the copier is stuck past `timeout_s` (it never is on a pool that
  hangs: a copy-out does not wait for the network).
* A copy-out that raises counts as failed blocks in the mover's statistics and releases its hold like any other:
  the engine never waits forever for a save.
* `close()` lets the queue drain and stops the thread.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

from ems.integrations.block_transfer import BlockMover
from ems.integrations.engine_keys import EngineHash

logger = logging.getLogger("ems.integrations")


@dataclass(frozen=True)
class _Save:
    ticket: int
    req_id: str
    block_ids: list[int]
    hashes: list[EngineHash]
    epoch: bytes
    ready: Callable[[], None] | None
    copied: Callable[[], None] | None = None
    chain_prefix: list[EngineHash] | None = None


class OffStepSaves:
    def __init__(self, mover: BlockMover) -> None:
        self._mover = mover
        self._cond = threading.Condition()
        self._queue: collections.deque[_Save] = collections.deque()
        self._copying: collections.Counter[str] = collections.Counter()  # saves queued or copying, per request
        self._held: set[str] = set()  # finished requests whose blocks the engine holds until their copy-outs end
        self._tickets = 0  # the last ticket given
        self._unsettled: set[int] = set()  # saves submitted whose end in the pool has not been reported yet
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="ems-save-copy", daemon=True)
        self._thread.start()

    def submit(
        self,
        req_id: str,
        block_ids: Sequence[int],
        hashes: Sequence[EngineHash],
        epoch: bytes = b"",
        ready: Callable[[], None] | None = None,
        copied: Callable[[], None] | None = None,
        chain_prefix: Sequence[EngineHash] | None = None,
    ) -> int:
        """Queue one save; its ticket (`wait_settled`). `copied` is called once its copy-out has ended (or raised)."""
        if len(block_ids) != len(hashes):
            raise ValueError(f"{len(block_ids)} block ids but {len(hashes)} hashes")
        with self._cond:
            if self._closing:
                raise RuntimeError("OffStepSaves is closed")
            self._tickets += 1
            self._queue.append(
                _Save(
                    self._tickets,
                    req_id,
                    list(block_ids),
                    list(hashes),
                    epoch,
                    ready,
                    copied,
                    None if chain_prefix is None else list(chain_prefix),
                )
            )
            self._copying[req_id] += 1
            self._unsettled.add(self._tickets)
            self._cond.notify_all()
            return self._tickets

    def settled(self, tickets: Iterable[int]) -> bool:
        """Whether every one of these saves has ended in the pool (never blocks)."""
        with self._cond:
            return self._unsettled.isdisjoint(tickets)

    def wait_settled(self, tickets: Iterable[int], timeout_s: float) -> bool:
        """Wait until every one of these saves has ended in the pool (True), or `timeout_s` passed (False)."""
        wanted = set(tickets)
        with self._cond:
            return self._cond.wait_for(lambda: self._unsettled.isdisjoint(wanted), timeout_s)

    def _settle(self, ticket: int) -> None:
        with self._cond:
            self._unsettled.discard(ticket)
            self._cond.notify_all()

    def copying(self, req_id: str) -> bool:
        with self._cond:
            return self._copying[req_id] > 0

    def release_when_copied(self, req_ids: Iterable[str]) -> None:
        with self._cond:
            self._held.update(req_ids)

    def take_released(self) -> set[str]:
        """Finished requests (named by `release_when_copied`) whose copy-outs have all ended; each returned once."""
        with self._cond:
            done = {r for r in self._held if self._copying[r] == 0}
            self._held -= done
            return done

    def wait_released(self, timeout_s: float) -> None:
        """Wait (up to `timeout_s`) until a held request can be released; at once when none is held."""
        with self._cond:
            self._cond.wait_for(lambda: not self._held or any(self._copying[r] == 0 for r in self._held), timeout_s)

    def wait_copied(self, req_ids: Iterable[str], timeout_s: float) -> bool:
        wanted = set(req_ids)
        with self._cond:
            return self._cond.wait_for(lambda: all(self._copying[r] == 0 for r in wanted), timeout_s)

    def idle(self) -> bool:
        with self._cond:
            return not self._queue and not +self._copying

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                save = self._queue.popleft()
            try:
                if save.ready is not None:
                    save.ready()
                self._mover.save_async(
                    save.block_ids,
                    save.hashes,
                    save.epoch,
                    on_end=partial(self._settle, save.ticket),
                    chain_prefix=save.chain_prefix,
                )
            except Exception:  # never leave a hold behind: the engine would wait for these blocks forever
                logger.exception("copy-out of %d blocks failed (later lookups miss them)", len(save.block_ids))
                self._mover.stats.add(save_failed_blocks=len(save.block_ids))
                self._settle(save.ticket)
            finally:
                if save.copied is not None:
                    save.copied()
                with self._cond:
                    self._copying[save.req_id] -= 1
                    if self._copying[save.req_id] <= 0:
                        del self._copying[save.req_id]
                    self._cond.notify_all()

    def close(self, timeout_s: float = 30.0) -> bool:
        """Drain the queue and stop the thread; False when it did not end within `timeout_s`."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

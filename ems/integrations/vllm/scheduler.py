"""The scheduler half of `EmsConnector`: which blocks of each request come from the pool and which go to it.

Contract (no vLLM imports at run time; `connector.EmsConnector` forwards vLLM's scheduler-side calls here):
* `get_num_new_matched_tokens(request, num_computed_tokens)`: the request's full prompt blocks past vLLM's local
  prefix-cache hit, by vLLM's own `request.block_hashes` (never the block holding the last prompt token: vLLM must
  compute at least one token), are looked up in the pool off this thread (`lookups.PoolLookups`); vLLM is told None
  ("ask again next step") until the answer is in, unless the step policy (`ems.integrations.vllm.lookups.step_policy`, on
  `lookups.policy`) asks it in the step (a fast pool, measured: answered at once). A hit's load runs in the step
  (vLLM's synchronous path, `load_kv_async` False: the workers load it before the forward and the request is
  computed in this step) where the policy says it fits the step's bound, else asynchronously (the request waits
  while others run); the blocks it reports are leased for that load. `update_connector_output` hands the workers'
  load and save statistics to the policy (its measured load rate; an in-step load that ran out of its bound drops
  it at once: `StepPolicy.record_late_load`).
* `update_state_after_alloc` records the request (`RequestState`) and its load, keyed in the epoch its lookup found
  the blocks in; `build_connector_meta` sends the step's loads and the full prompt blocks the step computed
  (each block once per request, again when vLLM recomputes blocks after a failed load) to the workers, and names
  the requests with saves in flight that the step preempted. A request admitted in an epoch that is no longer the
  current one (a reset since) saves nothing more: its KV may be the old weights'.
* Roles (`ctx.role`, vLLM's `kv_role`): a producer never asks the pool (every lookup is 0 at once) and a consumer
  never sends a block to it. A lookup short of blocks still on their way to the pool waits for them, up to
  `save_wait_ms` from its first ask (`lookups.PoolLookups.match`'s `expect`): blocks a producer announced in the
  request's `kv_transfer_params`, or blocks this engine sent to be saved within the last `save_wait_ms`
  (`on_their_way.OnTheirWay`).
* A request whose next block (the first past its local hit) another request of this engine is loading
  asynchronously right now waits for that load ("ask again next step", asking the pool nothing) instead of
  loading its own copy: vLLM caches an asynchronously loaded request's blocks only once its load is reported
  finished, and until then every request sharing the prefix would look it up, allocate and load it again. A load
  stops being waited for once the workers report it finished (`update_connector_output`: loaded or failed; vLLM
  then caches what arrived before it asks about any other waiting request: requests holding blocks are drained
  first) or its request ends; a request that waits longer than `save_wait_ms` (the bound of every wait of a
  request, `lookups.PoolLookups.hold`) goes on by itself. In-step loads are never waited for: vLLM caches their
  blocks when it admits the request.
* Placement: every lookup, load and save of a model with one KV cache group names where its blocks sit in the
  request's prefix chain (`chain_prefix`: the hashes of its blocks before the first asked), so the pool places a
  prompt's blocks by placement units: a call touches a bounded number of nodes whatever the pool's size
  (docs/concepts/placement.md). A hybrid model's keys interleave its groups (not one chain): placed per key.
* `request_finished`: True (vLLM's delayed free) while the request has saves sent to the workers, whose copy-outs
  run after the step: the workers release it in `get_finished` once they have ended. An engine that saves returns
  `kv_transfer_params` naming the request's prompt blocks in the pool or on their way there (for a P/D proxy).
* The namespace record (`ContextCaching.describe_namespace`, `ems.client.namespaces`) names the epoch (a digest of
  it), at start and after each `reset_cache`.
* `reset_cache` writes a new namespace epoch (`epoch.EpochWatch`): every earlier block misses from then on; loads
  promised before it are reported failed, never loaded; False when the pool did not take it.
* Hybrid models (several KV cache groups, `ctx.hybrid`): every position's block is one value per group
  (`request_blocks.RequestBlocks`: which blocks of each group a lookup, load or save names). vLLM frees a
  sliding-window group's blocks as the window moves, possibly while their copy-out runs: the requests with such saves
  are named in the next step's `flush` (the workers wait for those copy-outs before the forward,
  `EmsWorker.handle_preemptions`).
* `steps`: the per-step record (`steps.SchedulerStep`: lookups, loads and saves sent, requests waiting for another
  request's load, the lookup batches' and the step's waits).
* KV events go to `events` (`observability.KvEventLog`): a `BlockStored` for every run of blocks sent to the pool,
  `AllBlocksCleared` on a reset.

Extending it: per-request state is `RequestState` (`requests`), what the pool answered
for a request is `lookups.LookupAnswer`, and a step's work for the workers is `metadata.EmsConnectorMetadata`.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ems.integrations.epoch import EpochRecord, EpochWatch
from ems.integrations.transfer_stats import TransferStats
from ems.integrations.vllm.context import ConnectorContext
from ems.integrations.vllm.engine_checks import GroupKind
from ems.integrations.vllm.lookups import OnTheirWay, Placement, PoolLookups
from ems.integrations.vllm.metadata import BlockTransfer, EmsConnectorMetadata
from ems.integrations.vllm.request_blocks import RequestBlocks
from ems.integrations.vllm.steps import SchedulerStep, StepLog

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("ems.integrations.vllm")


def _epoch_part(epoch: bytes) -> str:
    """The epoch as the namespace record shows it (`ContextCaching.describe_namespace`): a digest, never the key."""
    return hashlib.blake2b(epoch, digest_size=8).hexdigest()


class EventSink(Protocol):
    """Where the scheduler half reports KV events (`observability.KvEventLog`)."""

    def stored(self, hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int) -> None: ...

    def cleared(self) -> None: ...


@dataclass
class RequestState:
    request: Request
    block_ids: list[list[int]]  # per KV cache group
    next_save: int  # index of the first prompt block not yet saved (or known to be in the pool)
    epoch: bytes  # the epoch its blocks are keyed in: after a reset its KV (maybe the old weights') is never saved


class EmsScheduler:
    """See the module contract."""

    def __init__(self, ctx: ConnectorContext, events: EventSink) -> None:
        self._ctx = ctx
        self._block_size = ctx.block_size
        self._events = events
        self.epoch = EpochWatch(EpochRecord(ctx.cc, ctx.config.timeout_ms), ctx.config.epoch_refresh_s)
        ctx.cc.describe_namespace(parts={"epoch": _epoch_part(self.epoch.epoch)})  # the namespace record's epoch
        self.lookups = PoolLookups(ctx)
        self.requests: dict[str, RequestState] = {}
        self._loads: dict[str, BlockTransfer] = {}  # admitted with a hit, not sent to the workers yet
        # requests with saves sent to the workers since they were last admitted: when one finishes, vLLM keeps its
        # blocks until every worker has copied them out (`request_finished` True, the workers' finished_sending)
        self._saving: set[str] = set()
        # blocks a producer announced, and blocks this engine sent to be saved in the last `save_wait_ms`: a lookup
        # that stops short of one waits for it (`PoolLookups.match`'s `expect`)
        self.on_their_way = OnTheirWay(ctx)
        self.steps: StepLog[SchedulerStep] = StepLog()  # the per-step record
        self._waiting_lookups = 0  # requests told "ask again next step" during this step
        self._in_step: set[str] = set()  # requests whose hit the policy loads in the step, if vLLM admits them
        self._windowed = any(kind is GroupKind.SLIDING for kind in ctx.groups)
        self._window_saves: set[str] = set()  # requests that sent sliding-window blocks to be saved this step
        # requests whose asynchronous load is under way -> the hashes of the positions it loads: a request whose
        # next block is among another's waits for that load instead of loading its own copy
        self._loading: dict[str, frozenset[bytes]] = {}
        # requests whose hit the step policy put off to the next step (room held there) -> the hashes it loads, and
        # the same of the step before (they are asked again this step): requests sharing the prefix wait for them
        self._deferred: dict[str, frozenset[bytes]] = {}
        self._deferred_before: dict[str, frozenset[bytes]] = {}
        self._loads_deferred = 0  # this step's loads put off to the next step
        self._load_waits = 0  # requests told to wait for another request's load during this step
        self._blocks = RequestBlocks(ctx)  # which of a request's blocks a lookup, load or save names

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        block_size = self._block_size
        start = num_computed_tokens // block_size
        if not self._ctx.role.loads:  # a producer never loads
            self.lookups.skip(request.request_id, start)
            return 0, False
        full = min((request.num_prompt_tokens - 1) // block_size, len(request.block_hashes) // self._ctx.hash_stride)
        if (self._loading or self._deferred or self._deferred_before) and start < full:
            end = self._loaded_by_others(request, start, full)
            if end is not None and self.lookups.hold(request.request_id):
                # another request is loading this prefix (or will, in the step after: put off to it): vLLM's prefix
                # cache holds it once that load ends. What lies beyond it is asked now, so that the answer is in
                # (`lookup_cache_s`) when the request asks from there
                if end < full:
                    self.lookups.match(
                        request.request_id,
                        end,
                        full,
                        self.epoch.epoch,
                        lambda: self._blocks.lookup_hashes(request, end, full),
                        self._expected(request, end, full),
                        self._blocks.chain(request, end),
                    )
                self._waiting_lookups += 1
                self._load_waits += 1
                return None, False
        hits = self.lookups.match(
            request.request_id,
            start,
            full,
            self.epoch.epoch,
            lambda: self._blocks.lookup_hashes(request, start, full),
            self._expected(request, start, full),
            self._blocks.chain(request, start),
        )
        if hits is None:
            self._waiting_lookups += 1
            return None, False
        self._in_step.discard(request.request_id)
        if hits == 0:
            return 0, False
        rid = request.request_id
        self._deferred.pop(rid, None)
        self._deferred_before.pop(rid, None)
        # a hybrid model's loads stay asynchronous: its short load is a failed receive of the whole request, which
        # vLLM takes only from a request waiting for its KV (nor is it put off: it would only wait longer)
        decision = self.lookups.policy.decide_load(hits, self.lookups.breaker.is_open(), None if self._ctx.hybrid else rid)
        if decision.placement is Placement.NEXT_STEP:  # its answer is kept (`lookup_cache_s`): asked again next step
            self._deferred[rid] = frozenset(self._blocks.hashes(request)[start : start + hits])
            self._waiting_lookups += 1
            self._loads_deferred += 1
            return None, False
        if decision.placement is Placement.IN_STEP and not self._ctx.hybrid:
            self._in_step.add(rid)
            return hits * block_size, False  # vLLM's synchronous path: loaded before this step's forward
        return hits * block_size, True

    def _loaded_by_others(self, request: Request, start: int, full: int) -> int | None:
        """Where another request's asynchronous load under way stops loading the request's blocks from `start`
        (chained hashes: the blocks it shares with that load are a run from `start`), or None: it loads none."""
        hashes = self._blocks.hashes(request)
        rid = request.request_id
        for owners in (self._loading, self._deferred, self._deferred_before):
            for owner, loading in owners.items():
                if owner != rid and hashes[start] in loading:
                    return bisect.bisect_left(range(start, full), True, key=lambda p: hashes[p] not in loading) + start
        return None

    def update_connector_output(self, worker_stats: dict[str, Any] | None, loads_done: Iterable[str] = ()) -> None:
        """The workers' output of a step (vLLM's `KVConnectorOutput`): the requests whose asynchronous load they
        report finished (`finished_recving`, loaded or failed) are no longer waited for, and their load and save
        jobs' bytes and seconds (`kv_connector_stats`) are the policy's measured rates."""
        if self._loading:
            for rid in loads_done:
                self._loading.pop(rid, None)
        if not worker_stats:
            return
        stats = TransferStats.from_dict(worker_stats)
        self.lookups.policy.record_transfer(
            stats.load_bytes,
            stats.load_seconds,
            stats.save_bytes,
            stats.save_seconds,
            stats.load_in_step_bytes,
            stats.load_in_step_seconds,
        )
        self.lookups.policy.record_late_load(stats.load_late_bytes, stats.load_late_seconds)

    def _expected(self, request: Request, start: int, full: int) -> int:
        """How many of the request's blocks from `start` are on their way to the pool (`on_their_way`)."""
        params = getattr(request, "kv_transfer_params", None)
        return self.on_their_way.expected(params, start, full, lambda: self._blocks.hashes(request)[start:full])

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        found = self.lookups.take(rid)
        start, asked = (found.start, found.asked) if found else (request.num_computed_tokens // self._block_size, 0)
        loaded = num_external_tokens // self._block_size
        if asked:
            self._ctx.stats.add(lookup_hit_blocks=loaded, lookup_miss_blocks=asked - loaded)
        block_ids = [list(ids) for ids in blocks.get_block_ids()]
        # a load reads the epoch its lookup found (and leased) the blocks in; the request saves only while that is
        # still the epoch (a reset in between: its KV may be the old weights')
        epoch = found.epoch if found is not None and loaded > 0 else self.epoch.epoch
        in_step = rid in self._in_step
        self._in_step.discard(rid)
        if loaded > 0:
            hashes = self._blocks.hashes(request)
            self._loads[rid] = self._blocks.transfer(
                rid,
                block_ids,
                hashes[start : start + loaded],
                start,
                start + loaded,
                epoch,
                in_step=in_step,
                prefix=hashes[:start],
            )
            if not in_step:  # vLLM caches these blocks only once the load is reported finished: others wait for it
                self._loading[rid] = frozenset(hashes[start : start + loaded])
        self.requests[rid] = RequestState(request, block_ids, start + loaded, epoch)

    def _add_saves(self, meta: EmsConnectorMetadata, state: RequestState, computed_before: int, computed_after: int) -> None:
        request, block_size = state.request, self._block_size
        # fewer tokens computed than saved: a load failed and vLLM recomputes them (or a preemption): save again
        state.next_save = min(state.next_save, computed_before // block_size)
        if state.epoch != self.epoch.epoch or not self._ctx.role.saves:  # a consumer never saves; a request admitted
            return  # before a reset neither: its KV may be the old weights' KV
        upto = min(
            computed_after // block_size,
            request.num_prompt_tokens // block_size,
            len(request.block_hashes) // self._ctx.hash_stride,
            len(state.block_ids[0]),
        )
        if upto <= state.next_save:
            return
        all_hashes = self._blocks.hashes(request)
        hashes = all_hashes[state.next_save : upto]
        save = self._blocks.transfer(
            request.request_id,
            state.block_ids,
            hashes,
            state.next_save,
            upto,
            state.epoch,
            computed_before,
            prefix=all_hashes[: state.next_save],
        )
        meta.saves.append(save)
        if self._windowed:
            self._window_saves.add(request.request_id)
        self._saving.add(request.request_id)
        self.on_their_way.sent(hashes)  # a lookup that stops short of them waits for them
        self._events.stored(
            hashes,
            all_hashes[state.next_save - 1] if state.next_save > 0 else None,
            list(request.all_token_ids[state.next_save * block_size : upto * block_size]),
            block_size,
        )
        state.next_save = upto

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> EmsConnectorMetadata:
        meta = EmsConnectorMetadata()
        # the previous step's sliding-window saves: this schedule may have freed their blocks (the window moved)
        meta.flush, self._window_saves = self._window_saves, set()
        # (a request may be preempted and admitted again in one schedule, e.g. reset_running_requests: its new
        # saves are added below, after this, and the workers wait for the old ones before the forward)
        for rid in scheduler_output.preempted_req_ids or ():
            if rid in self._saving:
                meta.preempted.add(rid)
                self._saving.discard(rid)  # the workers forget it too once its copy-outs have ended
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            self._add_saves(meta, state, new.num_computed_tokens, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.requests.get(rid)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids and new_ids is not None:
                state.block_ids = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for ids, added in zip(state.block_ids, new_ids):
                    ids.extend(added)
            computed = cached.num_computed_tokens[i]
            self._add_saves(meta, state, computed, computed + scheduled.get(rid, 0))
        # in-step loads: their requests are scheduled in this step, the workers load them before the forward;
        # asynchronous loads: their requests wait (not scheduled) until the workers report them in get_finished
        meta.loads.extend(self._loads.values())
        self._loads.clear()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        record = SchedulerStep(
            scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            scheduled_reqs=len(scheduler_output.num_scheduled_tokens),
            lookups_waiting=self._waiting_lookups,
            load_waits=self._load_waits,
            loads_deferred=self._loads_deferred,
            loads_sent=len(meta.loads),
            load_blocks=sum(len(load.block_ids) for load in meta.loads),
            save_blocks=sum(len(save.block_ids) for save in meta.saves),
        )
        self._waiting_lookups = self._load_waits = self._loads_deferred = 0
        self._deferred_before, self._deferred = self._deferred, {}  # (the policy's held room turns over alike)
        # this step's lookups, one batch, off this thread; a step with nothing to run waits a little for them
        self.lookups.end_step(meta.idle, record)
        self.steps.append(record)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        state = self.requests.pop(rid, None)
        self.lookups.forget(rid)
        self._in_step.discard(rid)
        self._loading.pop(rid, None)  # an abandoned load: whoever waits for it goes on by itself
        self._deferred.pop(rid, None)
        self._deferred_before.pop(rid, None)
        self.lookups.policy.forget(rid)
        # a load not sent yet still goes to the workers: vLLM frees the blocks once they report it finished.
        # Saves copy their blocks out after the step, off it: vLLM keeps them until every worker reports the request
        # in finished_sending (each worker knows the same requests from the metadata).
        held = rid in self._saving
        self._saving.discard(rid)
        # the prompt blocks in the pool or on their way there, for a decode engine that continues the request
        # (kv_transfer_params: a P/D proxy hands them from this engine's response to the consumer's request)
        params = None
        if self._ctx.role.saves and state is not None and state.next_save > 0 and state.epoch == self.epoch.epoch:
            params = self.on_their_way.announce(state.next_save)
        return held, params

    def reset_cache(self) -> bool:
        if not self.epoch.reset():
            logger.warning("EmsConnector reset_cache: the pool did not take the new epoch; nothing was reset")
            return False
        for load in self._loads.values():  # promised in the old epoch: recomputed, not loaded
            load.cancelled = True
        self._loading.clear()  # its loads fail or load the old epoch's blocks: nobody waits for them
        self._deferred.clear()
        self._deferred_before.clear()
        self._events.cleared()
        self.lookups.clear()
        self._ctx.cc.describe_namespace(parts={"epoch": _epoch_part(self.epoch.epoch)})
        logger.info("EmsConnector reset_cache: new namespace epoch; every earlier block now misses")
        return True

    def shutdown(self) -> None:
        self.epoch.close()
        self.lookups.close()

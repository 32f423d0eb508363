"""One pool call's requests to its nodes, nodes in parallel, under one deadline: the mechanism the router's reads and
writes share (`ems.backends.node_router`, `ems.backends.reads`).

Contract (`FanOut`):
* `run(node, idx, call, per_key, deadline)` sends one node its keys (`idx`, indices into the caller's key list) in
  requests within the protocol's limits (`RequestLimits.batches` over their costs), one after the other, until the
  deadline, and returns `NodeAnswer`: the answers of a prefix of its keys (all of them unless the node failed) and
  the node's error, if any. Each node's answered requests are timed into `latency` (`NodeLatency.observe`).
* `warm` (`WarmNodes`, below), where given, is told of every node a request starts on.
* `start(...)` runs `run` on the fan-out's threads (or inline, for nodes in this process, which cannot hang) and
  returns a `NodeShare` whose `wait(timeout)` gives its answer.
* `all(node_keys, ...)` runs every node's keys at once and waits for all, up to the deadline: a node that did not
  answer in time gets an `EMS_IO_TIMEOUT` error. Calls to nodes whose transport bounds every call by its deadline
  need no watching thread when there is only one of them: it runs on the calling thread.
* `writes(node_keys, ...)`: `all` for a put, except that it does not wait for the owners that lag behind once every
  key has been answered by at least one owner: past `NodeLatency.abort_delay` it aborts their requests
  (`NodeClient.abort`) and reports them failed (`EMS_IO_TIMEOUT`, "slow"), so one slow node does not set every
  save's latency. With one node there is nothing to stop early: it is `all`.
* `abandon(call)`: abort a call's requests and wait (up to its deadline) for it to return; its answer's `quiet`
  says whether anything of it can still touch the caller's buffers (it ended by its own timeout, or not at all).

The nodes a client keeps connected (`WarmNodes`): with a large pool an engine uses few of its nodes per call, and
keeps only a bounded set of connections warm.
* `used(node)` is called for each request a call sends a node (`FanOut.start`): the node becomes
  the most recently used.
* Once more than `limit` nodes have been used, the least recently used ones that have been idle for `idle_s` are
  closed (`NodeClient.close`: their connections released; a later call reconnects by itself, `transport.ucx`), until
  `limit` remain or none is idle that long: a node with a call in flight (used within `idle_s`, longer than any
  call's timeout) is never closed under it.
* Only remote nodes count (a node in this process has no connection to keep).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from ems.backends.base import PoolOutcome
from ems.backends.latency import NodeLatency
from ems.errors import EmsErrorCode
from ems.records import Deadline
from ems.transport.base import NodeClient, NodeLocation, TransportError
from ems.transport.protocol import Costs, RequestLimits

NodeRequest = Callable[[NodeClient, np.ndarray, Deadline], list]  # one request to one node: its keys' indices
CostsOf = Callable[[np.ndarray], Costs]


@dataclasses.dataclass
class NodeAnswer:
    """One node's share of a call: the answers for a prefix of its keys, and its error (None: all answered)."""

    answers: list
    error: TransportError | None = None
    #: nothing of the call can touch the caller's buffers any more (False after its own timeout: its transfers
    #: were aborted, not awaited)
    quiet: bool = True

    def __post_init__(self) -> None:
        if self.timed_out:
            self.quiet = False

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def timed_out(self) -> bool:
        return self.error is not None and self.error.status_code() == EmsErrorCode.EMS_IO_TIMEOUT


class NodeShare:
    """One node's share of a call, running (see `FanOut.start`)."""

    def __init__(self, node: NodeClient, idx: np.ndarray, nbytes: int, future: concurrent.futures.Future | None) -> None:
        self.node = node
        self.idx = idx
        self.nbytes = nbytes  # value bytes it moves (expected; 0 for a call that ran inline)
        self.started = time.monotonic()
        self.future = future
        self.answer: NodeAnswer | None = None  # set when it ran inline, or once collected

    def done(self) -> bool:
        return self.answer is not None or (self.future is not None and self.future.done())

    def wait(self, timeout_s: float) -> NodeAnswer | None:
        """Its answer, or None when it has not answered within `timeout_s`."""
        if self.answer is not None:
            return self.answer
        if self.future is None:
            return None
        try:
            self.answer = self.future.result(timeout=max(0.0, timeout_s))
        except concurrent.futures.TimeoutError:
            return None
        except Exception as exc:  # a transport bug must not become a wrong block: fail the node's keys
            self.answer = NodeAnswer([], TransportError(EmsErrorCode.EMS_IO_ERROR, f"{self.node.address}: {exc!r}"))
        return self.answer


class FanOut:
    """Runs a call's per-node requests in parallel under one deadline; see the module docstring."""

    def __init__(
        self,
        limits: RequestLimits,
        latency: NodeLatency,
        location: NodeLocation,
        workers: Callable[[], int],
        warm: WarmNodes | None = None,
    ) -> None:
        self.limits = limits
        self.warm = warm  # told of each node a request goes to (the connections a client keeps)
        self.latency = latency
        self.inline = location is NodeLocation.IN_PROCESS  # nodes in this process: nothing can hang, no threads
        self._workers = workers
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=max(8, self._workers()), thread_name_prefix="ems-pool"
                )
            return self._executor

    def submit(self, fn: Callable[..., object], *args: object) -> concurrent.futures.Future:
        return self._pool().submit(fn, *args)

    def run(
        self, node: NodeClient, idx: np.ndarray, call: NodeRequest, per_key: Costs, deadline: Deadline, observe: bool = True
    ) -> NodeAnswer:
        """One node's keys (`per_key`: their costs) in requests within the limits, each answered one timed into
        `latency` when `observe`; see the module docstring."""
        answers: list = []
        for batch in self.limits.batches(per_key):
            if deadline.expired():
                return NodeAnswer(answers, TransportError(EmsErrorCode.EMS_IO_TIMEOUT, f"{node.address}: no answer in time"))
            started = time.monotonic()
            try:
                answers.extend(call(node, idx[batch], deadline))
            except TransportError as error:
                if observe and error.status_code() == EmsErrorCode.EMS_IO_TIMEOUT:  # (at least that long: slow)
                    self.latency.observe(node.address, int(per_key[0][batch].sum()), time.monotonic() - started)
                return NodeAnswer(answers, error)
            if observe:
                self.latency.observe(node.address, int(per_key[0][batch].sum()), time.monotonic() - started)
        return NodeAnswer(answers)

    def start(
        self,
        node: NodeClient,
        idx: np.ndarray,
        call: NodeRequest,
        costs: CostsOf,
        deadline: Deadline,
        here: bool = False,
        observe: bool = True,
    ) -> NodeShare:
        """`run` on the fan-out's threads; inline when the nodes are in this process or `here` (the caller's own
        thread: a transport that bounds its calls by the deadline itself, and no hedge to send meanwhile)."""
        per_key = costs(idx)
        if self.warm is not None:
            self.warm.used(node)
        if self.inline or here:
            pending = NodeShare(node, idx, 0, None)
            pending.answer = self.run(node, idx, call, per_key, deadline, observe and not self.inline)
            return pending
        return NodeShare(node, idx, int(per_key[0].sum()), self.submit(self.run, node, idx, call, per_key, deadline))

    def all(
        self,
        node_keys: Sequence[tuple[NodeClient, np.ndarray]],
        call: NodeRequest,
        costs: CostsOf,
        deadline: Deadline,
        outcome: PoolOutcome,
        observe: bool = True,
    ) -> list[NodeAnswer]:
        """Every node's keys at once, waiting for all up to the deadline; errors go to `outcome.errors`. `observe`:
        time the answers into `latency` (what hedging needs; a pool of one node has nothing to hedge to)."""
        here = len(node_keys) == 1 and node_keys[0][0].self_timed
        calls = [self.start(node, idx, call, costs, deadline, here, observe) for node, idx in node_keys]
        return self.collect(calls, deadline, outcome)

    def collect(self, calls: Sequence[NodeShare], deadline: Deadline, outcome: PoolOutcome) -> list[NodeAnswer]:
        """Wait for `calls` up to the deadline; a call that did not answer in time is an `EMS_IO_TIMEOUT`."""
        out = []
        for pending in calls:
            answer = pending.wait(deadline.left())
            if answer is None:  # (still running: it may touch the caller's buffers)
                answer = NodeAnswer(
                    [], TransportError(EmsErrorCode.EMS_IO_TIMEOUT, f"{pending.node.address}: no answer in time"), False
                )
            if answer.error is not None:
                outcome.errors.append(answer.error)
            out.append(answer)
        return out

    def writes(
        self,
        node_keys: Sequence[tuple[NodeClient, np.ndarray]],
        keys: int,
        call: NodeRequest,
        costs: CostsOf,
        deadline: Deadline,
        outcome: PoolOutcome,
        observe: bool = True,
    ) -> list[NodeAnswer]:
        """A put's requests (see the module docstring): `keys` is the number of keys of the call; `observe` as for
        `all`."""
        if self.inline or len(node_keys) == 1:
            return self.all(node_keys, call, costs, deadline, outcome, observe)
        calls = [self.start(node, idx, call, costs, deadline) for node, idx in node_keys]
        answered = np.zeros(keys, dtype=bool)
        give_up: float | None = None
        waiting = list(calls)
        while waiting:
            now = time.monotonic()
            limit = deadline.at if give_up is None else min(give_up, deadline.at)
            futures = [c.future for c in waiting if c.future is not None]
            concurrent.futures.wait(futures, timeout=max(0.0, limit - now), return_when=concurrent.futures.FIRST_COMPLETED)
            still = []
            for pending in waiting:
                if pending.done():
                    answer = pending.wait(0)
                    if answer is not None:
                        answered[pending.idx[: len(answer.answers)]] = True
                else:
                    still.append(pending)
            waiting = still
            now = time.monotonic()
            if give_up is None and answered.all() and waiting:
                give_up = max(c.started + self.latency.abort_delay(c.nbytes) for c in waiting)
            if waiting and (now >= deadline.at or (give_up is not None and now >= give_up)):
                break
        for pending in waiting:
            if deadline.expired():
                break
            self.abandon(pending, deadline, "slow: every value it was sent has a copy elsewhere")
        return self.collect(calls, deadline, outcome)

    def abandon(self, pending: NodeShare, deadline: Deadline, why: str) -> NodeAnswer | None:
        """Abort `pending`'s requests (the node's connection) and wait for it to return, up to the deadline; its
        answer then (an error unless it finished first), or None when it did not return in time."""
        elapsed = time.monotonic() - pending.started
        pending.node.abort()
        answer = pending.wait(deadline.left())
        if answer is not None and answer.error is not None and answer.quiet:
            answer.error = TransportError(
                EmsErrorCode.EMS_IO_TIMEOUT, f"{pending.node.address}: {why} (gave up after {elapsed * 1000:.1f} ms)"
            )
        # at least that slow: seen slow at once (reads ask it last), not after several such stops
        self.latency.stopped(pending.node.address, pending.nbytes, max(elapsed, time.monotonic() - pending.started))
        return answer

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


WARM_NODES = 64  # connections a client keeps warm
IDLE_S = 60.0  # a node unused this long may be closed (longer than a call's timeout)


class WarmNodes:
    """See the module docstring. Thread-safe."""

    def __init__(self, limit: int = WARM_NODES, idle_s: float = IDLE_S) -> None:
        if limit < 1 or idle_s < 0:
            raise ValueError(f"limit must be >= 1 and idle_s >= 0, got {limit}, {idle_s}")
        self.limit, self.idle_s = limit, idle_s
        self._used: collections.OrderedDict[int, tuple[NodeClient, float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def used(self, node: NodeClient) -> None:
        if node.location is not NodeLocation.REMOTE:
            return
        now = time.monotonic()
        to_close = []
        with self._lock:
            self._used[id(node)] = (node, now)
            self._used.move_to_end(id(node))
            while len(self._used) > self.limit:
                key, (oldest, last) = next(iter(self._used.items()))
                if now - last < self.idle_s:
                    break
                del self._used[key]
                to_close.append(oldest)
        for old in to_close:
            try:
                old.close()
            except Exception:  # closing one must not fail the call that used another
                pass

    def __len__(self) -> int:
        return len(self._used)

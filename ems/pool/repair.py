"""A pool node's repair: when membership changes, the values this node holds go to the owners that lack them.

Contract (`Repairer`, started by `ems.pool.cluster_node` on a node registered in etcd with `--repair-rate` > 0):
* Triggers. Every change of the cluster's membership (`on_members`: a node leaves, joins, or comes back as a new
  incarnation, e.g. restarted empty) starts a pass `settle_s` later; a pass also runs every `interval_s`, which
  finds what a save that reached fewer owners, or a pass cut short, left behind. A pass under way when membership
  changes stops and the next one starts on the new set.
* A pass walks the keys this node holds in DRAM (`store.keys()`, most recently used first; the disk tier's records
  are known by key hash only and are not walked), in batches, by tenant. Each key is placed as clients place it:
  its ranking over the live nodes by rendezvous hashing of its routing key and, for a key stored under a placement
  unit, of its unit (`ems.datapath.keys.route_key_of`, `unit_of`, `ems.cluster.rendezvous.ranked_owners`), its owners
  the first `replicas`. This node asks `exists` (batched, one request per node) of every node ranked above it and
  of every owner; a key is this node's to copy when no node ranked above it holds it (of several holders, the
  highest ranked copies it; the others see its copy and leave it: `ems.pool.repair_plan.asked`, `copy_plan`), and
  it is then copied to each owner that lacks it. A node that does not answer counts as not holding.
  A node that is not a member itself (deregistered, partitioned) still copies what it holds to owners lacking it.
* Copies are PUTs to the owner as the key's tenant (with the tenant's key from this node's own keys, or
  anonymously on a node without keys; the nodes of one cluster share their keys): the receiving node checks every
  value's checksum before it stores it, as for any PUT, so a damaged copy is refused, never stored. Only owners
  lacking a key get it: a copy never replaces a value. Values are read with `store.peek_many` (no LRU or hit-count
  change); a value evicted meanwhile is skipped.
* Bandwidth: copies are paced to `rate` bytes per second (`ems.pool.repair_plan.TokenBucket`), so repair takes at
  most that share of the node's link; serving is not otherwise touched (the checks are small requests).
* Failures: a peer that fails (killed during repair, timed out, not reconnected yet) fails only its own copies and
  checks in that pass, which then counts as incomplete (a value the owner refuses, damaged or too large, does not:
  sending it again would be refused again): another pass follows `RETRY_S` later (doubling at each
  incomplete pass in a row, up to `interval_s`), besides the one its leave starts. So copies a pass could not make
  to a node that is still a member are retried within seconds, not at the next interval. Nothing here can fail a
  client's request.
* Progress (`progress()`, a `RepairProgress`): for the node's metrics (`ems_pool_repair_*`) and `ems-pool status`.
  Repair is done on a node when it runs no pass (`running` False) and its last pass was complete (`incomplete`
  False): every key it held was checked against every live node it had to ask, and every copy it owed landed.
* `close()` stops the pass under way (within one request's timeout) and closes the connections to other nodes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ems.cluster.rendezvous import node_seeds, ranked_owners, route_hashes
from ems.datapath.keys import route_key_of, unit_of
from ems.pool.node_store import split_tenant
from ems.pool.repair_plan import BATCH_BYTES, RepairProgress, RepairSettings, TokenBucket, asked, burst_bytes, copy_plan
from ems.records import Deadline
from ems.transport.base import NodeClient, TransportError

log = logging.getLogger("ems.pool.repair")

BATCH_KEYS = 512  # keys checked per round of exists requests
REQUEST_TIMEOUT_S = 10.0
RETRY_S = 1.0  # after an incomplete pass, the next one this much later (doubling, up to the interval)


class _Changed(Exception):
    """Membership changed (or the repairer is closing) during a pass."""


class Repairer:
    """Background repair of one node; see the module docstring. Thread-safe."""

    def __init__(
        self,
        store: Any,
        address: str,
        settings: RepairSettings,
        connect: Callable[[str, str], NodeClient],
        tenant_keys: Mapping[str, str] | None = None,
    ) -> None:
        self.store = store
        self.address = address
        self.settings = settings
        self._connect = connect
        self._tenant_keys = dict(tenant_keys or {})
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._members: dict[str, object] = {}  # address -> incarnation
        self._generation = 0  # bumped by every membership change
        self._failed_peers = 0  # peers that failed a check or a copy in the pass under way
        self._retries = 0  # incomplete passes in a row (each waits twice as long as the one before)
        self._peers: dict[tuple[str, str], NodeClient] = {}
        self._incarnations: dict[str, object] = {}  # of the nodes the peers were made for
        self._progress = RepairProgress()
        self._refused_tenants: set[str] = set()
        self._thread: threading.Thread | None = None

    # ---- control ----

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ems-pool-repair", daemon=True)
        self._thread.start()

    def on_members(self, members: Mapping[str, object]) -> None:
        """The live set changed: address -> incarnation (anything comparable; a new one is a restarted node)."""
        with self._lock:
            if dict(members) == self._members:
                return
            self._members = dict(members)
            self._generation += 1
        log.info("repair: membership changed, %d node(s) now; a pass follows", len(members))
        self._wake.set()

    def progress(self) -> RepairProgress:
        with self._lock:
            return dataclasses.replace(self._progress)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=REQUEST_TIMEOUT_S + 5)
            self._thread = None
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            try:
                peer.close()
            except Exception:  # closing must release every peer even if one fails
                pass

    # ---- the thread ----

    def _next_wait(self) -> float:
        """Seconds until the next pass when nothing changes: the interval, or sooner after an incomplete pass."""
        if self._retries == 0:
            return self.settings.interval_s
        return min(self.settings.interval_s, RETRY_S * 2.0 ** (self._retries - 1))

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._wake.wait(self._next_wait()):
                self._wake.clear()
                # more changes may follow at once (a restart is a leave, then a join): let them settle first
                if self._stop.wait(self.settings.settle_s) or self._wake.is_set():
                    continue
            if self._stop.is_set():
                return
            with self._lock:
                members, generation = dict(self._members), self._generation
            if not members:
                continue
            self._failed_peers = 0
            try:
                self._pass(members, generation)
            except _Changed:
                with self._lock:
                    self._progress.abandoned += 1
                    self._progress.running = False
                    self._progress.pending_keys = 0
            except Exception:  # never let the repair thread die: log, and try again as after an incomplete pass
                log.exception("repair pass failed")
                self._retries += 1
                with self._lock:
                    self._progress.incomplete = True
                    self._progress.running = False
                    self._progress.pending_keys = 0

    def _check(self, generation: int) -> None:
        if self._stop.is_set() or self._generation != generation:
            raise _Changed()

    def _pass(self, members: dict[str, object], generation: int) -> None:
        started = time.monotonic()
        addresses = sorted(members)
        self._retire_peers(members)
        seeds = node_seeds(addresses)
        me = addresses.index(self.address) if self.address in members else -1
        stored = self.store.keys()[::-1]  # most recently used first
        by_tenant: dict[str, list[tuple[bytes, bytes]]] = {}
        for key in stored:
            parsed = split_tenant(key)
            if parsed is not None:
                by_tenant.setdefault(parsed[0], []).append((key, parsed[1]))
        with self._lock:
            self._progress.running = True
            self._progress.pending_keys = len(stored)
        copied_before = self._progress.copied_values
        bucket = TokenBucket(self.settings.rate, burst_bytes(self.settings.rate)) if self.settings.rate > 0 else None
        for tenant, entries in by_tenant.items():
            if self._tenant_keys and tenant not in self._tenant_keys:
                if tenant not in self._refused_tenants:
                    log.warning("repair: tenant %r holds values here but has no key in this node's keys; not copied", tenant)
                    self._refused_tenants.add(tenant)
                self._count(checked=len(entries))
                continue
            for start in range(0, len(entries), BATCH_KEYS):
                self._check(generation)
                batch = entries[start : start + BATCH_KEYS]
                self._batch(tenant, batch, addresses, seeds, me, generation, bucket)
                self._count(checked=len(batch))
        incomplete = self._failed_peers > 0
        self._retries = self._retries + 1 if incomplete else 0
        with self._lock:
            p = self._progress
            p.running = False
            p.pending_keys = 0
            p.passes += 1
            p.last_pass_seconds = time.monotonic() - started
            p.last_pass_copied = p.copied_values - copied_before
            p.incomplete = incomplete
        if self._progress.last_pass_copied or incomplete:
            log.info(
                "repair pass: %d value(s) copied in %.2f s over %d node(s)%s",
                self._progress.last_pass_copied,
                self._progress.last_pass_seconds,
                len(addresses),
                f"; incomplete (a peer failed), again in {self._next_wait():.0f} s" if incomplete else "",
            )

    def _count(self, checked: int = 0, copied: int = 0, nbytes: int = 0, failed: int = 0) -> None:
        with self._lock:
            p = self._progress
            p.checked_keys += checked
            p.pending_keys = max(0, p.pending_keys - checked)
            p.copied_values += copied
            p.copied_bytes += nbytes
            p.failed_copies += failed

    def _batch(
        self,
        tenant: str,
        batch: Sequence[tuple[bytes, bytes]],
        addresses: Sequence[str],
        seeds: np.ndarray,
        me: int,
        generation: int,
        bucket: TokenBucket | None,
    ) -> None:
        """Check one batch of keys of one tenant and copy the ones that are this node's to copy."""
        client_keys = [k for _, k in batch]
        units = np.array([unit_of(k) or 0 for k in client_keys], dtype=np.uint64)
        chained = np.fromiter((unit_of(k) is not None for k in client_keys), dtype=bool, count=len(client_keys))
        route_keys = [route_key_of(k) for k in client_keys]
        # a key with no unit is its own (the per-key ranking): its routing key's hash
        units = np.where(chained, units, route_hashes(route_keys))
        ranks = ranked_owners(route_keys, seeds, len(addresses), units)
        ask = asked(ranks, me, self.settings.replicas)
        held = ranks == me
        down = np.zeros(len(addresses), dtype=bool)
        for node in np.unique(ranks[ask]).tolist():
            rows = np.nonzero((ranks == node) & ask)[0]
            try:
                flags = self._peer(addresses[node], tenant).exists(
                    [client_keys[i] for i in rows.tolist()], Deadline.after(REQUEST_TIMEOUT_S)
                )
            except TransportError as error:  # it counts as holding nothing, gets no copies in this batch: retried
                log.info("repair: checks on %s failed: %s", addresses[node], error.message())
                down[node] = True
                self._failed_peers += 1
                continue
            hit = rows[np.asarray(flags, dtype=bool)]
            held[hit] |= ranks[hit] == node
        _, targets = copy_plan(ranks, me, self.settings.replicas, held)
        targets &= ~down[ranks]
        for node in np.unique(ranks[targets]).tolist():
            chosen = np.nonzero(((ranks == node) & targets).any(axis=1))[0].tolist()
            self._copy(tenant, addresses[node], [batch[i] for i in chosen], generation, bucket)

    def _copy(
        self,
        tenant: str,
        address: str,
        entries: Sequence[tuple[bytes, bytes]],
        generation: int,
        bucket: TokenBucket | None,
    ) -> None:
        values = self.store.peek_many([stored for stored, _ in entries])
        present = [(k, v) for (_, k), v in zip(entries, values) if v is not None]
        start = 0
        while start < len(present):
            end, nbytes = start, 0
            while end < len(present) and (end == start or nbytes + memoryview(present[end][1]).nbytes <= BATCH_BYTES):
                nbytes += memoryview(present[end][1]).nbytes
                end += 1
            self._check(generation)
            if bucket is not None and not bucket.spend(
                nbytes, lambda: self._stop.is_set() or self._generation != generation, self._stop.wait
            ):
                raise _Changed()
            part = present[start:end]
            try:
                stored = self._peer(address, tenant).put(
                    [k for k, _ in part], [[v] for _, v in part], Deadline.after(REQUEST_TIMEOUT_S)
                )
            except TransportError as error:
                log.info("repair: copies to %s failed: %s", address, error.message())
                self._failed_peers += 1
                self._count(failed=len(part))
                return  # this peer fails the rest of its copies in this pass
            ok = sum(bool(s) for s in stored)
            copied_bytes = sum(memoryview(v).nbytes for (_, v), s in zip(part, stored) if s)
            self._count(copied=ok, nbytes=copied_bytes, failed=len(part) - ok)
            start = end

    def _peer(self, address: str, tenant: str) -> NodeClient:
        key = (address, tenant)
        with self._lock:
            peer = self._peers.get(key)
        if peer is None:
            peer = self._connect(address, tenant)
            with self._lock:
                self._peers[key] = peer
        return peer

    def _retire_peers(self, members: Mapping[str, object]) -> None:
        """Close the connections to nodes that left or came back as another incarnation (a restarted node: its old
        connection is dead, and a call on it would fail and back off instead of reconnecting)."""
        with self._lock:
            gone = [k for k in self._peers if k[0] not in members or self._incarnations.get(k[0]) != members[k[0]]]
            peers = [self._peers.pop(k) for k in gone]
            self._incarnations = dict(members)
        for peer in peers:
            try:
                peer.close()
            except Exception:  # a peer that fails to close is gone anyway
                pass

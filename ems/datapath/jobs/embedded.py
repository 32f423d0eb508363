"""The embedded pool's one-pass jobs (`EmbeddedSave`, `EmbeddedLoad`): CPU tensors, and a pool whose values lie in
this process's memory, which it lends the jobs (`PoolBackend.in_place`, an `ems.backends.base.InPlaceValues`: the
embedded pool's store).

A save takes every value's buffer from the store at once (`KvStore.allocate_many`: usually back to back, the layout
a plan packs values in), gathers every value straight into those buffers with one backend call per layer group (the
buffers' own addresses as the values' places), checksums each payload and writes its header in place (the fused
copier does both in one pass: `FusedCopier.gather_at`), and hands the buffers to the store (no copy). A load takes
the stored values, checks the present prefix (`Copier.check`: header and checksum, or the headers only where the
scatter verifies the payloads) and scatters it straight from the stored bytes with one backend call per layer
group. V0 values (raw ranges) move value by value (torch has no batched copy between arbitrary addresses).

Failure semantics are `ContextCaching`'s: a job never writes a block it did not verify, nor one after the first
miss, and gives every buffer it took from the store back on every path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from ems.backends.base import InPlaceValues, PoolOutcome, ReadCheck
from ems.buffers import Buffer
from ems.datapath.copier import Gathered
from ems.datapath.jobs.transfer import JobContext, JobPath, Loaded, ReceivedValues, SaveJob, Transfer
from ems.datapath.planning import BlockPlan
from ems.kernels.host_copy import buffer_addresses, raw_tensor
from ems.records import Stage
from ems.store.kv_store import ENTRY_OVERHEAD
from ems.store.value_format import HEADER_SIZE, encode_in_place

# the embedded path views the address span of a request's buffers as one tensor: never one wider than this
# (buffers from unrelated mappings; then it moves value by value)
MAX_VALUE_SPAN = 1 << 40


def stored_array(value: Buffer) -> np.ndarray:
    """A uint8 numpy array over a stored value's bytes, for reading (a scatter never writes its source; the copy
    backends take it as it is or view it): no copy."""
    owner = value.obj if isinstance(value, memoryview) else value
    if isinstance(owner, np.ndarray) and owner.dtype == np.uint8 and owner.ndim == 1 and owner.nbytes == len(value):
        return owner
    return np.frombuffer(value, dtype=np.uint8)


def span_of(addresses: np.ndarray, lengths: np.ndarray) -> tuple[torch.Tensor, np.ndarray] | None:
    """One uint8 CPU tensor over the address span of buffers (`addresses`, `lengths`: int64 `[n]`) and each
    buffer's offset in it; None when the span is wider than `MAX_VALUE_SPAN`. The tensor aliases memory between
    the buffers too: callers only touch bytes inside the buffers (a gather writes exactly the bytes its pieces
    name, a scatter only reads)."""
    lo = int(addresses.min())
    hi = int((addresses + lengths).max())
    if hi - lo > MAX_VALUE_SPAN:
        return None
    return raw_tensor(lo, hi - lo, torch.device("cpu")), addresses - lo


@dataclass
class StoreBuffers:
    """The store's buffers for a save's leading values (`KvStore.allocate_many`), one per value, as one value:
    each buffer, the store's reservation for it and its address (columns: a call's values are handled in batches,
    never one by one). Held by one owner at a time: the save, until `hand_to` gives them to the store under their
    keys or `give_back` returns them; `take` moves them out (the holder is left empty, so each is given once)."""

    buffers: list[np.ndarray] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)  # the store's reservation for each buffer
    addresses: list[int] = field(default_factory=list)  # each buffer's address (the store's)

    @property
    def count(self) -> int:
        return len(self.buffers)

    def take(self) -> StoreBuffers:
        """These buffers, moved into a new holder (this one is left empty)."""
        taken = StoreBuffers(self.buffers, self.reserved, self.addresses)
        self.buffers, self.reserved, self.addresses = [], [], []
        return taken

    def hand_to(self, store: InPlaceValues, keys: list[bytes]) -> None:
        """Store value i's buffer under `keys[i]` (no copy): the store owns them now."""
        taken = self.take()
        store.put_owned_many(keys[: taken.count], taken.buffers, taken.reserved, taken.addresses)

    def give_back(self, store: InPlaceValues) -> None:
        """Return every buffer to the store unused (idempotent)."""
        taken = self.take()
        for buffer, reserve, address in zip(taken.buffers, taken.reserved, taken.addresses):
            store.recycle(buffer, reserve, address)


class EmbeddedSave(SaveJob):
    """The embedded pool's one-pass save (see the module docstring)."""

    def __init__(self, transfer: Transfer, store: InPlaceValues) -> None:
        self.plan, self.copier, self.record, self.store = transfer.plan, transfer.copier, transfer.record, store
        self.record.path = "one-pass"
        self._values = StoreBuffers()  # the values' buffers while this save holds them

    def _begin(self) -> None:
        plan, store, record = self.plan, self.store, self.record
        # Python ints: for the few values of a typical call they cost less than numpy's per-call overhead
        sizes = [length + HEADER_SIZE for length in plan.expected.payload_len.tolist()]
        capacity = store.capacity_bytes
        charges = [len(key) + size + ENTRY_OVERHEAD for key, size in zip(plan.keys, sizes)]
        count = next((i for i, charge in enumerate(charges) if charge > capacity), plan.total)  # too big, and after: refused
        payload = sum(sizes[:count]) - HEADER_SIZE * count
        with record.stage(Stage.GATHER, payload):
            buffers, addresses = store.allocate_many(sizes[:count], charges[:count])
            self._values = StoreBuffers(buffers, charges[:count], addresses)
            if not count:
                return
            span = None
            if isinstance(plan, BlockPlan) and count > 1:
                span = span_of(np.array(addresses, dtype=np.int64), np.array(sizes[:count], dtype=np.int64))
            gathered = Gathered.PAYLOADS
            if isinstance(plan, BlockPlan) and span is not None:
                gathered = self.copier.gather_at(plan, span[0], span[1], 0, count)  # encoded too where it can be
            else:  # one value (its own buffer), V0 raw ranges (one copy each anyway), or buffers too far apart
                for i, buffer in enumerate(buffers):
                    self.copier.gather_value(plan, i, buffer)
        if gathered is Gathered.PAYLOADS:
            with record.stage(Stage.ENCODE, payload):
                encode_in_place(buffers, plan.expected, 0, addresses)

    def finish(self) -> PoolOutcome:
        """Hand the buffers to the store (no copy): every value that fitted the pool is acknowledged."""
        plan = self.plan
        try:
            values = self._values.take()
            count = values.count
            with self.record.stage(Stage.SEND, sum(map(len, values.buffers))):
                values.hand_to(self.store, plan.keys)
            outcome = PoolOutcome([True] * count + [False] * (plan.total - count))  # after: larger than the pool
            outcome.nodes_contacted = 1
            return outcome
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Give back every buffer not handed to the store (idempotent)."""
        self._values.give_back(self.store)


class EmbeddedLoad:
    """The embedded pool's one-pass load (see the module docstring)."""

    def __init__(self, transfer: Transfer, store: InPlaceValues) -> None:
        self.plan, self.copier, self.record, self.store = transfer.plan, transfer.copier, transfer.record, store
        self.record.path = "one-pass"

    def run(self) -> Loaded:
        plan, record = self.plan, self.record
        with record.stage(Stage.RECEIVE):
            # the stored buffers themselves (read-only views), and their addresses where the store knows them
            values, addresses = self.store.get_many_with_addresses(plan.keys)
        received = ReceivedValues(values, plan.expected, ReadCheck.NONE, addresses)  # (the bytes as stored)
        outcome = PoolOutcome(values, nodes_contacted=1)
        present = received.present()
        if isinstance(plan, BlockPlan) and present > 1:
            # the copier's check: the headers only where its scatter verifies the payloads (the fused copier)
            checked = self.copier.check(received.range(0, present), record)
            span = _stored_span(received, checked.count) if checked.count > 1 else None
            if span is not None:
                with record.stage(Stage.SCATTER, plan.expected.payload_bytes(0, checked.count)):
                    return Loaded(checked.scatter(self.copier, plan, span[0], span[1], 0), outcome)
            hits = checked.confirm(received)
        else:
            with record.stage(Stage.VERIFY, plan.expected.payload_bytes(0, present)):
                hits = received.range(0, present).verified_prefix()
        if hits:  # one value, V0 raw ranges, or stored values too far apart to view as one
            with record.stage(Stage.SCATTER, plan.expected.payload_bytes(0, hits)):
                for i in range(hits):
                    self.copier.scatter_value(plan, i, stored_array(cast(Buffer, values[i])))  # i < hits: present
        return Loaded(hits, outcome)


def _stored_span(values: ReceivedValues, count: int) -> tuple[torch.Tensor, np.ndarray] | None:
    """The first `count` stored values (present) as one span and their offsets in it (`span_of`), from the
    addresses the store knows, else from the buffers themselves."""
    known = values.addresses[:count] if values.addresses is not None else [None]
    starts = np.array(known, dtype=np.int64) if None not in known else buffer_addresses(values.buffers[:count])
    return span_of(starts, values.expected.payload_len[:count] + HEADER_SIZE)


class EmbeddedPath(JobPath):
    """The one-pass jobs' path: CPU tensors and a pool that lends its values (`store`, its `in_place`)."""

    def __init__(self, store: InPlaceValues) -> None:
        self.store = store

    def _save(self, transfer: Transfer, context: JobContext) -> SaveJob:
        return EmbeddedSave(transfer, self.store)

    def _load(self, transfer: Transfer, context: JobContext) -> EmbeddedLoad:
        return EmbeddedLoad(transfer, self.store)

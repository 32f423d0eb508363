"""The copy: one worker runs a plan's moves between the engine's cache and values (`ems.datapath.planning`: the
plan is data, nothing in it executes).

Two implementations of one interface (`Copier`), chosen once per device (`copier_for`), never per call:

* `SeparateCopier`: a save gathers, then encodes (checksums and headers: `encode_values`); a load verifies every
  value it received (headers and checksums), then scatters the verified prefix. Any copy backend, any device.
* `FusedCopier`: the compiled host copy's one pass over bytes still in cache, for values in the cache's own memory
  (CPU staging, the store's buffers): a save's gather hashes and heads each value right after writing it (where one
  layer group holds the values' tokens; otherwise it gathers, and the job encodes as the separate copier's does);
  a load's receive checks only the headers (`HeadersChecked`) and the scatter hashes each value just before
  writing it; a load staged in a same-host node's region verifies and scatters each value as the node places it
  (`FusedCopier.as_placed`).

A load's received values are one value object (`ems.datapath.jobs.transfer.ReceivedValues`: bytes, expected values,
addresses, what the pool checked of them). What a load's receive checked before the scatter is a value (`Checked`):
`Verified` (the leading values are exactly the expected ones) or `HeadersChecked` (their headers are; the checksums
they state are the scatter's to check).
Either way a scatter writes nothing of the first value that fails, nor after it.

A copier writes exactly the bytes a plan names (the copy backends' rules: `ems.kernels.base`); it holds no buffer
and no lock, so it has nothing to give back on an error path.
"""

from __future__ import annotations

import abc
import enum
import functools
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ems.backends.base import ReadCheck
from ems.buffers import Buffer
from ems.datapath.devices import device_work
from ems.datapath.planning import BlockPlan, GroupRegion, Plan, RawPlan
from ems.kernels.base import CopyBackend, Fusion, PlacedStop, Placement, Staging, tensor_over
from ems.kernels.host_copy import address_of
from ems.records import JobRecord, Stage
from ems.store.value_format import (
    HEADER_SIZE,
    PAYLOAD_HASH_ADDRESS,
    build_headers,
    encode_in_place,
    expected_heads,
    part_checksum,
    payload_checksums,
    stated_checksums,
)
from ems.transport.base import AsPlaced

if TYPE_CHECKING:
    from ems.datapath.jobs.transfer import ReceivedValues  # (the jobs build them; the copier only reads them)

log = logging.getLogger("ems")


class Gathered(enum.Enum):
    """What a gather left in the values' places."""

    PAYLOADS = "payloads"  # the payloads; the headers are still to be written (`encode_values`)
    VALUES = "values"  # the values as the pool stores them (hashed and headed in the same pass)


@dataclass(frozen=True)
class Verified:
    """The leading `count` values of a range are exactly the expected values (header and checksum)."""

    count: int

    def confirm(self, values: ReceivedValues) -> int:
        """How many of the leading values are exactly the expected ones: `count`, checked already."""
        return self.count

    def scatter(self, copier: Copier, plan: BlockPlan, span: Staging, offsets: np.ndarray, a: int) -> int:
        """Write values a..a+count-1 (each at byte `offsets[i]` of `span`, header first) into the cache: count."""
        if self.count:
            copier.scatter_at(plan, span, offsets, a, a + self.count)
        return self.count


@dataclass(frozen=True)
class HeadersChecked:
    """The leading values of a range have exactly the expected headers; `stated` are the checksums those headers
    state, for the scatter to check against the payloads (`Copier.verify_scatter`)."""

    stated: list[int]

    @property
    def count(self) -> int:
        return len(self.stated)

    def confirm(self, values: ReceivedValues) -> int:
        """How many of the leading values are exactly the expected ones: their payloads checked here, in one batch
        (for a scatter that cannot verify as it writes: values scattered one by one)."""
        return values.range(0, self.count).verified_prefix()

    def scatter(self, copier: Copier, plan: BlockPlan, span: Staging, offsets: np.ndarray, a: int) -> int:
        """How many of the values, from the first, have a payload of the stated checksum: those are written."""
        return copier.verify_scatter(plan, span, offsets, a, self.stated)


Checked = Verified | HeadersChecked


def encode_values(plan: Plan, host: memoryview, a: int, b: int, gathered: Gathered) -> list[list[Buffer]]:
    """Values a..b-1, their payloads in `host` (staging) at the plan's places, as the pool stores them: a V1 value
    is one buffer, its payload checksummed and its header written into its place (`encode_in_place`: one call for
    many values) unless the gather did so already (`gathered`); a V0 value (staging has no room for headers: a
    gather leaves payloads) is its header and its payload."""
    if isinstance(plan, RawPlan):
        payloads = plan.payloads(host, a, b)
        headers = build_headers(plan.expected, [part_checksum(p) for p in payloads], a)
        return [[header, payload] for header, payload in zip(headers, payloads)]
    views = plan.value_views(host, a, b)
    if gathered is Gathered.PAYLOADS:
        base = address_of(np.frombuffer(host, dtype=np.uint8))
        encode_in_place(views, plan.expected, a, base + plan.value_start[a:b])
    return [[view] for view in views]


def _as_tensor(value: Staging) -> torch.Tensor:
    """Segments move between tensors (raw V0 ranges have no numpy path)."""
    return tensor_over(value) if isinstance(value, np.ndarray) else value


DeviceWork = Callable[[], AbstractContextManager[None]]  # `ems.datapath.devices.device_work`'s choice


def _regions(plan: BlockPlan, a: int, b: int) -> list[GroupRegion]:
    return [region for region in plan.regions if region.has_pieces(a, b)]


class Copier(abc.ABC):
    """Runs a plan's moves with one copy backend (see the module docstring)."""

    def __init__(self, backend: CopyBackend, device_work: DeviceWork = torch.inference_mode) -> None:
        self.backend = backend
        #: what the jobs enter around this copier's device work (`ems.datapath.devices.device_work`: a side stream
        #: on accelerators, chosen by `copier_for`); the default, inference mode alone, is a CPU copier's
        self.device_work = device_work

    # ------------------------------------------------------------ plain moves (the same in both copiers)

    def gather(self, plan: Plan, staging: torch.Tensor, a: int, b: int) -> Gathered:
        """The payloads of values a..b-1 into their places in staging (the plan's layout)."""
        if isinstance(plan, RawPlan):
            ptrs, lengths, span = self._segments_range(plan, staging, a, b)
            if ptrs.numel():
                self.backend.gather_segments(ptrs, lengths, span)
            return Gathered.PAYLOADS
        return self.gather_at(plan, staging, plan.value_start, a, b)

    def scatter(self, plan: Plan, staging: torch.Tensor, a: int, b: int) -> None:
        """The tokens of values a..b-1 from their places in staging back into the cache, nothing else."""
        if isinstance(plan, RawPlan):
            ptrs, lengths, span = self._segments_range(plan, staging, a, b)
            if ptrs.numel():
                self.backend.scatter_segments(ptrs, lengths, span)
            return
        self.scatter_at(plan, staging, plan.value_start, a, b)

    def scatter_at(self, plan: BlockPlan, span: Staging, offsets: np.ndarray, a: int, b: int) -> None:
        """The tokens of values a..b-1, each placed in `span` at byte `offsets[i]` (header first), into the cache:
        one backend call per layer group."""
        self._move(plan, span, offsets, a, b, gather=False)

    def gather_value(self, plan: Plan, i: int, value: Staging) -> None:
        """Value i's payload straight into `value` (uint8, the whole value: header space first; a tensor, or a numpy
        array for CPU planes)."""
        if isinstance(plan, RawPlan):
            ptrs, lengths = plan.segments(i)
            if ptrs.numel():
                self.backend.gather_segments(ptrs, lengths, _as_tensor(value)[HEADER_SIZE:])
            return
        for region in plan.regions:
            if region.piece_start[i + 1] > region.piece_start[i]:
                self.backend.gather_pieces(region.planes, region.of_value(i), value)

    def scatter_value(self, plan: Plan, i: int, value: Staging) -> None:
        """Value i's rows into the cache straight from the stored value (uint8, verified; may be read-only)."""
        if isinstance(plan, RawPlan):
            ptrs, lengths = plan.segments(i)
            if ptrs.numel():
                self.backend.scatter_segments(ptrs, lengths, _as_tensor(value)[HEADER_SIZE:])
            return
        for region in plan.regions:
            if region.piece_start[i + 1] > region.piece_start[i]:
                self.backend.scatter_pieces(region.planes, region.of_value(i), value)

    def _move(self, plan: BlockPlan, span: Staging, offsets: np.ndarray, a: int, b: int, gather: bool) -> None:
        move = self.backend.gather_pieces if gather else self.backend.scatter_pieces
        for region in plan.regions:
            if region.has_pieces(a, b):
                move(region.planes, region.absolute(offsets, a, b), span)

    @staticmethod
    def _segments_range(plan: RawPlan, staging: torch.Tensor, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Values a..b-1's segments (pointers, lengths) and their bytes in staging."""
        ptrs, lengths = plan.segments_of(a, b)
        return ptrs, lengths, staging[int(plan.value_start[a]) : int(plan.value_start[b])]

    def _verify_then_scatter(self, plan: BlockPlan, span: Staging, offsets: np.ndarray, a: int, stated: Sequence[int]) -> int:
        """The checksums of the payloads in one batch, then the verified prefix scattered."""
        n = len(stated)
        starts = offsets[a : a + n] + HEADER_SIZE
        lengths = plan.expected.payload_len[a : a + n]
        flat = span if isinstance(span, np.ndarray) else span.numpy()
        payloads = [flat[s : s + length] for s, length in zip(starts.tolist(), lengths.tolist())]
        valid = next((i for i, (got, want) in enumerate(zip(payload_checksums(payloads), stated)) if got != want), n)
        if valid:
            self.scatter_at(plan, span, offsets, a, a + valid)
        return valid

    # ------------------------------------------------------------ what the two copiers do differently

    @abc.abstractmethod
    def gather_at(self, plan: BlockPlan, span: Staging, offsets: np.ndarray, a: int, b: int) -> Gathered:
        """The payloads of values a..b-1 into values placed anywhere in `span` (uint8): value i's header at byte
        `offsets[i]` (int64, indexed by value), its payload after it; what it left there."""

    def check(self, values: ReceivedValues, record: JobRecord) -> Checked:
        """What a load checks of the values it received before they are scattered (recorded as `Stage.VERIFY`):
        nothing more where the pool checked each against the expected values (`ReadCheck.EXPECTED`: every value
        received is verified), else this copier's check (`_check`)."""
        if values.checked is ReadCheck.EXPECTED:
            return Verified(values.present())
        return self._check(values, record)

    @abc.abstractmethod
    def _check(self, values: ReceivedValues, record: JobRecord) -> Checked:
        """`check` of values as stored: every value, or the headers only where the scatter verifies the payloads."""

    @abc.abstractmethod
    def verify_scatter(self, plan: BlockPlan, span: Staging, offsets: np.ndarray, a: int, stated: Sequence[int]) -> int:
        """Values a..a+n-1 (n = len(stated)), each placed in `span` at byte `offsets[i]` (header first) with its
        header already checked (`stated`: the checksums those headers state): how many of them, from the first,
        have a payload of the stated checksum. Their tokens are written into the cache, nothing of the first one
        that has not, nor after it."""

    def as_placed(self, plan: BlockPlan, span: torch.Tensor, a: int, b: int, record: JobRecord) -> PlacedScatter | None:
        """What verifies and scatters values a..b-1 while a same-host node is still placing them in `span` (at the
        plan's places), or None: this copier waits for the reply."""
        return None


@dataclass
class PlacedScatter:
    """A load's scatter as a same-host node places the values (`AsPlaced`, run by the pool); `done` gets (values
    verified and written from the first, why it stopped), at most once."""

    run: AsPlaced
    done: list[tuple[int, PlacedStop]]

    def result(self) -> tuple[int, PlacedStop]:
        return self.done[-1] if self.done else (0, PlacedStop.INTERRUPTED)


class SeparateCopier(Copier):
    """Gather, then encode; verify, then scatter (see the module docstring)."""

    def gather_at(self, plan: BlockPlan, span: Staging, offsets: np.ndarray, a: int, b: int) -> Gathered:
        self._move(plan, span, offsets, a, b, gather=True)
        return Gathered.PAYLOADS

    def _check(self, values: ReceivedValues, record: JobRecord) -> Checked:
        start = time.perf_counter()
        valid = values.verified_prefix()
        record.add(Stage.VERIFY, values.expected.payload_bytes(0, len(values.buffers)), time.perf_counter() - start)
        return Verified(valid)

    def verify_scatter(self, plan: BlockPlan, span: Staging, offsets: np.ndarray, a: int, stated: Sequence[int]) -> int:
        return self._verify_then_scatter(plan, span, offsets, a, stated) if stated else 0


class FusedCopier(Copier):
    """The compiled host copy's one pass (see the module docstring); `hash_address`: the payload hash's C entry."""

    def __init__(self, backend: CopyBackend, hash_address: int, device_work: DeviceWork = torch.inference_mode) -> None:
        super().__init__(backend, device_work)
        self.hash_address = hash_address

    def gather_at(self, plan: BlockPlan, span: Staging, offsets: np.ndarray, a: int, b: int) -> Gathered:
        regions = _regions(plan, a, b)
        if len(regions) != 1:  # the encode needs a value's whole payload: only where one group holds it
            self._move(plan, span, offsets, a, b, gather=True)
            return Gathered.PAYLOADS
        region = regions[0]
        self.backend.gather_pieces_encoded(
            region.planes,
            region.absolute(offsets, a, b),
            span,
            np.stack([offsets[a:b], plan.expected.payload_len[a:b]]),
            expected_heads(plan.expected, a, b),
            region.piece_start[a + 1 : b + 1] - region.piece_start[a],
            self.hash_address,
        )
        return Gathered.VALUES

    def _check(self, values: ReceivedValues, record: JobRecord) -> Checked:
        start = time.perf_counter()
        stated = stated_checksums(values.buffers, values.expected)
        record.add(Stage.VERIFY, 0, time.perf_counter() - start)
        return HeadersChecked(stated)

    def verify_scatter(self, plan: BlockPlan, span: Staging, offsets: np.ndarray, a: int, stated: Sequence[int]) -> int:
        n = len(stated)
        if n == 0:
            return 0
        regions = _regions(plan, a, a + n)
        if not regions:
            return self._verify_then_scatter(plan, span, offsets, a, stated)
        first, rest = regions[0], regions[1:]
        valid = self.backend.scatter_pieces_verified(
            first.planes,
            first.absolute(offsets, a, a + n),
            span,
            np.stack([offsets[a : a + n] + HEADER_SIZE, plan.expected.payload_len[a : a + n]]),
            np.asarray(stated, dtype=np.uint64),
            first.piece_start[a + 1 : a + n + 1] - first.piece_start[a],
            self.hash_address,
        )
        for region in rest:  # the other layer groups' rows of the verified values
            if valid and region.has_pieces(a, a + valid):
                self.backend.scatter_pieces(region.planes, region.absolute(offsets, a, a + valid), span)
        return valid

    def as_placed(self, plan: BlockPlan, span: torch.Tensor, a: int, b: int, record: JobRecord) -> PlacedScatter | None:
        done: list[tuple[int, PlacedStop]] = []
        return PlacedScatter(functools.partial(self._scatter_as_placed, plan, span, a, b, record, done), done)

    def _scatter_as_placed(
        self,
        plan: BlockPlan,
        span: torch.Tensor,
        a: int,
        b: int,
        record: JobRecord,
        done: list[tuple[int, PlacedStop]],
        progress: int,
        fd: int,
        deadline_ns: int,
    ) -> None:
        """Run by the pool while a same-host node places the values (`AsPlaced`): verify and scatter each as it
        lands; `done` gets (values verified and written from the first, why it stopped)."""
        start = time.perf_counter()
        try:
            done.append(self.verify_scatter_as_placed(plan, span, plan.value_start, a, b, Placement(progress, fd, deadline_ns)))
        except (ValueError, RuntimeError) as error:  # refused before writing anything: the load goes on without it
            log.warning("ems: scattering values as they are placed failed (%r); waiting for the reply instead", error)
            done.append((0, PlacedStop.INTERRUPTED))
        record.add(Stage.SCATTER, plan.expected.payload_bytes(a, a + done[-1][0]), time.perf_counter() - start)

    def verify_scatter_as_placed(
        self, plan: BlockPlan, span: Staging, offsets: np.ndarray, a: int, b: int, placement: Placement
    ) -> tuple[int, PlacedStop]:
        """Values a..b-1 while a same-host node is still placing them in `span` at bytes `offsets[i]` (header
        first), each taken once `placement` says it is placed: how many of them, from the first, are exactly the
        expected values (header and checksum), their tokens written into the cache as they are verified; and why
        it stopped (`PlacedStop`: at a damaged value the load ends; interrupted, it goes on from the reply)."""
        regions = _regions(plan, a, b)
        if b <= a or not regions:
            return 0, PlacedStop.INTERRUPTED
        first, rest = regions[0], regions[1:]
        done, why = self.backend.scatter_pieces_as_placed(
            first.planes,
            first.absolute(offsets, a, b),
            span,
            np.stack([offsets[a:b], plan.expected.payload_len[a:b]]),
            expected_heads(plan.expected, a, b),
            first.piece_start[a + 1 : b + 1] - first.piece_start[a],
            self.hash_address,
            placement,
        )
        for region in rest:  # the other layer groups' rows of the verified values
            if done and region.has_pieces(a, a + done):
                self.backend.scatter_pieces(region.planes, region.absolute(offsets, a, a + done), span)
        return done, why


def copier_for(backend: CopyBackend, device: torch.device) -> Copier:
    """The copier of `device`'s jobs, chosen once per device (it holds no per-job state): fused where the values lie
    in the cache's own memory (a CPU cache: its staging and the store's buffers are host memory), the backend runs
    the one-pass copies (`Fusion.FUSED`) and the payload hash has its C entry; separate otherwise. Its device work
    runs in `device_work(device)`."""
    work = device_work(device)
    if device.type == "cpu" and backend.fusion is Fusion.FUSED and PAYLOAD_HASH_ADDRESS is not None:
        return FusedCopier(backend, PAYLOAD_HASH_ADDRESS, work)
    return SeparateCopier(backend, work)

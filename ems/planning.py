"""Request planning: a checked request → storage keys, expected values and the copy plan (host, numpy).

Staging layout. A V1 plan gives each layer group g one region of the staging buffer, `[T_g, token_bytes_g]`
(token-major; a token is every plane's row back to back, planes possibly of different row sizes and dtypes), where
`T_g` counts the group's tokens over all blocks in request order. Block i's part of group g is the contiguous byte
range of its tokens in that region, so a stored value is `header | part of group 0 | part of group 1 | ...` without
any repacking: `payload_parts` hands those ranges to the transport as they lie. A V0 plan concatenates every value's
device ranges. Regions start on 64-byte boundaries.

No per-token Python loops: token positions, slots and byte offsets are numpy expressions; only per-block objects
(keys, memoryviews) are built per block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import numpy as np
import torch

from ems.kernels.base import CopyBackend
from ems.keys import v0_keys, v1_keys
from ems.layout import LayerGroup, RegisteredLayout
from ems.requests import ChunkRequest, RawRequest, SlotRequest
from ems.value_format import HEADER_SIZE, Buffer, ExpectedValues, ValueKind, tokens_digest

ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def exclusive_cumsum(counts: np.ndarray) -> np.ndarray:
    """int64 `[len(counts) + 1]`: 0, counts[0], counts[0] + counts[1], ..."""
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


@dataclass(frozen=True)
class GroupRegion:
    """One layer group's staging region and what fills it."""

    group: LayerGroup
    offset: int  # bytes from the start of the staging buffer
    tok_start: np.ndarray  # int64 [n + 1]: block i's tokens are tokens tok_start[i] .. tok_start[i + 1] - 1
    slots: Optional[np.ndarray]  # int64 [T_g] for the slot_mapping form, else None
    starts: Optional[np.ndarray]  # int64 [n] runs for the chunk_descs form, else None
    lengths: Optional[np.ndarray]

    @property
    def tokens(self) -> int:
        return int(self.tok_start[-1])

    @property
    def nbytes(self) -> int:
        return self.tokens * self.group.token_bytes

    def view(self, staging: torch.Tensor, tokens: Optional[int] = None) -> torch.Tensor:
        """The region (or its first `tokens` tokens) as uint8 `[tokens, token_bytes]`: each token is every plane's
        row back to back (planes may differ in row size and dtype: MLA split K/V)."""
        count = self.tokens if tokens is None else tokens
        raw = staging[self.offset : self.offset + count * self.group.token_bytes]
        return raw.view(count, self.group.token_bytes)

    def gather(self, backend: CopyBackend, staging: torch.Tensor) -> None:
        out = self.view(staging)
        if self.slots is not None:
            backend.gather_slots(self.group.planes, torch.from_numpy(self.slots), out)
        else:
            backend.gather_runs(self.group.planes, torch.from_numpy(self.starts), torch.from_numpy(self.lengths), out)

    def scatter_prefix(self, backend: CopyBackend, staging: torch.Tensor, blocks: int) -> None:
        """Write the tokens of the first `blocks` blocks back into the cache, nothing else."""
        tokens = int(self.tok_start[blocks])
        if tokens == 0:
            return
        src = self.view(staging, tokens)
        if self.slots is not None:
            backend.scatter_slots(self.group.planes, torch.from_numpy(self.slots[:tokens]), src)
        else:
            backend.scatter_runs(
                self.group.planes, torch.from_numpy(self.starts[:blocks]), torch.from_numpy(self.lengths[:blocks]), src
            )


@dataclass(frozen=True)
class BlockPlan:
    """A V1 request: one value per block hash."""

    keys: List[bytes]
    route_keys: List[bytes]
    expected: ExpectedValues
    regions: List[GroupRegion]
    staging_bytes: int

    @property
    def total(self) -> int:
        return len(self.keys)

    def part_ranges(self, i: int) -> list[tuple[int, int]]:
        """(start, stop) byte ranges in staging of block i's parts, group by group."""
        ranges = []
        for region in self.regions:
            token_bytes = region.group.token_bytes
            ranges.append(
                (
                    region.offset + int(region.tok_start[i]) * token_bytes,
                    region.offset + int(region.tok_start[i + 1]) * token_bytes,
                )
            )
        return ranges

    def payload_parts(self, host: memoryview) -> list[list[Buffer]]:
        return [[host[a:b] for a, b in self.part_ranges(i)] for i in range(self.total)]

    def fill_from_values(self, host: np.ndarray, values: Sequence[Buffer], blocks: int) -> None:
        """Copy the payloads of the first `blocks` (already verified) values into their staging ranges."""
        for i in range(blocks):
            payload = np.frombuffer(values[i], dtype=np.uint8, offset=HEADER_SIZE)
            position = 0
            for a, b in self.part_ranges(i):
                host[a:b] = payload[position : position + (b - a)]
                position += b - a

    def gather(self, backend: CopyBackend, staging: torch.Tensor) -> None:
        for region in self.regions:
            region.gather(backend, staging)

    def scatter_prefix(self, backend: CopyBackend, staging: torch.Tensor, blocks: int) -> None:
        for region in self.regions:
            region.scatter_prefix(backend, staging, blocks)

    def prefix_staging_bytes(self, blocks: int) -> int:
        """Bytes of staging a load of the first `blocks` blocks touches (regions keep their offsets)."""
        if blocks == 0:
            return 0
        last = self.regions[-1]
        return last.offset + int(last.tok_start[blocks]) * last.group.token_bytes


@dataclass(frozen=True)
class RawPlan:
    """A V0 request: value i is the concatenation of its device ranges."""

    keys: List[bytes]
    route_keys: List[bytes]
    expected: ExpectedValues
    request: RawRequest
    value_start: np.ndarray  # int64 [n + 1]: byte offsets of each value in staging
    staging_bytes: int

    @property
    def total(self) -> int:
        return len(self.keys)

    def payload_parts(self, host: memoryview) -> list[list[Buffer]]:
        starts = self.value_start.tolist()
        return [[host[starts[i] : starts[i + 1]]] for i in range(self.total)]

    def fill_from_values(self, host: np.ndarray, values: Sequence[Buffer], blocks: int) -> None:
        starts = self.value_start.tolist()
        for i in range(blocks):
            host[starts[i] : starts[i + 1]] = np.frombuffer(values[i], dtype=np.uint8, offset=HEADER_SIZE)

    def gather(self, backend: CopyBackend, staging: torch.Tensor) -> None:
        r = self.request
        backend.gather_segments(torch.from_numpy(r.ptrs), torch.from_numpy(r.lengths), staging[: self.staging_bytes])

    def scatter_prefix(self, backend: CopyBackend, staging: torch.Tensor, blocks: int) -> None:
        r = self.request
        segments = int(r.seg_start[blocks])
        if segments == 0:
            return
        nbytes = int(self.value_start[blocks])
        backend.scatter_segments(torch.from_numpy(r.ptrs[:segments]), torch.from_numpy(r.lengths[:segments]), staging[:nbytes])

    def prefix_staging_bytes(self, blocks: int) -> int:
        return int(self.value_start[blocks])


Plan = Union[BlockPlan, RawPlan]


def plan_blocks(request: Union[SlotRequest, ChunkRequest], layout: RegisteredLayout, namespace: bytes) -> BlockPlan:
    keys, route_keys = v1_keys(namespace, request.hashes)
    n = request.total
    regions: list[GroupRegion] = []
    counts = np.empty((n, len(layout.groups)), dtype=np.int64)
    offset = 0
    for g, group in enumerate(layout.groups):
        if isinstance(request, SlotRequest):
            tokens = request.offsets
            region = GroupRegion(group, offset, exclusive_cumsum(tokens), request.slots, None, None)
        else:
            tokens = request.lengths[g]
            region = GroupRegion(group, offset, exclusive_cumsum(tokens), None, request.starts[g], request.lengths[g])
        counts[:, g] = tokens
        regions.append(region)
        offset = _align(offset + region.nbytes)
    token_bytes = np.array([g.token_bytes for g in layout.groups], dtype=np.int64)
    expected = ExpectedValues(
        kind=ValueKind.BLOCKS_V1,
        layout_sig=layout.signature,
        tokens_digest=tokens_digest(counts),
        payload_len=counts @ token_bytes,
    )
    return BlockPlan(keys, route_keys, expected, regions, max(offset, ALIGN))


def plan_raw(request: RawRequest, namespace: bytes) -> RawPlan:
    keys, route_keys = v0_keys(namespace, request.keys)
    seg_bytes = exclusive_cumsum(request.lengths)
    value_start = seg_bytes[request.seg_start]
    payload_len = np.diff(value_start)
    expected = ExpectedValues(
        kind=ValueKind.RAW_V0,
        layout_sig=0,
        tokens_digest=np.zeros(request.total, dtype=np.uint64),
        payload_len=payload_len,
    )
    return RawPlan(keys, route_keys, expected, request, value_start, max(_align(int(value_start[-1])), ALIGN))

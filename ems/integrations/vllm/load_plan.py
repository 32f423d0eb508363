"""A step's loads as calls (`worker_loads.WorkerLoads` starts and settles them; no vLLM imports).

Contract: `LoadCall.calls(loads)` makes the calls of a step's loads (of one epoch): a load that names its chain
position (`BlockTransfer.chain_prefix`: its keys are placed by placement units) is a call of its own (a call carries
one chain position); the others go as **one call** (every request's blocks one after the other), so requests
admitted together take one in-flight slot. A call reads each distinct block hash once (into the block of the first
request that names it; `positions`: each load's blocks' index in the call). A call comes back with the count of
blocks loaded from the first (the API's `success`): `loaded_blocks` is how many leading blocks of a load that gave
it, `copies` the blocks to copy in the KV cache for the requests that share a read block. `LayerLoad` is an in-step
load copied into the cache layer by layer (layer-wise transfers). `copy_blocks` copies loaded blocks into the other
requests' blocks that share them, `copy_from_mirror` a finished asynchronous load from the host mirror into the cache
(layer-wise).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import itemgetter

import torch

from ems.integrations.block_transfer import PendingLoad
from ems.integrations.vllm.layer_transfers import CopyDone, LayerStage
from ems.integrations.vllm.metadata import BlockTransfer


@dataclass
class LoadCall:
    """One `async_load` of a step's loads: each distinct block hash once (into the block of the first request that
    names it), then copied in the KV cache into the other requests' blocks with that hash (requests admitted together
    that share a prefix each load it: one key may appear once in a call, and is read once)."""

    loads: list[BlockTransfer]
    block_ids: list[int]  # the call's blocks, one per distinct hash
    hashes: list[bytes]  # (BlockTransfer's: vLLM's block hashes)
    positions: list[tuple[int, ...]]  # per load: each of its blocks' index in the call
    pending: PendingLoad | None = None
    mirror_start: int | None = None  # layer-wise: `block_ids` are the mirror's rows from here, not the cache's
    chain_prefix: list[bytes] | None = None  # a call of one load whose keys are placed by their chain's units

    @classmethod
    def calls(cls, loads: list[BlockTransfer]) -> list[LoadCall]:
        """A step's loads (of one epoch) as calls: a load whose keys are placed by their chain (`chain_prefix`) is a
        call of its own (one call carries one chain position); the others go together in one call."""
        calls = []
        for load in loads:
            if load.chain_prefix is not None:
                call = cls.plan([load])
                call.chain_prefix = load.chain_prefix
                calls.append(call)
        rest = [load for load in loads if load.chain_prefix is None]
        return calls + [cls.plan(rest)] if rest else calls

    @classmethod
    def plan(cls, loads: list[BlockTransfer]) -> LoadCall:
        every = list(chain.from_iterable(load.hashes for load in loads))
        ids = list(chain.from_iterable(load.block_ids for load in loads))
        first = dict(zip(reversed(every), reversed(ids)))  # hash -> the block of its first request
        hashes = list(dict.fromkeys(every))  # distinct, in first-seen order
        index = {h: i for i, h in enumerate(hashes)}
        where = itemgetter(*every)(index) if len(every) > 1 else tuple(index[h] for h in every)
        positions, offset = [], 0
        for load in loads:
            positions.append(tuple(where[offset : offset + len(load.hashes)]))
            offset += len(load.hashes)
        block_ids = list(itemgetter(*hashes)(first)) if len(hashes) > 1 else [first[h] for h in hashes]
        return cls(loads, block_ids, hashes, positions)

    def copies(self, loaded: int) -> tuple[list[int], list[int]]:
        """(the call's blocks, each request's blocks) to copy when the call loaded its first `loaded` blocks and
        every request keeps its leading blocks that arrived (no retry: an in-step load)."""
        src: list[int] = []
        dst: list[int] = []
        for load, position in zip(self.loads, self.positions):
            got = self.loaded_blocks(position, loaded)
            src.extend(self.block_ids[p] for p in position[:got])
            dst.extend(load.block_ids[:got])
        return src, dst

    def loaded_blocks(self, position: tuple[int, ...], loaded: int) -> int:
        """How many leading blocks of a load with these positions the call's first `loaded` blocks gave it."""
        if loaded >= len(self.hashes):
            return len(position)
        return next((k for k, p in enumerate(position) if p >= loaded), len(position))


@dataclass
class LayerLoad:
    """An in-step load copied into the cache layer by layer: the copier's tasks, one per layer, and what the first
    found (`loaded`: blocks from the call's first; its (mirror row, engine block) pairs)."""

    call: LoadCall
    copies: list[CopyDone]
    loaded: int = 0
    src: torch.Tensor | None = None
    dst: torch.Tensor | None = None


def copy_from_mirror(stage: LayerStage, src: list[int], dst: list[int]) -> None:
    """Layer-wise: mirror rows `src` into KV cache blocks `dst`, every layer (an asynchronous load that ended)."""
    if not src:
        return
    src_t, dst_t = torch.tensor(src, dtype=torch.long), stage.ids(dst)
    for layer in range(len(stage.planes)):
        stage.copy_in(layer, src_t, dst_t)
    if stage.device.type != "cpu":  # vLLM runs the request once it is reported: its blocks must be written
        torch.accelerator.synchronize(stage.device)


def copy_blocks(planes: list[tuple[torch.Tensor, torch.Tensor]], src: list[int], dst: list[int]) -> int:
    """Copy KV cache blocks `src` into `dst`, every layer (blocks the step's call loaded once for requests that
    share them); the blocks copied."""
    if not src:
        return 0
    src_t, dst_t = torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)
    moved = src_t != dst_t
    if not bool(moved.any()):
        return 0
    device = planes[0][0].device
    src_t, dst_t = src_t[moved].to(device), dst_t[moved].to(device)
    for layer_planes in planes:
        for plane in layer_planes:
            plane.index_copy_(0, dst_t, plane.index_select(0, src_t))
    return int(moved.sum())

"""Which of a request's blocks a lookup, load or save of the scheduler half names (`scheduler.EmsScheduler`; no vLLM
imports at run time).

Contract (`RequestBlocks`):
* `hashes(request)`: the request's block hashes, vLLM's `request.block_hashes` (every `hash_stride`-th where vLLM's
  hash block is smaller than the connector's block).
* `chain(request, start)`: the hashes of the request's blocks before position `start` (its keys' chain prefix:
  placement by units), or None for a hybrid model (its lookups and transfers interleave their groups' keys: not one
  chain; placed per key).
* Hybrid models (several KV cache groups, `ctx.hybrid`): every position's block is one value per group, keyed by the
  group (`engine_keys.group_hashes`). `lookup_hashes` asks each position in every group, so a lookup counts a
  position as hit only where every group holds it; `transfer` names, for each group, the blocks of the positions
  (a load: the blocks vLLM allocated for the hit; a sliding-window group gets only the blocks of the window before
  the hit's end: vLLM pads the rest with its null block 0, which is never written; a save: each group's blocks of
  the positions the step computed, a sliding-window group those its window still holds), position by position, so
  a short load keeps a prefix of positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ems.integrations.engine_keys import group_hashes
from ems.integrations.vllm.context import ConnectorContext
from ems.integrations.vllm.engine_checks import GroupKind
from ems.integrations.vllm.metadata import BlockTransfer

if TYPE_CHECKING:
    from vllm.v1.request import Request

NULL_BLOCK = 0  # vLLM's null block (its block pool's first): a position a sliding-window group does not hold


class RequestBlocks:
    """See the module contract."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self._ctx = ctx
        self._block_size = ctx.block_size

    def lookup_hashes(self, request: Request, start: int, full: int) -> list[bytes]:
        """The keys a lookup asks for: each position's hash, or (hybrid) each position's hash in every group."""
        hashes = self.hashes(request)[start:full]
        if not self._ctx.hybrid:
            return hashes
        tagged = [group_hashes(hashes, g) for g in range(len(self._ctx.groups))]
        return [h for position in zip(*tagged) for h in position]

    def chain(self, request: Request, start: int) -> Callable[[], list[bytes]] | None:
        """The hashes of the request's blocks before position `start` (its keys' chain prefix: placement by units),
        or None for a hybrid model (a lookup or transfer interleaves its groups' keys: not one chain; placed per
        key)."""
        if self._ctx.hybrid:
            return None
        return lambda: self.hashes(request)[:start]

    def transfer(
        self,
        rid: str,
        block_ids: list[list[int]],
        hashes: list[bytes],
        start: int,
        end: int,
        epoch: bytes,
        computed: int | None = None,
        in_step: bool = False,
        prefix: list[bytes] | None = None,
    ) -> BlockTransfer:
        """Positions `start..end` of a request as one transfer (`hashes` from position `start`): its blocks and keys,
        or (hybrid) each group's, position by position, without the positions a group does not hold: its null block,
        or, for a sliding-window group with `computed` tokens computed before the step, a position before the window
        of the step's first token (vLLM freed those blocks in this schedule)."""
        if not self._ctx.hybrid:
            return BlockTransfer(rid, block_ids[0][start:end], hashes[: end - start], epoch, in_step=in_step, chain_prefix=prefix)
        ids: list[int] = []
        keys: list[bytes] = []
        columns = []
        block_size = self._block_size
        for g, (kind, window) in enumerate(zip(self._ctx.groups, self._ctx.windows)):
            first = start
            if kind is GroupKind.SLIDING and computed is not None and window:
                first = max(start, max(0, computed - window + 1) // block_size)
            group_ids = block_ids[g][first:end]
            columns.append((first, group_ids, group_hashes(hashes[first - start : end - start], g)))
        for p in range(start, end):  # position by position: a short load keeps a prefix of positions
            for first, group_ids, group_keys in columns:
                if p >= first and p - first < len(group_ids) and group_ids[p - first] != NULL_BLOCK:
                    ids.append(group_ids[p - first])
                    keys.append(group_keys[p - first])
        return BlockTransfer(rid, ids, keys, epoch, in_step=in_step)

    def hashes(self, request: Request) -> list[bytes]:
        hashes = request.block_hashes
        stride = self._ctx.hash_stride
        return list(hashes) if stride == 1 else list(hashes[stride - 1 :: stride])

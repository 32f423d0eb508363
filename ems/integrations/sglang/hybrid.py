"""SGLang's v2 calls for hybrid models: each side host pool moved by a client of its own, and the hit fold.

Contract (no SGLang imports; used by `backend.EmsHiCacheStorage`):

* `SidePool.open(name, host, config, model_id)`: the pool's memory (`host_layout.pool_view`: views, no copy)
  registered with a `ContextCaching` of its own (`host_region.open_client`, over the same pool settings as the KV
  pool's client) under `model_id` (`namespace.pool_model_id`: the pool's name is in it), so a side pool's page never
  meets another pool's, nor the KV pool's, under one key. `UnsupportedLayout` (from `pool_view`) when the pool
  cannot be viewed. `close()` closes the client.
* `SidePool.move(save, hashes, host_indices, option)`: one V1 `save` or `load` for the whole transfer
  (`slot_mapping` = SGLang's host indices, or their pages where a slot is a page: `PoolView.slot_mapping`;
  `offsets = [page_slots] * n`): the package's copy path gathers every page's components (all layers, every state
  buffer) into the values and scatters them back, no Python loop per page or per
  layer. Side pools' pages are placed by their own key (no `chain_prefix`: a trailing window's keys are not the
  chain's next pages, and `count` probes them in reverse), so every server finds them whatever SGLang passes as
  `prefix_keys`. Returns the consecutive successes from the first; bad input (the indices do not cover `n` pages) raises
  `ValueError`; a pool failure raises the SDK's `EmsException` (the caller counts both as misses).
* `SidePool.count(hashes, option, lease_ms)`: one `exists`, the count of consecutive hits from the first.
* `fold_hits(kv_pages, transfers, probe)`: SGLang's `batch_exists_v2` answer from the KV prefix (`kv_pages`, the
  v1 `batch_exists`) and one probe per side pool (`probe(transfer, reverse)`: how many of the KV prefix's keys, from
  the first, or from the last when `reverse`, that pool holds). Per `transfer.hit_policy` (SGLang's
  `PoolHitPolicy`, by value):

  - `all_pages`: the pool's pages `0 .. c-1` are there: prefix lengths `1 .. c` are restorable;
  - `trailing_pages` (window `N = len(transfer.keys)`, at least 1: Mamba's state, SWA's window): the probe from the
    last key finds the run of present pages that ends the KV prefix, `K-c .. K-1`; prefix length `p` is restorable
    when its window `p-N .. p-1` lies in that run (every `p` when the whole prefix is there). A window that ends
    before that run (a state stored at an earlier page whose next page's state is missing) is not seen: the hit is
    shorter, never wrong (the public `exists` answers a count, not each key's presence);
  - `block_groups`: the pool's verdict is its leading whole groups (`group_pages` keys each); it never gates the KV hit;
  - a pool named `kv` is the KV pool itself (no probe); any other policy, or a pool this backend does not serve
    (`probe` answers 0), restores nothing.

  `final_pages` is the longest prefix every pool can restore (0 if none), `pool_pages` each pool's own boundary
  (pools with 0 left out, as SGLang's file backend reports them) and `restorable` every restorable prefix length.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ems import CcKvOption, ContextCaching
from ems.integrations.connector_config import ConnectorConfig
from ems.integrations.host_region import close_client, open_client
from ems.integrations.sglang.host_layout import PoolView, pool_view

logger = logging.getLogger("ems.sglang")

KV_POOL = "kv"  # SGLang's PoolName.KV: the anchor pool, moved by the v1 calls


@dataclass
class SidePool:
    """One v2 host pool of a hybrid model and the client that moves its pages (see the module contract)."""

    name: str
    host: Any
    cc: ContextCaching
    view: PoolView  # what is registered: views of the host pool's buffers

    @property
    def planes(self) -> list[list[torch.Tensor]]:
        return self.view.planes

    @classmethod
    def open(cls, name: str, host: Any, config: ConnectorConfig, model_id: str) -> SidePool:
        view = pool_view(host)  # UnsupportedLayout: not viewable, nothing opened
        cc = open_client(config, model_id)  # (TP sharing is in model_id: `namespace.pool_model_id`)
        try:
            cc.register_kvcache(view.planes)
        except BaseException:
            close_client(cc)
            raise
        return cls(name, host, cc, view)

    def move(self, save: bool, hashes: Sequence[int], host_indices: torch.Tensor, option: CcKvOption) -> int:
        n = len(hashes)
        slots = host_indices if host_indices.dtype == torch.int64 else host_indices.to(torch.int64)
        if slots.device.type != "cpu":
            slots = slots.cpu()
        page = self.view.page_tokens
        if slots.numel() != n * page:
            raise ValueError(f"{self.name}: {slots.numel()} host indices for {n} pages of {page} tokens")
        call = self.cc.save if save else self.cc.load
        return int(call(self.view.slot_mapping(slots), list(hashes), [self.view.page_slots] * n, option).success)

    def count(self, hashes: Sequence[int], option: CcKvOption, lease_ms: int = 0) -> int:
        if not hashes:
            return 0
        kwargs: dict[str, Any] = {"lease_ms": lease_ms} if lease_ms > 0 else {}
        return int(self.cc.exists(list(hashes), option, **kwargs).success)

    def close(self) -> None:
        close_client(self.cc)


@dataclass(frozen=True)
class PoolHits:
    """`batch_exists_v2`'s answer (see the module contract)."""

    final_pages: int
    pool_pages: dict[Any, int] = field(default_factory=dict)
    restorable: list[int] = field(default_factory=list)


def _policy(transfer: Any) -> str:
    policy = getattr(transfer, "hit_policy", "all_pages")
    return str(getattr(policy, "value", policy))


def fold_hits(kv_pages: int, transfers: Sequence[Any], probe: Callable[[Any, bool], int]) -> PoolHits:
    """SGLang's `batch_exists_v2` fold over the side pools (see the module contract)."""
    lo, hi = 1, kv_pages  # restorable prefix lengths: an interval, empty when lo > hi
    pool_pages: dict[Any, int] = {}
    for transfer in transfers:
        if lo > hi:
            break
        name, policy = transfer.name, _policy(transfer)
        if str(name) == KV_POOL:
            continue
        if policy == "all_pages":
            first, last = 1, min(kv_pages, probe(transfer, False))
        elif policy == "trailing_pages":
            window = max(1, len(transfer.keys or ()))
            run = min(kv_pages, probe(transfer, True))
            first, last = (1, kv_pages) if run == kv_pages else (kv_pages - run + window, kv_pages)
        elif policy == "block_groups":
            group = max(1, int(getattr(transfer, "group_pages", 0) or 0))
            groups = min(kv_pages, probe(transfer, False)) // group * group
            if groups:
                pool_pages[name] = groups
            continue
        else:
            first, last = 1, 0
        if first <= last:
            pool_pages[name] = last
        lo, hi = max(lo, first), min(hi, last)
    if lo > hi:
        return PoolHits(0, pool_pages, [])
    return PoolHits(hi, pool_pages, list(range(lo, hi + 1)))

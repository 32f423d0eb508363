"""SGLang's host KV pools as the package's registered layout: `[layers][K, V]` views, no copy.

Contract (no SGLang imports; the host pool is read by attribute): `host_planes(host)` returns the list that
`ContextCaching.register_kvcache` takes, `[[K, V] per layer]`, each `[pages, page_size, heads, head_size]`, viewing the
pool's `kv_buffer` (no byte is copied, so a load writes the host pool itself and a save reads it). Host token index
`t` is slot `t` of every plane (page `t // page_size`, row `t % page_size`), so SGLang's `host_indices` are the
package's `slot_mapping`. Every row of a plane (heads * head_size elements) is contiguous; pages and rows may be
strided, which the package's copy path gathers and scatters in one pass.

| pool, layout | `kv_buffer` | plane of layer l |
|---|---|---|
| MHA `layer_first` | `[2, L, tokens, H, D]` | `kv[k, l]` |
| MHA `page_first` | `[2, tokens, L, H, D]` | `kv[k, :, l]` (rows `L*H*D` apart) |
| MHA `page_first_direct` | `[2, pages, L, page, H, D]` | `kv[k, :, l]` |
| MHA `page_head` | `[2, pages, H, page, L, D]` | per (layer, head): `kv[k, :, h, :, l]`, heads = 1 (see below) |
| MLA `layer_first` | `[L, tokens, 1, W]` | K = the latent part `[..., :W-rope]`, V = the rope part |
| MLA `page_first` | `[tokens, L, 1, W]` | as above |
| MLA `page_first_direct` | `[pages, L, page, 1, W]` | as above |

The first three MHA layouts register the same planes, so their stored values are byte-identical: servers with
different layouts share pages. `page_head` registers one plane pair per layer and head, since a row of H heads is
not contiguous there (another layout signature, so its pages meet only `page_head` servers'). Other layouts
(`page_unified`, Ascend's `page_first_kv_split`, ...) are refused with `UnsupportedLayout` naming them.

Hybrid models' side pools (SGLang's v2, `register_mem_host_pool_v2`): `pool_view(host)` is a `PoolView`, the same
list for any pool SGLang registers there plus how a page maps to registered slots:

* an MHA or MLA pool (SWA, the draft pools): `host_planes(host)`; a page is its `page_size` slots (slot = host
  index);
* `MambaPoolHost` (`page_first` / `page_first_direct`: `temporal_buffer` and each `conv_buffer[j]` `[slots, L, 1,
  ...]`, each `slot_state_buffers[j]` `[slots, ...]`): one plane pair per layer of each component (temporal, then
  conv_0..conv_n), then one per side state; page size 1 (a page is a state slot);
* `DSAIndexerPoolHost` (`index_k_with_scale_buffer`: `page_first` `[pages, L, 1, bytes]`, `layer_first` `[L, pages,
  bytes]`): one plane pair per layer, one slot per page (slot = host index // page_size).

Each non-KV plane pair is `[slots, 1, 1, bytes / 2]` of `uint8`: the slot's bytes of that component cut in two halves
(`kv_layouts.block_planes`), so one value holds a page's whole state, and every layout of a pool gives the same
value (the same bytes in the same order). Any other pool (QSA indexers, DeepSeek V4's compressed pools, ...) raises
`UnsupportedLayout` naming its class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ems import EmsException
from ems.integrations.kv_layouts import block_planes

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class UnsupportedLayout(ValueError):
    """A host pool this module cannot view without a copy."""


def is_mla(host: Any) -> bool:
    return hasattr(host, "kv_lora_rank")


def host_planes(host: Any) -> list[list[torch.Tensor]]:
    """The `register_kvcache` list of `host`'s `kv_buffer` (see the module contract)."""
    layout = str(host.layout)
    kv = host.kv_buffer
    page = int(host.page_size)
    if not isinstance(kv, torch.Tensor):
        raise UnsupportedLayout(f"{type(host).__name__}.kv_buffer is {type(kv).__name__}, not one tensor")
    pages = int(host.size) // page
    if is_mla(host):
        if layout not in MLA_LAYOUTS:
            raise UnsupportedLayout(f"SGLang MLA host layout {layout!r}: supported are {list(MLA_LAYOUTS)}")
        if layout == "layer_first":
            rows = [kv[layer, : pages * page].unflatten(0, (pages, page)) for layer in range(kv.shape[0])]
        elif layout == "page_first":
            rows = [kv[: pages * page, layer].unflatten(0, (pages, page)) for layer in range(kv.shape[1])]
        else:
            rows = [kv[:, layer] for layer in range(kv.shape[1])]
        width = int(kv.shape[-1])
        rope = int(getattr(host, "qk_rope_head_dim", 0) or 0)
        split = width - rope if 0 < rope < width else width // 2
        if split < 1:
            raise UnsupportedLayout(f"SGLang MLA host rows of {width} elements cannot be split into K and V")
        return [[r[..., :split], r[..., split:]] for r in rows]
    if layout not in MHA_LAYOUTS:
        raise UnsupportedLayout(f"SGLang host layout {layout!r}: supported are {list(MHA_LAYOUTS)}")
    if layout == "layer_first":
        return [[kv[k, layer, : pages * page].unflatten(0, (pages, page)) for k in (0, 1)] for layer in range(kv.shape[1])]
    if layout == "page_first":
        return [[kv[k, : pages * page, layer].unflatten(0, (pages, page)) for k in (0, 1)] for layer in range(kv.shape[2])]
    if layout == "page_first_direct":
        return [[kv[k, :, layer] for k in (0, 1)] for layer in range(kv.shape[2])]
    # page_head: [2, pages, H, page, L, D]
    return [
        [kv[k, :, head, :, layer].unsqueeze(2) for k in (0, 1)] for layer in range(kv.shape[4]) for head in range(kv.shape[2])
    ]


def _slot_bytes(tensor: torch.Tensor, slots: int) -> torch.Tensor:
    """`[slots, bytes]` uint8 view of a tensor whose dim 0 is the slot (each slot's bytes one dense run), no copy."""
    rows = tensor.reshape(slots, -1)
    if rows.data_ptr() != tensor.data_ptr() or rows.stride(-1) != 1:
        raise UnsupportedLayout(f"a state buffer {tuple(tensor.shape)} is not one run per slot")
    return rows.view(torch.uint8)


def _byte_planes(runs: list[torch.Tensor], slots: int, what: str) -> list[list[torch.Tensor]]:
    try:
        return [list(block_planes(run, slots, name=what)) for run in runs]
    except EmsException as exc:
        raise UnsupportedLayout(f"SGLang {what} host pool: {exc.message()}") from None


def is_mamba(host: Any) -> bool:
    return hasattr(host, "temporal_buffer") and hasattr(host, "conv_buffer")


def mamba_planes(host: Any) -> list[list[torch.Tensor]]:
    """The plane pairs of SGLang's `MambaPoolHost` (see the module contract)."""
    layout = str(host.layout)
    if layout not in ("page_first", "page_first_direct"):
        raise UnsupportedLayout(f"SGLang Mamba host layout {layout!r}: supported are ['page_first', 'page_first_direct']")
    slots = int(host.size)
    components = [host.temporal_buffer, *host.conv_buffer]
    runs = [_slot_bytes(c[:, layer], slots) for c in components if c.numel() > 0 for layer in range(int(c.shape[1]))]
    runs += [_slot_bytes(s, slots) for s in getattr(host, "slot_state_buffers", ()) if s.numel() > 0]
    return _byte_planes(runs, slots, "Mamba")


def is_dsa_indexer(host: Any) -> bool:
    return hasattr(host, "index_k_with_scale_buffer") and hasattr(host, "indexer_page_num")


def dsa_indexer_planes(host: Any) -> list[list[torch.Tensor]]:
    """The plane pairs of SGLang's `DSAIndexerPoolHost`, one slot per page (see the module contract)."""
    layout, buf = str(host.layout), host.index_k_with_scale_buffer
    if not isinstance(buf, torch.Tensor):
        raise UnsupportedLayout("SGLang DSA indexer host pool without its buffer (a dummy pool)")
    if layout == "layer_first":
        pages, layers = int(buf.shape[1]), [buf[layer] for layer in range(int(buf.shape[0]))]
    elif layout in ("page_first", "page_first_direct"):
        pages, layers = int(buf.shape[0]), [buf[:, layer] for layer in range(int(buf.shape[1]))]
    else:
        raise UnsupportedLayout(f"SGLang DSA indexer host layout {layout!r}")
    return _byte_planes([_slot_bytes(t, pages) for t in layers], pages, "DSA indexer")


@dataclass(frozen=True)
class PoolView:
    """A v2 host pool as registered (see the module contract): `planes` for `register_kvcache`, `page_tokens` host
    indices per page (the pool's page size), `page_slots` registered slots per page (`page_tokens`, or 1 where a
    slot is a whole page)."""

    planes: list[list[torch.Tensor]]
    page_tokens: int
    page_slots: int

    def slot_mapping(self, host_indices: torch.Tensor) -> torch.Tensor:
        """The registered slots of SGLang's `host_indices` (int64, CPU), `page_slots` per page."""
        if self.page_slots == self.page_tokens:
            return host_indices
        return host_indices[:: self.page_tokens] // self.page_tokens


def pool_view(host: Any) -> PoolView:
    """A v2 (side) host pool as the SDK registers it (see the module contract)."""
    page = int(host.page_size)
    if is_mamba(host):
        return PoolView(mamba_planes(host), page, page)
    if is_dsa_indexer(host):
        return PoolView(dsa_indexer_planes(host), page, 1)
    if isinstance(getattr(host, "kv_buffer", None), torch.Tensor) and hasattr(host, "layout"):
        return PoolView(host_planes(host), page, page)
    raise UnsupportedLayout(f"SGLang host pool {type(host).__name__}: not a KV (MHA, MLA), Mamba or DSA indexer pool")

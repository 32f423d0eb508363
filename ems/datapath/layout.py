"""The registered KV-cache layout: layer groups, their tensors and strides, and the layout signature.

`register_layout(kvcache, store_layer_group_desc)` checks what an engine registers and records it; it moves no data.
`kvcache[layer][0 or 1]` is that layer's K or V tensor, `[blocks, block_size, heads, head_size]`: a list of
`[K, V]` lists, or one `[layers, 2, blocks, block_size, heads, head_size]` tensor (the SDK's overall shape). Tensors need not be
contiguous as a whole (engines hand out views), but each token row (`heads * head_size` elements) must be. Layer
groups may differ in block size, heads, head_size and dtype. Within a group every tensor has the same number of
blocks and block size (a slot names one row of each), while K and V may differ in heads, head size and dtype: MLA
with split K/V (DeepSeek on Ascend) registers per layer K = the latent `[blocks, block_size, 1, 512]` and V = the
rope part `[blocks, block_size, 1, 64]`. The layout records views of the registered tensors (not the tensor objects),
which keep their storages alive: a tensor whose storage the engine replaces after registration (`K.set_(other)`)
does not move the registration; calls go on reading and writing the registered memory, which stays allocated until
the next `register_kvcache` or shutdown (register again after replacing a cache). The signature covers everything a
stored value's bytes depend on (each group's layers and every plane's dtype, heads and head_size), so a differently
shaped engine never reads foreign bytes.

Cross-layer blocks: where a group's tensors are views of block-major storage that keeps each block's layers
together (`[blocks, layers, 2, block_size, heads, head_size]` seen as `[layers, 2, blocks, ...]`, or vLLM's
block-outermost layouts), `group.planes.block_runs` is not None: a whole-block value is then one run of the cache
and moves as one copy (`ems.datapath.planning`); `LayerGroup.cross_layer` says so. The stored bytes are the same
either way.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ems.errors import invalid_argument
from ems.kernels.planes import PlaneSet
from ems.types import StoreLayerGroupDesc

SUPPORTED_DEVICE_TYPES = ("cpu", "cuda", "npu")


@dataclass(frozen=True)
class LayerGroup:
    """One layer group: its layers, the largest block it stores, and its tensors as kernel planes."""

    index: int
    layer_ids: tuple[int, ...]
    store_block_size: int
    planes: PlaneSet

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies in a stored value: every plane's row."""
        return self.planes.token_bytes

    @property
    def cross_layer(self) -> bool:
        """Whether each block of this group is one contiguous run of the cache (see the module docstring)."""
        return self.planes.block_runs is not None

    def describe(self) -> str:
        def spec(t: torch.Tensor) -> str:
            return f"dtype={str(t.dtype).replace('torch.', '')};heads={t.shape[2]};head_size={t.shape[3]}"

        layers = f"layers={','.join(map(str, self.layer_ids))}"
        if self.planes.uniform:
            return f"{layers};{spec(self.planes.planes[0])}"
        return f"{layers};planes=" + "/".join(spec(t) for t in self.planes.planes)


@dataclass(frozen=True)
class RegisteredLayout:
    groups: tuple[LayerGroup, ...]
    num_layers: int
    device: torch.device
    signature: int  # u64, XXH3 of every group's description

    @functools.cached_property
    def min_store_block_size(self) -> int:
        return min(g.store_block_size for g in self.groups)

    @functools.cached_property
    def min_num_slots(self) -> int:
        return min(g.planes.num_slots for g in self.groups)

    @functools.cached_property
    def one_run_plans(self) -> dict[tuple[int, int], Any]:
        """`ems.datapath.planning`'s cache for this layout: (first slot, tokens) of a one-value request → its plan's shape
        and pieces (they name this layout's planes, so they live and die with it)."""
        return {}


def _check_tensor(name: str, tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise invalid_argument(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 4:
        raise invalid_argument(f"{name} must have shape [blocks, block_size, heads, head_size], got {tuple(tensor.shape)}")
    if any(int(d) <= 0 for d in tensor.shape):
        raise invalid_argument(f"{name} has an empty dimension: {tuple(tensor.shape)}")
    heads, head_size = int(tensor.shape[2]), int(tensor.shape[3])
    row_contiguous = (head_size == 1 or tensor.stride(3) == 1) and (heads == 1 or tensor.stride(2) == head_size)
    if not row_contiguous:
        raise invalid_argument(
            f"{name}: each token row (heads*head_size elements) must be contiguous; strides are {tensor.stride()}"
        )
    if tensor.device.type not in SUPPORTED_DEVICE_TYPES:
        raise invalid_argument(f"{name} is on {tensor.device}; supported devices are {SUPPORTED_DEVICE_TYPES}")
    if tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise invalid_argument(f"{name} has dtype {tensor.dtype}, which is not a KV-cache dtype")
    return tensor


def _group_descs(
    num_layers: int, block_size: int, store_layer_group_desc: Sequence[StoreLayerGroupDesc] | None
) -> list[StoreLayerGroupDesc]:
    if store_layer_group_desc is None:
        return [StoreLayerGroupDesc(store_block_size=block_size, layer_ids=list(range(num_layers)))]
    if not isinstance(store_layer_group_desc, (list, tuple)) or not store_layer_group_desc:
        raise invalid_argument("store_layer_group_desc must be a non-empty list of StoreLayerGroupDesc or None")
    seen: dict[int, int] = {}
    for g, desc in enumerate(store_layer_group_desc):
        if not isinstance(desc, StoreLayerGroupDesc):
            raise invalid_argument(f"store_layer_group_desc[{g}] must be a StoreLayerGroupDesc, got {type(desc).__name__}")
        for layer in desc.layer_ids:
            if layer >= num_layers:
                raise invalid_argument(
                    f"store_layer_group_desc[{g}].layer_ids names layer {layer}, but kvcache has {num_layers} layers"
                )
            if layer in seen:
                raise invalid_argument(
                    f"store_layer_group_desc[{g}].layer_ids repeats layer {layer} (already in group {seen[layer]})"
                )
            seen[layer] = g
    missing = sorted(set(range(num_layers)) - set(seen))
    if missing:
        raise invalid_argument(f"store_layer_group_desc misses layers {missing}: every layer must be in one group")
    return list(store_layer_group_desc)


def register_layout(kvcache: object, store_layer_group_desc: Sequence[StoreLayerGroupDesc] | None = None) -> RegisteredLayout:
    """Check `kvcache` (and the optional layer groups) and record the layout; raises EmsException on bad input."""
    if isinstance(kvcache, torch.Tensor):
        if kvcache.dim() != 6 or kvcache.shape[1] != 2 or kvcache.shape[0] < 1:
            raise invalid_argument(
                f"kvcache as one tensor must be [layers, 2, blocks, block_size, heads, head_size], got {tuple(kvcache.shape)}"
            )
        kvcache = [[kvcache[layer, 0], kvcache[layer, 1]] for layer in range(int(kvcache.shape[0]))]
    if not isinstance(kvcache, (list, tuple)) or not kvcache:
        raise invalid_argument(
            "kvcache must be a non-empty list (layers) of [K, V] tensor pairs, or one "
            "[layers, 2, blocks, block_size, heads, head_size] tensor"
        )
    tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer, pair in enumerate(kvcache):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise invalid_argument(f"kvcache[{layer}] must be [K, V]: a list of exactly 2 tensors")
        tensors.append((_check_tensor(f"kvcache[{layer}][0]", pair[0]), _check_tensor(f"kvcache[{layer}][1]", pair[1])))
    device = tensors[0][0].device
    for layer, pair in enumerate(tensors):
        for kv, tensor in enumerate(pair):
            if tensor.device != device:
                raise invalid_argument(f"kvcache[{layer}][{kv}] is on {tensor.device}, kvcache[0][0] on {device}")
    descs = _group_descs(len(tensors), int(tensors[0][0].shape[1]), store_layer_group_desc)
    groups = []
    for g, desc in enumerate(descs):
        first_layer = desc.layer_ids[0]
        reference = tensors[first_layer][0]
        planes: list[torch.Tensor] = []
        for layer in desc.layer_ids:
            for kv, tensor in enumerate(tensors[layer]):
                if tensor.shape[:2] != reference.shape[:2]:
                    where = "store_layer_group_desc" if store_layer_group_desc is not None else "one layer group"
                    raise invalid_argument(
                        f"kvcache[{layer}][{kv}] is {tuple(tensor.shape)}, but kvcache[{first_layer}][0] is "
                        f"{tuple(reference.shape)}: tensors of {where} must have the same [blocks, block_size] "
                        "(heads, head_size and dtype may differ; register layers with other blocks as separate "
                        "StoreLayerGroupDesc groups)"
                    )
                # a view of our own: it holds the tensor's storage, so an engine that replaces its tensor's storage
                # afterwards (`K.set_(...)`) cannot free the memory the recorded addresses point at
                planes.append(tensor.detach())
        groups.append(LayerGroup(g, tuple(desc.layer_ids), desc.store_block_size, PlaneSet(tuple(planes))))
    signature = xxhash.xxh3_64_intdigest("|".join(g.describe() for g in groups).encode())
    return RegisteredLayout(tuple(groups), len(tensors), device, signature)

"""Engines' paged KV tensors as the `[K, V]` planes that `ContextCaching.register_kvcache` accepts.

Contract: `block_planes(kv, num_blocks)` returns two views `(K, V)` of `kv`'s memory, each `[num_blocks, 1, 1, E]`:
row `b` of the two planes together covers exactly the bytes of engine block `b` (whatever the attention backend
does inside a block), so one registered "slot" is one engine block, moved as opaque bytes, and `register_kvcache`
sees a contiguous row per slot (the one thing it requires). Nothing is copied. The layouts:

- BLOCK_FIRST: one tensor, dim 0 = blocks, each block's bytes one contiguous run (CPU `[B, kv_heads, N, 2*head]`,
  MLA latent `[B, N, D]`, flashinfer `[B, 2, N, H, D]`; vLLM >= 0.2x per-layer `[B, H, N, C]` views: CPU attention,
  flash-attn NHD/HND, MLA with H == 1). Planes: the block bytes cut in two halves.
- KV_FIRST: one tensor `[2, B, N, H, D]` (CUDA flash-attention, vLLM 0.x). Planes: `t[0]`, `t[1]`.
- KV_PAIR: `(K, V)`, each `[B, N, H, D]` (vllm-ascend). Planes: `K`, `V`.

A block whose bytes are not one dense run (e.g. a heads-outermost layout) raises `EmsException(EMS_INVALID_ARGUMENT)`.
`plane_shape(...)` describes one layer's plane without tensors, so a process that holds no KV cache (vLLM's
scheduler) can register an identical layout (`shadow_kvcache`) and address the same keys.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ems import EmsErrorCode, EmsException, StoreLayerGroupDesc

KvTensors = torch.Tensor | Sequence[torch.Tensor]


def invalid_argument(message: str) -> EmsException:
    return EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, message)


class KvLayoutKind(str, enum.Enum):
    BLOCK_FIRST = "block_first"
    KV_FIRST = "kv_first"
    KV_PAIR = "kv_pair"


@dataclass(frozen=True)
class PlaneShape:
    """One registered layer: each of its two planes holds `elems` elements of `dtype` per engine block."""

    elems: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes of one engine block of this layer (both planes)."""
        return 2 * self.elems * self.dtype.itemsize


def detect_kind(kv: KvTensors) -> KvLayoutKind:
    """The layout kind of one layer's KV as an engine hands it over."""
    if isinstance(kv, (list, tuple)):
        return KvLayoutKind.KV_PAIR
    if not isinstance(kv, torch.Tensor):
        raise invalid_argument(f"kv must be a tensor or a (K, V) pair of tensors, got {type(kv).__name__}")
    if kv.dim() == 5 and kv.shape[0] == 2:
        return KvLayoutKind.KV_FIRST
    return KvLayoutKind.BLOCK_FIRST


def _block_run(name: str, t: torch.Tensor) -> int:
    """Elements of one block of `t` (dim 0 = blocks) if each block is one dense run, else raise."""
    if t.dim() < 2:
        raise invalid_argument(f"{name} must have a blocks dimension and at least one more, got {tuple(t.shape)}")
    dims = sorted((t.stride(d), int(t.shape[d])) for d in range(1, t.dim()) if t.shape[d] != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            raise invalid_argument(
                f"{name}: the bytes of one block are not one contiguous run (shape {tuple(t.shape)}, strides "
                f"{t.stride()}); this layout cannot be moved as whole blocks"
            )
        expected *= size
    if t.shape[0] > 1 and t.stride(0) < expected:
        raise invalid_argument(f"{name}: blocks overlap (block stride {t.stride(0)} < block size {expected})")
    return expected


def _rows(t: torch.Tensor, elems: int, offset: int) -> torch.Tensor:
    """`[blocks, 1, 1, elems]` view of each block's run of `t`, starting `offset` elements into the block."""
    return torch.as_strided(t, (int(t.shape[0]), 1, 1, elems), (t.stride(0), elems, elems, 1), t.storage_offset() + offset)


def _check_blocks(name: str, t: torch.Tensor, num_blocks: int | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise invalid_argument(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if num_blocks is not None and int(t.shape[0]) != num_blocks:
        raise invalid_argument(f"{name} has {int(t.shape[0])} blocks in dim 0 (shape {tuple(t.shape)}), expected {num_blocks}")


def block_planes(
    kv: KvTensors, num_blocks: int | None = None, kind: KvLayoutKind | None = None, name: str = "kv"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(K, V)` planes, each `[blocks, 1, 1, E]`, whose row `b` together cover engine block `b`'s bytes."""
    kind = kind or detect_kind(kv)
    if kind == KvLayoutKind.KV_PAIR:
        if not isinstance(kv, (list, tuple)) or len(kv) != 2:
            raise invalid_argument(f"{name} must be a (K, V) pair for {kind.value}")
        k, v = kv
        _check_blocks(f"{name}[0]", k, num_blocks)
        _check_blocks(f"{name}[1]", v, num_blocks)
        ek, ev = _block_run(f"{name}[0]", k), _block_run(f"{name}[1]", v)
        if ek != ev or k.dtype != v.dtype or k.shape[0] != v.shape[0]:
            raise invalid_argument(f"{name}: K {tuple(k.shape)} {k.dtype} and V {tuple(v.shape)} {v.dtype} differ")
        return _rows(k, ek, 0), _rows(v, ev, 0)
    if not isinstance(kv, torch.Tensor):
        raise invalid_argument(f"{name} must be one tensor for {kind.value}, got {type(kv).__name__}")
    if kind == KvLayoutKind.KV_FIRST:
        if kv.shape[0] != 2:
            raise invalid_argument(f"{name} must be [2, blocks, ...] for {kind.value}, got {tuple(kv.shape)}")
        return block_planes((kv[0], kv[1]), num_blocks, KvLayoutKind.KV_PAIR, name)
    _check_blocks(name, kv, num_blocks)
    total = _block_run(name, kv)
    if total % 2:
        raise invalid_argument(f"{name}: a block holds an odd number of elements ({total}); cannot split it in two")
    half = total // 2
    return _rows(kv, half, 0), _rows(kv, half, half)


def plane_shape(block_bytes: int, dtype: torch.dtype) -> PlaneShape:
    """The plane of a layer whose engine block is `block_bytes` bytes of `dtype` (e.g. vLLM's real page size)."""
    itemsize = dtype.itemsize
    if block_bytes <= 0 or block_bytes % (2 * itemsize):
        raise invalid_argument(f"block_bytes ({block_bytes}) must be a positive multiple of 2 x {itemsize}")
    return PlaneShape(block_bytes // (2 * itemsize), dtype)


def shape_of(planes: tuple[torch.Tensor, torch.Tensor]) -> PlaneShape:
    return PlaneShape(int(planes[0].shape[3]), planes[0].dtype)


def store_groups(shapes: Sequence[PlaneShape]) -> list[StoreLayerGroupDesc]:
    """One layer group per distinct plane shape, in first-seen order; stored blocks hold one slot (one engine block)."""
    groups: dict[PlaneShape, list[int]] = {}
    for layer, shape in enumerate(shapes):
        groups.setdefault(shape, []).append(layer)
    return [StoreLayerGroupDesc(store_block_size=1, layer_ids=layers) for layers in groups.values()]


def shadow_kvcache(shapes: Sequence[PlaneShape], device: str | torch.device = "cpu") -> list[list[torch.Tensor]]:
    """A one-block KV cache with the given plane shapes: registering it yields the same layout signature (so the
    same keys) as registering the engine's real planes, for a process that only asks `exists`."""
    return [[torch.empty((1, 1, 1, s.elems), dtype=s.dtype, device=device) for _ in range(2)] for s in shapes]

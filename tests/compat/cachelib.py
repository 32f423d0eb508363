"""Engine KV caches for the compat tests: random bytes (never zeros), poisoning, and byte-exact block checks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

POISON = 0xA5
Cache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V)


def random_tensor(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    esize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(1, 256, list(shape[:-1]) + [shape[-1] * esize], dtype=torch.int32, generator=gen)
    return raw.to(torch.uint8).view(dtype)


def make_cache(
    layers: int,
    blocks: int,
    block_size: int,
    k_row: tuple[int, int],
    v_row: tuple[int, int],
    k_dtype: torch.dtype,
    v_dtype: torch.dtype,
    seed: int,
) -> Cache:
    """`layers` of (K `[blocks, block_size, *k_row]`, V `[blocks, block_size, *v_row]`), random bytes."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (random_tensor([blocks, block_size, *k_row], k_dtype, gen), random_tensor([blocks, block_size, *v_row], v_dtype, gen))
        for _ in range(layers)
    ]


def mla_cache(layers: int, blocks: int, block_size: int, k_dtype: torch.dtype, v_dtype: torch.dtype, seed: int) -> Cache:
    """DeepSeek-style split K/V: K = the latent `[blocks, block_size, 1, 512]`, V = the rope part `[..., 1, 64]`."""
    return make_cache(layers, blocks, block_size, (1, 512), (1, 64), k_dtype, v_dtype, seed)


def as_dict(cache: Cache) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The cache as vLLM hands it to a connector: layer name -> (K, V)."""
    return {f"model.layers.{i}.self_attn.attn": kv for i, kv in enumerate(cache)}


def poison(cache: Cache) -> None:
    """Overwrite every byte in place (the registered addresses stay valid)."""
    for pair in cache:
        for t in pair:
            t.view(torch.uint8).fill_(POISON)


def copy_blocks(dst: Cache, dst_ids: Sequence[int], src: Cache, src_ids: Sequence[int]) -> None:
    """Place the content of src's blocks into dst's blocks (another rank's cache holding the same KV)."""
    for (dk, dv), (sk, sv) in zip(dst, src):
        dk[list(dst_ids)] = sk[list(src_ids)]
        dv[list(dst_ids)] = sv[list(src_ids)]


def block_bytes(cache: Cache, block: int) -> bytes:
    return b"".join(t[block].contiguous().view(torch.uint8).numpy().tobytes() for pair in cache for t in pair)


def assert_blocks_equal(dst: Cache, dst_ids: Sequence[int], src: Cache, src_ids: Sequence[int]) -> None:
    for d, s in zip(dst_ids, src_ids):
        assert block_bytes(dst, d) == block_bytes(src, s), f"block {d} differs from source block {s}"


def assert_poisoned(cache: Cache, block_ids: Sequence[int]) -> None:
    for b in block_ids:
        for pair in cache:
            for t in pair:
                assert bool((t[b].contiguous().view(torch.uint8) == POISON).all()), f"block {b} was written"


def all_blocks_except(cache: Cache, written: Sequence[int]) -> list[int]:
    return [b for b in range(int(cache[0][0].shape[0])) if b not in set(written)]

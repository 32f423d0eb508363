"""What `EmsConnector` refuses at start, and whose `kv_load_failure_policy` applies.

Contract:
* `check_supported(vllm_config, kv_cache_config)` raises `ValueError` with a message naming the setting when the
  connector's block math (one engine block = one pool value per TP rank, every block of a prompt held by this
  rank, full attention) does not hold: pipeline parallelism, decode- or prefill-context parallelism (blocks'
  tokens sharded across ranks), several KV cache groups (hybrid models), a group that is not full attention
  (sliding-window and other specs free or reuse blocks inside a prompt, so a block id may hold no prompt KV), a
  block size that is not a multiple of the hash block size.
* `apply_failure_policy(kv_transfer_config, extra_policy)`: the pool is a best-effort cache, so a load that comes up
  short (a node died; a lease broken) recomputes by default: where the top level says vLLM's default ("fail", which
  cannot be told apart from an explicit "fail"), the policy becomes the extra-config key `load_failure_policy`, or
  "recompute" without one; a top-level "recompute" stands, and an extra key that contradicts it is refused rather
  than silently dropped. So requests fail on a short load only where the extra config says "fail".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

VLLM_DEFAULT_POLICY = "fail"
CACHE_DEFAULT_POLICY = "recompute"  # the connector's own default: a short load costs recomputation, not the request


def check_supported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ValueError("EmsConnector does not support pipeline parallelism (pipeline_parallel_size > 1)")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(parallel, name, 1) or 1)
        if size > 1:
            raise ValueError(
                f"EmsConnector does not support context parallelism ({name}={size}): it shards a block's tokens "
                "across ranks, and the connector moves each rank's whole blocks"
            )
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"EmsConnector supports one KV cache group, this model has {len(groups)} (hybrid model)")
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or getattr(spec, "sliding_window", None) is not None:
        raise ValueError(
            f"EmsConnector supports full-attention KV caches (standard or MLA), this model's is {type(spec).__name__}"
        )
    block_size = int(vllm_config.cache_config.block_size)
    hash_block_size = int(kv_cache_config.hash_block_size or block_size)
    if block_size % hash_block_size:
        raise ValueError(f"block size {block_size} is not a multiple of the hash block size {hash_block_size}")


def apply_failure_policy(kv_transfer_config: KVTransferConfig, extra_policy: str | None) -> str:
    """Set vLLM's `kv_load_failure_policy` where the top level says vLLM's default: the extra-config key, else
    "recompute" (see the module contract); return the policy in force."""
    top = str(kv_transfer_config.kv_load_failure_policy)
    if extra_policy is None:
        extra_policy = CACHE_DEFAULT_POLICY if top == VLLM_DEFAULT_POLICY else top
    if extra_policy == top:
        return top
    if top != VLLM_DEFAULT_POLICY:
        raise ValueError(
            f"kv_load_failure_policy={top!r} (top level) and kv_connector_extra_config.load_failure_policy="
            f"{extra_policy!r} disagree: set one of them"
        )
    kv_transfer_config.kv_load_failure_policy = extra_policy
    return extra_policy

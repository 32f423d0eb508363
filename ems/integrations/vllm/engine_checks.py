"""What `EmsConnector` refuses at start, and whose `kv_load_failure_policy` applies.

Contract:
* `check_supported(vllm_config, kv_cache_config)` raises `ValueError` with a message naming the setting when the
  connector's block math (one engine block = one pool value per TP rank and KV cache group, every block of a
  prompt held by this rank) does not hold: pipeline parallelism, decode- or prefill-context parallelism (blocks'
  tokens sharded across ranks), a block size that is not a multiple of the hash block size. One KV cache group
  must be full attention (standard or MLA), as before. Several groups (a hybrid model under vLLM's hybrid memory
  allocator) must each be `GroupKind.FULL` (full attention) or `GroupKind.SLIDING` (sliding-window attention),
  all with the engine's block size: anything else (recurrent/Mamba state, chunked-local, cross or sink
  attention, ...) is refused with the model's group kinds named (`group_kinds`), rather than served wrong.
* `apply_failure_policy(kv_transfer_config, extra_policy)`: the pool is a best-effort cache, so a load that comes up
  short (a node died; a lease broken) recomputes by default: where the top level says vLLM's default ("fail", which
  cannot be told apart from an explicit "fail"), the policy becomes the extra-config key `load_failure_policy`, or
  "recompute" without one; a top-level "recompute" stands, and an extra key that contradicts it is refused rather
  than silently dropped. So requests fail on a short load only where the extra config says "fail".
* `sharing_warning(vllm_config, environ)`: the message (None when none applies) for a configuration whose blocks can
  never be shared with another process: vLLM's non-cryptographic prefix hashing (`prefix_caching_hash_algo` xxhash,
  xxhash_cbor; builtin in older vLLM) without `PYTHONHASHSEED` seeds every block hash chain with random bytes per
  process (vLLM's `kv_cache_utils.resolve_none_hash_seed`), so no other engine, nor this one after a restart, ever
  finds its blocks. The connector logs it as a warning at start, naming the fix. `prefix_hash_part` is the same fact
  as a namespace-record part (`ems.store.ns_records`): the algorithm and where its seed comes from.
"""

from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

VLLM_DEFAULT_POLICY = "fail"
CACHE_DEFAULT_POLICY = "recompute"  # the connector's own default: a short load costs recomputation, not the request
# prefix hashes vLLM seeds with per-process random bytes unless PYTHONHASHSEED is set (`resolve_none_hash_seed`)
RANDOM_SEEDED_HASH_ALGOS = frozenset({"xxhash", "xxhash_cbor", "builtin"})


def _hash_algo(vllm_config: VllmConfig) -> str:
    return str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))


def sharing_warning(vllm_config: VllmConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """The start-up warning of a configuration that can never share blocks across processes (module contract)."""
    algo = _hash_algo(vllm_config)
    if algo not in RANDOM_SEEDED_HASH_ALGOS or environ.get("PYTHONHASHSEED") is not None:
        return None
    return (
        f"EmsConnector: prefix_caching_hash_algo={algo!r} without PYTHONHASHSEED: vLLM seeds its block hashes with "
        "random bytes in every process, so no other engine (nor this one after a restart) will ever hit the blocks "
        "this engine saves to the pool. Fix: set PYTHONHASHSEED to the same value for every engine (e.g. "
        "PYTHONHASHSEED=0 in the environment of `vllm serve`), or use --prefix-caching-hash-algo sha256"
    )


def prefix_hash_part(vllm_config: VllmConfig, environ: Mapping[str, str] = os.environ) -> str:
    """The prefix hashing as a namespace-record part: `ALGO;seed=SOURCE` (`random-per-process`, `default`, or a
    digest of PYTHONHASHSEED: engines with other seeds never share)."""
    algo = _hash_algo(vllm_config)
    seed = environ.get("PYTHONHASHSEED")
    if seed is not None:
        source = "PYTHONHASHSEED:" + hashlib.blake2b(seed.encode(), digest_size=4).hexdigest()
    else:
        source = "random-per-process" if algo in RANDOM_SEEDED_HASH_ALGOS else "default"
    return f"{algo};seed={source}"


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
    block_size = int(vllm_config.cache_config.block_size)
    if len(groups) > 1:
        kinds = [group_kind(g.kv_cache_spec) for g in groups]
        if None in kinds:
            raise ValueError(
                "EmsConnector pools hybrid models whose KV cache groups are all full or sliding-window attention; "
                f"this model's groups are {group_kinds(groups)} (recurrent/Mamba state and other kinds are not pooled)"
            )
        sizes = {int(g.kv_cache_spec.block_size) for g in groups}
        if sizes != {block_size}:
            raise ValueError(
                f"EmsConnector needs every KV cache group in blocks of the engine's block size {block_size}; this "
                f"model's groups are {group_kinds(groups)}"
            )
    elif len(groups) == 1:
        spec = groups[0].kv_cache_spec
        if not isinstance(spec, FullAttentionSpec) or getattr(spec, "sliding_window", None) is not None:
            raise ValueError(
                f"EmsConnector supports full-attention KV caches (standard or MLA) and hybrid models of full and "
                f"sliding-window groups; this model's is {group_kinds(groups)}"
            )
    else:
        raise ValueError("EmsConnector: this model has no KV cache group (nothing to pool)")
    hash_block_size = int(kv_cache_config.hash_block_size or block_size)
    if block_size % hash_block_size:
        raise ValueError(f"block size {block_size} is not a multiple of the hash block size {hash_block_size}")


class GroupKind(str, enum.Enum):
    """What a KV cache group of a hybrid model holds, as the connector moves it."""

    FULL = "full"  # full attention (standard or MLA): every block of a prompt is kept
    SLIDING = "sliding"  # sliding-window attention: vLLM keeps (null-pads the rest) only the window's blocks


def group_kind(spec: Any) -> GroupKind | None:
    """The kind of a hybrid model's group spec, None where the connector does not pool it. Exact classes: a
    subclass (reversed or sink windows, hidden-state caches, Mamba) frees or fills blocks by other rules."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowMLASpec, SlidingWindowSpec

    if type(spec) in (FullAttentionSpec, MLAAttentionSpec) and getattr(spec, "sliding_window", None) is None:
        return GroupKind.FULL
    if type(spec) in (SlidingWindowSpec, SlidingWindowMLASpec) and not getattr(spec, "extra_retained_tokens", 0):
        return GroupKind.SLIDING
    return None


def group_kinds(groups: Any) -> str:
    """The model's KV cache groups as an error message names them: `[SlidingWindowSpec (window 64) x 2 layers, ...]`."""
    parts = []
    for g in groups:
        spec = g.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        detail = f" (window {window})" if window is not None else ""
        size = getattr(spec, "block_size", None)
        parts.append(f"{type(spec).__name__}{detail}, block {size}, x {len(g.layer_names)} layers")
    return "[" + "; ".join(parts) + "]"


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

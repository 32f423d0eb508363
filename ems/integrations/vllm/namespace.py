"""The key namespace of a vLLM engine: everything that decides the bytes inside one of its KV blocks.

Blocks move between engines as opaque bytes, so two engines may share a block only when every input to those
bytes agrees. `namespace_parts(vllm_config, kv_cache_config)` lists them (name -> canonical text), and
`connector_config.derive_model_id(model, parts)` digests them into the `model_id` every process of the engine
passes to `Ems.init` (the pool's key namespace). What goes in:

* the weights: model path, revision and code revision, `load_format` (and, for random "dummy" weights, the seed),
  `model_impl`, `model_class_overrides`, `quantization` and `quantization_config` (on-the-fly quantization);
* the architecture as vLLM resolved it: the whole HF config after `hf_overrides` (so another `rope_theta`,
  rope scaling or any overridden field changes the namespace), plus the overrides themselves, `dtype`,
  `disable_sliding_window`;
* the cache: vLLM's own `CacheConfig.compute_hash()` (block size, KV cache dtype, KV scales, ...), the KV cache
  spec of the engine's group (kind, heads, head size, dtype, quantisation mode, page padding, ...; a hybrid model:
  every group's spec and layers, so a model whose groups change never reads another's blocks) and the KV cache
  layout the engine core resolved (`kv_cache_config.kv_cache_layout`);
* attention: vLLM's `AttentionConfig.compute_hash()` (the requested backend and its knobs) and the backend vLLM
  selects for this spec (`predicted_backend`; each worker checks that its layers really use it);
* the platform (`device_type`, `device_name`) and vLLM's version (layouts change between versions).

Deliberately left out (they do not change the bytes): `max_model_len`, memory settings, the tokenizer, sampling,
parallel sizes (the TP rank and size are folded into each key by `block_transfer`; pipeline and context
parallelism are refused). Engines that differ in anything listed above never share a block; the price of a field
that did not need to be there is only misses.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# HF config entries that name where or with what the config was written, not what the model computes
_HF_NOT_MODEL = ("_name_or_path", "transformers_version", "_commit_hash", "name_or_path")


def _canonical(value: Any) -> str:
    """Deterministic text of a config value (sorted keys; objects by their repr)."""
    return json.dumps(value, sort_keys=True, default=repr)


def _hf_config_text(hf_config: Any) -> str:
    data = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    for key in _HF_NOT_MODEL:
        data.pop(key, None)
    return _canonical(data)


def predicted_backend(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
    """The attention backend vLLM selects for this engine's KV cache spec (what the workers' layers use)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    model = vllm_config.model_config
    with set_current_vllm_config(vllm_config):
        backend = get_attn_backend(
            head_size=int(spec.head_size),
            dtype=model.dtype,
            kv_cache_dtype=vllm_config.cache_config.cache_dtype,
            use_mla=bool(model.use_mla),
            has_sliding_window=getattr(spec, "sliding_window", None) is not None,
        )
    return str(backend.get_name())


def namespace_parts(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, platform: str | None = None) -> dict[str, str]:
    """Everything that decides a block's bytes, as name -> canonical text (see the module contract).
    `platform` defaults to vLLM's current platform (`device_type/device_name`)."""
    import vllm
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    load = vllm_config.load_config
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    load_format = str(getattr(load.load_format, "value", load.load_format))
    parts = {
        "model": str(model.model),
        "revision": str(model.revision),
        "code_revision": str(model.code_revision),
        "load_format": load_format,
        # random weights differ by seed: blocks of two dummy-weight engines with other seeds must not mix
        "dummy_seed": str(model.seed) if load_format == "dummy" else "",
        "model_impl": str(getattr(model, "model_impl", "")),
        "model_class_overrides": _canonical(getattr(model, "model_class_overrides", None)),
        "quantization": str(model.quantization),
        "quantization_config": _canonical(getattr(model, "quantization_config", None)),
        "dtype": str(model.dtype),
        "hf_config": _hf_config_text(model.hf_config),
        "hf_text_config": _hf_config_text(model.hf_text_config),
        "hf_overrides": _canonical(model.hf_overrides if not callable(model.hf_overrides) else repr(model.hf_overrides)),
        "disable_sliding_window": str(model.disable_sliding_window),
        "cache_config": vllm_config.cache_config.compute_hash(),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "block_size": str(vllm_config.cache_config.block_size),
        "kv_cache_spec": f"{type(spec).__name__}{spec!r}",
        "kv_cache_layout": str(kv_cache_config.kv_cache_layout),
        "attention_config": vllm_config.attention_config.compute_hash(),
        "attention_backend": predicted_backend(vllm_config, kv_cache_config),
        "platform": platform or f"{current_platform.device_type}/{current_platform.device_name}",
        "vllm": str(vllm.__version__),
    }
    groups = kv_cache_config.kv_cache_groups
    if len(groups) > 1:  # (one group: the parts as before, so its blocks keep their namespace)
        parts["kv_cache_groups"] = _canonical(
            [[f"{type(g.kv_cache_spec).__name__}{g.kv_cache_spec!r}", sorted(g.layer_names)] for g in groups]
        )
    return parts

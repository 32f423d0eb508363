"""The vLLM key namespace (`namespace_parts` -> `derive_model_id`) on real vLLM configs of a tiny local model:
every setting that decides a KV block's bytes gives another model id (so two engines differing there never share a
block), settings that do not leave it alone; and what the connector refuses or which failure policy applies.

Runs where vllm is importable (CI: `.venv-vllm`); skipped otherwise. No engine is started.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")

HERE = os.path.dirname(os.path.abspath(__file__))
LAYER = "model.layers.0.self_attn.attn"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ns") / "model")
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {HERE!r}); import vllm_engine; vllm_engine.make_tiny_llama({path!r})",
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    return path


def kv_cache_config(layout=None, kv_heads=2, block_size=32, dtype=None, spec_cls=None, groups=1, specs=None):
    """One group of `spec_cls` (or `groups` equal ones), or one group per spec of `specs` (a hybrid model)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec_cls = spec_cls or FullAttentionSpec
    spec = spec_cls(block_size=block_size, num_kv_heads=kv_heads, head_size=32, dtype=dtype or torch.bfloat16)
    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"{LAYER}{g}"], s) for g, s in enumerate(specs or [spec] * groups)],
        kv_cache_layout=layout,
    )


def attention(block_size=32, window=None):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    common = dict(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    return FullAttentionSpec(**common) if window is None else SlidingWindowSpec(sliding_window=window, **common)


def vllm_config(model_dir, model=None, cache=None, load=None, attention=None, parallel=None):
    from vllm.config import AttentionConfig, CacheConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, **{"dtype": "bfloat16", **(model or {})}),
        cache_config=CacheConfig(**{"block_size": 32, **(cache or {})}),
        load_config=LoadConfig(**(load or {})),
        attention_config=AttentionConfig(**(attention or {})),
        parallel_config=ParallelConfig(**(parallel or {})),
    )


def model_id(model_dir, kv=None, platform=None, **settings):
    from ems.integrations.connector_config import derive_model_id
    from ems.integrations.vllm.namespace import namespace_parts

    return derive_model_id(
        model_dir, namespace_parts(vllm_config(model_dir, **settings), kv_cache_config(**(kv or {})), platform)
    )


# each case differs from the base engine (the model's own config, bf16, block 32, CPU) in one setting that decides
# the bytes of a block
BYTE_DECIDING = {
    "dtype": dict(model={"dtype": "float16"}),
    "hf_overrides rope_theta": dict(model={"hf_overrides": {"rope_theta": 5000.0}}),
    "hf_overrides max_position_embeddings": dict(model={"hf_overrides": {"max_position_embeddings": 8192}}),
    "on-the-fly quantization": dict(model={"quantization": "fp8"}),
    "kv cache dtype": dict(cache={"cache_dtype": "fp8_e5m2"}),
    "block size": dict(cache={"block_size": 64}, kv={"block_size": 64}),
    "dummy weights": dict(load={"load_format": "dummy"}),
    "model implementation": dict(model={"model_impl": "transformers"}),
    "revision": dict(model={"revision": "0123abcd"}),
    "attention backend": dict(attention={"backend": "CPU_ATTN"}),
    "kv cache layout": dict(kv={"layout": "HND"}),
    "kv cache spec": dict(kv={"kv_heads": 4}),
    "platform": dict(platform="cuda/cuda"),
}


def test_every_byte_deciding_setting_changes_the_namespace(model_dir):
    base = model_id(model_dir)
    assert base == model_id(model_dir)  # deterministic
    ids = {"base": base}
    for name, settings in BYTE_DECIDING.items():
        ids[name] = model_id(model_dir, **settings)
        assert ids[name] != base, name
    assert len(set(ids.values())) == len(ids), "two different settings gave one namespace"
    # random weights: another seed is another model; a seed does not matter for real weights
    dummy = dict(load={"load_format": "dummy"})
    assert model_id(model_dir, **dummy) != model_id(model_dir, model={"seed": 1}, **dummy)
    assert model_id(model_dir, model={"seed": 1}) == base


def test_settings_that_do_not_decide_the_bytes_keep_the_namespace(model_dir):
    base = model_id(model_dir)
    assert model_id(model_dir, model={"max_model_len": 512}) == base
    assert model_id(model_dir, cache={"gpu_memory_utilization": 0.3}) == base
    assert model_id(model_dir, model={"enforce_eager": True}) == base


def test_the_namespace_names_the_backend_vllm_selects(model_dir):
    from ems.integrations.vllm.namespace import namespace_parts

    parts = namespace_parts(vllm_config(model_dir), kv_cache_config())
    assert parts["attention_backend"] == "CPU_ATTN" and parts["platform"].startswith("cpu/")
    assert (
        '"rope_theta": 5000.0'
        in namespace_parts(vllm_config(model_dir, model={"hf_overrides": {"rope_theta": 5000.0}}), kv_cache_config())[
            "hf_text_config"
        ]
    )


def test_unsupported_engines_are_refused_with_a_message(model_dir):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from ems.integrations.vllm.engine_checks import check_supported

    config = vllm_config(model_dir)
    check_supported(config, kv_cache_config())
    config.parallel_config.decode_context_parallel_size = 2  # the field as vLLM's argument parsing sets it
    with pytest.raises(ValueError, match="decode_context_parallel_size=2"):
        check_supported(config, kv_cache_config())
    config = vllm_config(model_dir)
    check_supported(config, kv_cache_config(specs=[attention(), attention(window=64)]))  # a hybrid model: pooled
    check_supported(config, kv_cache_config(groups=2))

    class Windowed(SlidingWindowSpec):
        def __init__(self, **kwargs):
            super().__init__(sliding_window=64, **kwargs)

    with pytest.raises(ValueError, match="full-attention"):
        check_supported(config, kv_cache_config(spec_cls=Windowed))


def test_hybrid_models_with_other_group_kinds_are_refused_naming_them(model_dir):
    """Recurrent (Mamba) state or any group kind other than full and sliding-window attention, or a group in other
    blocks than the engine's, is refused at start with the model's group kinds in the message."""
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec

    from ems.integrations.vllm.engine_checks import check_supported

    config = vllm_config(model_dir)
    mamba = MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.bfloat16,))
    with pytest.raises(ValueError, match=r"FullAttentionSpec, block 32, x 1 layers; MambaSpec, block 32"):
        check_supported(config, kv_cache_config(specs=[attention(), mamba]))
    local = ChunkedLocalAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, attention_chunk_size=64)
    with pytest.raises(ValueError, match="ChunkedLocalAttentionSpec"):
        check_supported(config, kv_cache_config(specs=[attention(), local]))
    with pytest.raises(ValueError, match=r"block size 32.*SlidingWindowSpec \(window 64\), block 16"):
        check_supported(config, kv_cache_config(specs=[attention(), attention(block_size=16, window=64)]))


def test_a_hybrid_models_groups_are_in_its_namespace(model_dir):
    """Another set of groups (another window, a layer in another group) is another namespace; one group keeps the
    namespace it had."""
    from ems.integrations.connector_config import derive_model_id
    from ems.integrations.vllm.namespace import namespace_parts

    def ident(kv):
        return derive_model_id(model_dir, namespace_parts(vllm_config(model_dir), kv))

    hybrid = ident(kv_cache_config(specs=[attention(), attention(window=64)]))
    assert hybrid != ident(kv_cache_config(specs=[attention(), attention(window=128)]))
    assert hybrid != ident(kv_cache_config())
    assert "kv_cache_groups" not in namespace_parts(vllm_config(model_dir), kv_cache_config())


def test_a_short_load_recomputes_unless_the_extra_config_says_fail():
    """vLLM's default "fail" cannot be told from an explicit one: the connector (a best-effort cache) recomputes
    there, unless its own key says "fail"; a top-level "recompute" stands."""
    from vllm.config import KVTransferConfig

    from ems.integrations.vllm.engine_checks import apply_failure_policy

    def transfer(**kwargs):
        return KVTransferConfig(kv_connector="EmsConnector", kv_role="kv_both", **kwargs)

    explicit = transfer(kv_load_failure_policy="recompute")
    assert apply_failure_policy(explicit, None) == "recompute" and explicit.kv_load_failure_policy == "recompute"
    default = transfer()
    assert apply_failure_policy(default, None) == "recompute" and default.kv_load_failure_policy == "recompute"
    default = transfer()
    assert apply_failure_policy(default, "recompute") == "recompute" and default.kv_load_failure_policy == "recompute"
    asked = transfer()
    assert apply_failure_policy(asked, "fail") == "fail" and asked.kv_load_failure_policy == "fail"
    said_twice = transfer(kv_load_failure_policy="fail")
    assert apply_failure_policy(said_twice, "fail") == "fail" and said_twice.kv_load_failure_policy == "fail"
    with pytest.raises(ValueError, match="disagree"):
        apply_failure_policy(transfer(kv_load_failure_policy="recompute"), "fail")


def test_a_hybrid_models_groups_are_registered_by_the_pages_they_alias():
    """vLLM lays every group's layers over one allocation: layer i of each group views the same pages, so the
    connector registers each index once (group 0's layer) and checks the others there; groups laid out with other
    strides (unequal pages) are refused."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    from ems.integrations.vllm.context import _aliased_layers

    full, sliding = ["l.1", "l.3"], ["l.0", "l.2"]
    groups = [KVCacheGroupSpec(full, attention()), KVCacheGroupSpec(sliding, attention(window=64))]

    def config(*tensors):
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=list(tensors), kv_cache_groups=groups)

    page = attention().page_size_bytes
    aliased = config(
        *(KVCacheTensor(size=16 * page, layers=g, layer_stride=8 * page, block_stride=page) for g in (full, sliding))
    )
    assert _aliased_layers(aliased) == (("l.1", "l.3"), (("l.0",), ("l.2",)))
    apart = config(
        KVCacheTensor(size=16 * page, layers=full, layer_stride=8 * page, block_stride=page),
        KVCacheTensor(size=16 * page, layers=sliding, layer_stride=4 * page, block_stride=page // 2),
    )
    with pytest.raises(ValueError, match="different pages"):
        _aliased_layers(apart)


def test_prefix_hashing_that_can_never_share_is_a_warning_naming_the_fix(model_dir, monkeypatch):
    """vLLM seeds xxhash prefix hashes with random bytes per process unless PYTHONHASHSEED is set (checked against
    vLLM's own seed resolution): the connector's start-up check says so and names the fix; sha256, or a seed, is fine."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

    from ems.integrations.vllm.engine_checks import prefix_hash_part, sharing_warning

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    xx = vllm_config(model_dir, cache={"prefix_caching_hash_algo": "xxhash"})
    fn = get_hash_fn_by_name("xxhash")
    assert resolve_none_hash_seed(fn) != resolve_none_hash_seed(fn)  # vLLM: another seed in every process
    message = sharing_warning(xx, environ={})
    assert message is not None and "PYTHONHASHSEED" in message and "--prefix-caching-hash-algo sha256" in message
    assert sharing_warning(vllm_config(model_dir, cache={"prefix_caching_hash_algo": "xxhash_cbor"}), environ={})
    assert sharing_warning(xx, environ={"PYTHONHASHSEED": "0"}) is None
    sha = vllm_config(model_dir)
    assert sharing_warning(sha, environ={}) is None
    sha_fn = get_hash_fn_by_name("sha256")
    assert resolve_none_hash_seed(sha_fn) == resolve_none_hash_seed(sha_fn)  # vLLM: shareable by default
    assert prefix_hash_part(xx, {}) == "xxhash;seed=random-per-process"
    assert prefix_hash_part(sha, {}) == "sha256;seed=default"
    assert prefix_hash_part(xx, {"PYTHONHASHSEED": "0"}) != prefix_hash_part(xx, {"PYTHONHASHSEED": "1"})


def test_two_vllm_engines_differing_in_block_size_are_told_that_part(model_dir):
    """The connector's record parts (`namespace_parts` and its own) of two engines that differ in block size only:
    the diagnosis names block_size and vLLM's flag for it, and nothing that does not differ."""
    from ems.integrations.vllm.namespace import namespace_parts
    from ems.store.ns_records import diagnosis, make_record

    def record(ns: bytes, block_size: int):
        parts = namespace_parts(vllm_config(model_dir, cache={"block_size": block_size}), kv_cache_config(block_size=block_size))
        return make_record(model_dir, ns, {**parts, "tp_size": "1"})

    mine, other = record(b"\x01" * 16, 16), record(b"\x02" * 16, 32)
    message = diagnosis(mine, [mine, other])
    assert message is not None and "block_size: this engine 16, the other 32" in message and "--block-size" in message
    said = {line.split(":")[0].strip() for line in message.splitlines()[1:]}
    assert "block_size" in said and not said & {"dtype", "model", "tp_size", "hf_config", "vllm", "platform"}


def test_the_connector_warns_at_start_and_describes_its_namespace_to_the_record(model_dir, caplog, monkeypatch):
    """`ConnectorContext.from_vllm` (the start of both halves): the warning for prefix hashing that never shares, and
    the record of the namespace the engine's client registers: the model path, vLLM's namespace parts, the TP size
    and the prefix hashing."""
    import logging

    from vllm.config import KVTransferConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    from ems import Ems
    from ems.integrations.vllm.context import ConnectorContext

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    config = vllm_config(model_dir, cache={"prefix_caching_hash_algo": "xxhash"})
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="EmsConnector", kv_role="kv_both", kv_connector_extra_config={"local_pool": "off"}
    )
    spec = attention()
    page = spec.page_size_bytes
    kv = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[KVCacheTensor(size=8 * page, layers=[LAYER], layer_stride=8 * page, block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)],
    )
    caplog.set_level(logging.WARNING, logger="ems.integrations.vllm")
    try:
        ctx = ConnectorContext.from_vllm(config, kv)
        warned = [r.getMessage() for r in caplog.records if r.name == "ems.integrations.vllm"]
        assert len(warned) == 1 and "PYTHONHASHSEED" in warned[0] and "xxhash" in warned[0]
        ctx.register_shadow()
        record = ctx.cc.namespace_watch.record()
        assert record is not None and record.model == model_dir
        assert record.parts["block_size"] == "32" and record.parts["tp_size"] == "1"
        assert record.parts["prefix_hash"] == "xxhash;seed=random-per-process"
        assert record.parts["dtype"] == "torch.bfloat16" and "model_id" not in record.parts  # (derived from the parts)
    finally:
        Ems.shutdown()

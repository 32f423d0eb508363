"""The EMS SDK's surface as engines use it: module paths and names, mutable configs checked at `Ems.init`,
identifiers as deployments write them, `EMS_RECOVERD_ERROR` and the init-retry flow it drives, credentials, and
the versioned value format (a value of another version is a miss, never a wrong block)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from cachelib import as_dict, assert_poisoned, make_cache, poison
from ems_testlib import free_port
from sdk_engines import (
    ACCESS_ID,
    LLM_ENGINE,
    MODEL_ID,
    V1Engine,
    option,
    whole_block_slots,
)

import ems
from ems import CcConfig, CcConfig_v1, Ems, EmsConfig, EmsErrorCode, EmsException

BS = 4


def _code(fn) -> EmsException:
    with pytest.raises(EmsException) as info:
        fn()
    return info.value


def test_sdk_module_paths_are_this_packages_types():
    from ems import ContextCache_v1, ContextCaching, KVCacheType
    from ems.cc_v1 import CcConfig_v1 as config_from_package
    from ems.cc_v1 import ContextCache_v1 as client_from_package
    from ems.cc_v1.cc_config import CcConfig_v1 as config_from_module
    from ems.cc_v1.cc_config import KVCacheType as kind_from_module

    assert ContextCache_v1 is ContextCaching is client_from_package
    assert kind_from_module is KVCacheType is ems.KvCacheType
    assert config_from_module is config_from_package is ems.CcConfig_v1
    assert {m.name for m in KVCacheType} >= {"GQA", "MHA", "MLA", "MQA"}
    for name in ("ContextCache_v1", "ContextCaching", "KVCacheType", "EmsErrorCode", "KvBufferWrapper"):
        assert name in ems.__all__
    Ems.init(EmsConfig(cc_config_v1=CcConfig_v1(0, 0, "m")))
    assert isinstance(Ems.get_cc(), ContextCache_v1)


def test_configs_are_mutable_and_checked_at_init():
    from ems.cc_v1.cc_config import KVCacheType

    cfg = CcConfig_v1(
        rank_id=1,
        device_id=1,
        model_id=MODEL_ID,
        tp_world_size=2,
        pp_world_size=1,
        rank_in_tp_group=1,
        rank_in_pp_group=0,
        llm_engine=LLM_ENGINE,
    )
    cfg.kvcache_type = KVCacheType.MLA
    assert cfg.shares_kv_across_tp
    cfg.rank_in_tp_group = 2  # broken after construction: refused at init, naming the field
    error = _code(lambda: Ems.init(EmsConfig(cc_config_v1=cfg)))
    assert error.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT and "rank_in_tp_group" in error.message()
    cfg.rank_in_tp_group = 1
    cfg.kvcache_type = "nonsense"
    assert "kvcache_type" in _code(lambda: Ems.init(EmsConfig(cc_config_v1=cfg))).message()
    cfg.kvcache_type = "mla"  # names in any case, normalised at init
    config = EmsConfig(access_id=ACCESS_ID, access_key="", cc_config_v1=cfg)
    Ems.init(config)
    Ems.init(config)  # the same config again: a no-op
    cfg.model_id = "another-model"  # changing the caller's object afterwards does not reach the running SDK
    assert Ems.get_cc()._cc_config.model_id == MODEL_ID
    assert Ems.get_cc()._cc_config.kvcache_type is KVCacheType.MLA
    assert _code(lambda: Ems.init(config)).status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT  # now another config


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_id", "cc_kvstore@_@ds_default_ns_001"),
        ("model_id", "Llama-3 70B/Instruct"),
        ("model_id", "模型"),
        ("llm_engine", "vllm@deepseek"),
        ("llm_engine", "MindIE:1.0"),
        ("access_id", "tenant@ns:1 A"),
    ],
)
def test_identifiers_as_deployments_write_them(field, value):
    kwargs = {"rank_id": 0, "device_id": 0, "model_id": "m", "llm_engine": "vllm"}
    access_id = ACCESS_ID
    if field == "access_id":
        access_id = value
    else:
        kwargs[field] = value
    Ems.init(EmsConfig(access_id=access_id, access_key="", cc_config_v1=CcConfig_v1(**kwargs)))
    assert Ems.get_cc() is not None


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: CcConfig(0, 0, "model\x00"), "model_id"),
        (lambda: CcConfig(0, 0, "m" * 513), "model_id"),
        (lambda: CcConfig_v1(0, 0, "m", llm_engine="vllm\n"), "llm_engine"),
        (lambda: Ems.init(EmsConfig(access_id="a\tb", access_key="")), "access_id"),
        (lambda: Ems.init(EmsConfig(access_id="é", access_key="")), "ASCII"),
        (lambda: Ems.init(EmsConfig(access_id="a", access_key="short")), "access_key"),
        (lambda: Ems.init(EmsConfig(access_key="A" * 40)), "access_id"),
    ],
)
def test_identifier_faults_are_named(make, needle):
    error = _code(make)
    assert error.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT and needle in error.message()


def test_every_error_code_is_documented():
    import ems.errors

    codes = list(EmsErrorCode)
    assert EmsErrorCode.EMS_RECOVERD_ERROR in codes and len({int(c) for c in codes}) == len(codes)
    for code in codes:
        assert code.name in ems.errors.__doc__


def test_recoverable_init_then_retry_when_healthy():
    """The V1 adapter's recovery: init fails with EMS_RECOVERD_ERROR while the pool is down, the health thread's
    `Ems.check_health()` turns True when a node comes up, init is retried and works."""
    pytest.importorskip("ucxx")
    port = free_port()
    engine = V1Engine(is_mla=True, pool_nodes=[f"127.0.0.1:{port}"], connect_timeout_ms=500)
    assert engine.context_caching is None and engine.need_reinit
    assert engine.init_error.status_code() == EmsErrorCode.EMS_RECOVERD_ERROR
    assert Ems.get_cc() is None and Ems.check_health() is False
    from pool_testlib import PoolProcess

    node = PoolProcess("64MiB", port=port)  # now a node listens where the engine was pointed
    try:
        deadline = time.monotonic() + 20
        while not Ems.check_health():
            assert time.monotonic() < deadline, "check_health never saw the node"
            time.sleep(0.2)
        assert engine.init_ems() and engine.context_caching is Ems.get_cc()
        cache = make_cache(2, 4, BS, (1, 512), (1, 64), torch.bfloat16, torch.bfloat16, 3)
        engine.register_kv_caches(as_dict(cache))
        assert engine.context_caching.save(whole_block_slots([1], BS), [-42], [BS], option()).success == 1
    finally:
        Ems.shutdown()
        node.cleanup()


def test_credentials_refused_at_init_are_not_recoverable(pool_nodes):
    pytest.importorskip("ucxx")
    from pool_testlib import KEY_A

    node = pool_nodes(keys={ACCESS_ID: KEY_A})
    anonymous = V1Engine(pool_nodes=[node.address], access_key="")
    assert anonymous.context_caching is None and not anonymous.need_reinit
    assert anonymous.init_error.status_code() == EmsErrorCode.EMS_IO_ERROR
    wrong = V1Engine(pool_nodes=[node.address], access_key="B" * 40)
    assert wrong.init_error.status_code() == EmsErrorCode.EMS_IO_ERROR and not wrong.need_reinit
    right = V1Engine(pool_nodes=[node.address], access_key=KEY_A)
    assert right.context_caching is not None, right.init_error


def test_a_value_of_another_format_version_is_a_miss():
    from ems.store.value_format import HEADER_DTYPE, VERSION, is_well_formed

    engine = V1Engine()
    cache = make_cache(2, 4, BS, (1, 512), (1, 64), torch.float16, torch.float32, 5)
    engine.register_kv_caches(as_dict(cache))
    cc = engine.context_caching
    assert cc.save(whole_block_slots([0, 1], BS), [11, 12], [BS] * 2, option()).success == 2
    store = Ems._pool.store
    ((key, value),) = [(k, v) for k, v in store._entries.items() if k.endswith((12).to_bytes(1, "little"))]
    older = bytearray(value)
    header = np.frombuffer(older, dtype=HEADER_DTYPE, count=1)
    header["version"] = VERSION - 1  # a well-formed value of the previous format, same bytes otherwise
    assert is_well_formed(bytes(older))  # a node keeps it (clients and nodes upgrade in any order)
    store._entries[key] = bytes(older)
    poison(cache)
    assert cc.load(whole_block_slots([2, 3], BS), [11, 12], [BS] * 2, option()).success == 1
    assert_poisoned(cache, [0, 1, 3])

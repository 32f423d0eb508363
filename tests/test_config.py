"""Configuration: EmsConfig pool settings from arguments, environment variables and defaults; SDK field checks."""

from __future__ import annotations

import pytest

from ems import CcConfig, CcConfig_v1, Ems, EmsConfig, EmsErrorCode, EmsException, KvCacheType
from ems.config import parse_size
from ems.kernels import KernelBackend
from ems.settings import resolve_settings

# no EMS_* settings in the environment and no initialised `Ems`, before and after each test
pytestmark = pytest.mark.usefixtures("clean_ems")

VALID_KEY = "A" * 31 + "b+/="


def _invalid(fn, *needles):
    with pytest.raises(EmsException) as info:
        fn()
    assert info.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    for needle in needles:
        assert needle in info.value.message(), info.value.message()


def test_defaults():
    s = resolve_settings(EmsConfig())
    assert s.pool_nodes == () and s.embedded
    assert s.pool_capacity == 1 << 30
    assert s.read_cache_capacity == 256 << 20
    assert s.staging_capacity == 512 << 20
    assert s.max_inflight == 8
    assert s.kernel_backend == KernelBackend.AUTO
    assert s.connect_timeout_ms == 3000
    assert s.device is None


def test_environment_variables(monkeypatch):
    monkeypatch.setenv("EMS_POOL_CAPACITY", "2MiB")
    monkeypatch.setenv("EMS_KERNEL_BACKEND", "MEMCPY")
    monkeypatch.setenv("EMS_MAX_INFLIGHT", "3")
    monkeypatch.setenv("EMS_STAGING_CAPACITY", "1000000")
    monkeypatch.setenv("EMS_READ_CACHE_CAPACITY", "0")
    monkeypatch.setenv("EMS_CONNECT_TIMEOUT_MS", "250")
    monkeypatch.setenv("EMS_POOL_NODES", "10.0.0.1:7000, host-b:7001")
    monkeypatch.setenv("EMS_DEVICE", "cpu")
    s = resolve_settings(EmsConfig())
    assert s.pool_capacity == 2 << 20
    assert s.kernel_backend == KernelBackend.MEMCPY
    assert s.max_inflight == 3
    assert s.staging_capacity == 1_000_000
    assert s.read_cache_capacity == 0
    assert s.connect_timeout_ms == 250
    assert s.pool_nodes == ("10.0.0.1:7000", "host-b:7001") and not s.embedded
    assert s.device == "cpu"
    # explicit arguments win over the environment
    s = resolve_settings(EmsConfig(pool_capacity=4096, kernel_backend="torch", max_inflight=1, pool_nodes=[]))
    assert (s.pool_capacity, s.kernel_backend, s.max_inflight, s.pool_nodes) == (4096, KernelBackend.TORCH, 1, ())


def test_mooncake_settings_from_environment_and_defaults(monkeypatch):
    assert resolve_settings(EmsConfig()).pool_backend.value == "ems" and resolve_settings(EmsConfig()).mooncake is None
    monkeypatch.setenv("EMS_POOL_BACKEND", "mooncake")
    _invalid(lambda: resolve_settings(EmsConfig()), "mooncake_master")
    monkeypatch.setenv("EMS_MOONCAKE_MASTER", "mc-master:50051")
    s = resolve_settings(EmsConfig(pool_replicas=3))
    assert not s.embedded and s.pool_replicas == 3
    assert s.mooncake is not None and s.mooncake.master == "mc-master:50051"
    assert (s.mooncake.metadata, s.mooncake.protocol, s.mooncake.devices) == ("P2PHANDSHAKE", "tcp", "")
    assert (s.mooncake.buffer_bytes, s.mooncake.segment_bytes, s.mooncake.hostname) == (64 << 20, 0, "127.0.0.1")
    for env, value in (
        ("EMS_MOONCAKE_METADATA", "etcd://10.0.0.1:2379"),
        ("EMS_MOONCAKE_PROTOCOL", "RDMA"),
        ("EMS_MOONCAKE_DEVICES", "mlx5_0,mlx5_1"),
        ("EMS_MOONCAKE_BUFFER", "1GiB"),
        ("EMS_MOONCAKE_SEGMENT", "2GiB"),
        ("EMS_MOONCAKE_HOSTNAME", "10.0.0.7"),
    ):
        monkeypatch.setenv(env, value)
    m = resolve_settings(EmsConfig()).mooncake
    assert m is not None and (m.metadata, m.protocol, m.devices) == ("etcd://10.0.0.1:2379", "rdma", "mlx5_0,mlx5_1")
    assert (m.buffer_bytes, m.segment_bytes, m.hostname) == (1 << 30, 2 << 30, "10.0.0.7")


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"pool_backend": "redis"}, "pool_backend"),
        ({"pool_backend": "mooncake", "mooncake_master": "no-port"}, "mooncake_master"),
        ({"pool_backend": "mooncake", "mooncake_master": "h:70000"}, "mooncake_master"),
        ({"pool_backend": "mooncake", "mooncake_master": "h:1", "pool_nodes": ["n:1"]}, "pool_nodes"),
        ({"pool_backend": "mooncake", "mooncake_master": "h:1", "pool_etcd": "http://e:2379"}, "pool_etcd"),
        ({"pool_backend": "mooncake", "mooncake_master": "h:1", "mooncake_protocol": "tcp; rm"}, "mooncake_protocol"),
        ({"pool_backend": "mooncake", "mooncake_master": "h:1", "mooncake_buffer": 0}, "mooncake_buffer"),
        ({"pool_backend": "mooncake", "mooncake_master": "h:1", "mooncake_metadata": ""}, "mooncake_metadata"),
    ],
)
def test_bad_mooncake_settings_are_named(kwargs, needle):
    _invalid(lambda: resolve_settings(EmsConfig(**kwargs)), needle)


def test_environment_reaches_ems_init(monkeypatch):
    monkeypatch.setenv("EMS_POOL_CAPACITY", "3MiB")
    monkeypatch.setenv("EMS_KERNEL_BACKEND", "memcpy")
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    assert Ems.settings().pool_capacity == 3 << 20
    assert Ems._pool.store.capacity_bytes == 3 << 20
    from ems_testlib import make_cache

    cc = Ems.get_cc()
    cc.register_kvcache(make_cache(blocks=2, block_size=2))
    assert cc.kernel_backend == "memcpy"


@pytest.mark.parametrize(
    "env,value,needle",
    [
        ("EMS_KERNEL_BACKEND", "gpu", "kernel_backend"),
        ("EMS_MAX_INFLIGHT", "0", "max_inflight"),
        ("EMS_MAX_INFLIGHT", "many", "max_inflight"),
        ("EMS_POOL_CAPACITY", "lots", "pool_capacity"),
        ("EMS_POOL_CAPACITY", "0", "pool_capacity"),
        ("EMS_STAGING_CAPACITY", "0", "staging_capacity"),
        ("EMS_CONNECT_TIMEOUT_MS", "0", "connect_timeout_ms"),
        ("EMS_POOL_NODES", "nohost", "pool_nodes[0]"),
        ("EMS_POOL_NODES", "a:1,a:1", "twice"),
        ("EMS_POOL_NODES", "a:99999", "pool_nodes[0]"),
        ("EMS_POOL_NODES", "a:1,nohost", "pool_nodes[1]"),
        ("EMS_POOL_REPLICAS", "two", "pool_replicas"),
        ("EMS_POOL_HEDGE", "maybe", "pool_hedge"),
        ("EMS_POOL_CLUSTER", "Prod Cluster", "pool_cluster"),
        ("EMS_POOL_ETCD", "etcd-host", "pool_etcd"),
        ("EMS_POOL_BACKEND", "redis", "pool_backend"),
        ("EMS_POOL_PREFAULT", "some", "pool_prefault"),
        ("EMS_READ_CACHE_CAPACITY", "-1", "read_cache_capacity"),
    ],
)
def test_bad_environment_values(monkeypatch, env, value, needle):
    """The error names the variable the user set, and the setting it feeds."""
    monkeypatch.setenv(env, value)
    _invalid(lambda: resolve_settings(EmsConfig()), env, needle)
    _invalid(lambda: Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m"))), env, needle)
    assert Ems.get_cc() is None


def test_a_bad_keyword_is_named_as_the_keyword_even_with_the_variable_set(monkeypatch):
    monkeypatch.setenv("EMS_POOL_REPLICAS", "2")  # valid, and not what was used: the keyword wins
    with pytest.raises(EmsException) as info:
        resolve_settings(EmsConfig(pool_replicas="two"))
    assert info.value.message() == "pool_replicas must be an int >= 1, got 'two'"


def test_bad_mooncake_environment_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("EMS_POOL_BACKEND", "mooncake")
    monkeypatch.setenv("EMS_MOONCAKE_MASTER", "no-port")
    _invalid(lambda: resolve_settings(EmsConfig()), "EMS_MOONCAKE_MASTER (mooncake_master)")
    monkeypatch.setenv("EMS_MOONCAKE_MASTER", "h:1")
    monkeypatch.setenv("EMS_MOONCAKE_PROTOCOL", "tcp; rm")
    _invalid(lambda: resolve_settings(EmsConfig()), "EMS_MOONCAKE_PROTOCOL (mooncake_protocol)")
    monkeypatch.delenv("EMS_MOONCAKE_PROTOCOL")
    monkeypatch.setenv("EMS_MOONCAKE_BUFFER", "0")
    _invalid(lambda: resolve_settings(EmsConfig()), "EMS_MOONCAKE_BUFFER (mooncake_buffer)")
    monkeypatch.delenv("EMS_MOONCAKE_BUFFER")
    monkeypatch.setenv("EMS_POOL_NODES", "a:1")
    _invalid(lambda: resolve_settings(EmsConfig()), "EMS_POOL_BACKEND (pool_backend)", "EMS_POOL_NODES (pool_nodes)")
    _invalid(lambda: resolve_settings(EmsConfig(pool_backend="mooncake")), "pool_backend is", "EMS_POOL_NODES")


def test_bad_setting_arguments():
    _invalid(lambda: resolve_settings(EmsConfig(pool_capacity=-1)), "pool_capacity")
    _invalid(lambda: resolve_settings(EmsConfig(pool_capacity=True)), "pool_capacity")
    _invalid(lambda: resolve_settings(EmsConfig(pool_capacity=1.5)), "pool_capacity")
    _invalid(lambda: resolve_settings(EmsConfig(max_inflight=True)), "max_inflight")
    _invalid(lambda: resolve_settings(EmsConfig(pool_nodes=5)), "pool_nodes")
    _invalid(lambda: resolve_settings(EmsConfig(pool_nodes=[1])), "pool_nodes[0]")
    _invalid(lambda: resolve_settings(EmsConfig(device=0)), "device")


def test_parse_size():
    assert parse_size("x", "4096") == 4096
    assert parse_size("x", "512MiB") == 512 << 20
    assert parse_size("x", "4GiB") == 4 << 30
    assert parse_size("x", "1.5GB") == 1_500_000_000
    assert parse_size("x", "2k") == 2000
    assert parse_size("x", 7) == 7
    _invalid(lambda: parse_size("x", "-5"), "x")
    _invalid(lambda: parse_size("x", "5 parsecs"), "x")


def test_unknown_keyword_refused():
    _invalid(lambda: EmsConfig(pool_capcity="1GiB"), "pool_capcity")
    _invalid(lambda: EmsConfig(cc_config=None, bogus=1), "bogus")


def test_get_cc_none_without_cc_config():
    Ems.init(EmsConfig(pool_capacity="1MiB"))
    assert Ems.get_cc() is None
    assert Ems.check_health() is True


def test_cc_config_v1_gives_cc():
    Ems.init(EmsConfig(cc_config_v1=CcConfig_v1(rank_id=0, device_id=0, model_id="m", kvcache_type="GQA")))
    assert Ems.get_cc() is not None


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(access_key=VALID_KEY), "together"),
        (dict(access_id="ten\nant", access_key=VALID_KEY), "access_id"),
        (dict(access_id="ten\x00ant", access_key=""), "access_id"),
        (dict(access_id="t\u00e9nant", access_key=VALID_KEY), "ASCII"),
        (dict(access_id="", access_key=VALID_KEY), "access_id"),
        (dict(access_id="a" * 513, access_key=VALID_KEY), "access_id"),
        (dict(access_id="t", access_key="A" * 31), "access_key"),
        (dict(access_id="t", access_key="A" * 257), "access_key"),
        (dict(access_id="t", access_key="A" * 31 + "!"), "access_key"),
        (dict(access_id="t", access_key=12345), "access_key"),
    ],
)
def test_access_validation(kwargs, needle):
    _invalid(lambda: Ems.init(EmsConfig(**kwargs)), needle)
    assert Ems.check_health() is False


def test_access_valid_and_secret_not_in_repr():
    config = EmsConfig(access_id="a" * 512, access_key="Z" * 256, cc_config=CcConfig(0, 0, "m"), pool_capacity="1MiB")
    assert "Z" * 32 not in repr(config)
    Ems.init(config)
    assert Ems.get_cc() is not None
    Ems.shutdown()
    Ems.init(EmsConfig(access_id="t.e_n-1", access_key="0aZ+/=" * 6, pool_capacity="1MiB"))


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: CcConfig(rank_id=-1, device_id=0, model_id="m"), "rank_id"),
        (lambda: CcConfig(rank_id=True, device_id=0, model_id="m"), "rank_id"),
        (lambda: CcConfig(rank_id=0, device_id=-1, model_id="m"), "device_id"),
        (lambda: CcConfig(rank_id=0, device_id=0, model_id="llama\n"), "model_id"),
        (lambda: CcConfig(rank_id=0, device_id=0, model_id="\x7fm"), "model_id"),
        (lambda: CcConfig_v1(rank_id=0, device_id=0, model_id="m", llm_engine="vllm\t"), "llm_engine"),
        (lambda: CcConfig_v1(rank_id=0, device_id=0, model_id="m", llm_engine="v" * 513), "llm_engine"),
        (lambda: CcConfig(rank_id=0, device_id=0, model_id=""), "model_id"),
        (lambda: CcConfig(rank_id=0, device_id=0, model_id="m" * 513), "model_id"),
        (lambda: CcConfig(rank_id=0, device_id=0, model_id=None), "model_id"),
        (lambda: CcConfig(rank_id=0, device_id=0, model_id="m", tp_world_size=0), "tp_world_size"),
        (lambda: CcConfig(rank_id=0, device_id=0, model_id="m", pp_world_size=0), "pp_world_size"),
        (lambda: CcConfig_v1(rank_id=0, device_id=0, model_id="m", rank_in_tp_group=1), "rank_in_tp_group"),
        (lambda: CcConfig_v1(rank_id=0, device_id=0, model_id="m", rank_in_pp_group=-1), "rank_in_pp_group"),
        (lambda: CcConfig_v1(0, 0, "m", pp_world_size=2, rank_in_pp_group=2), "rank_in_pp_group"),
        (lambda: CcConfig_v1(rank_id=0, device_id=0, model_id="m", llm_engine=""), "llm_engine"),
        (lambda: CcConfig_v1(rank_id=0, device_id=0, model_id="m", kvcache_type="XYZ"), "kvcache_type"),
    ],
)
def test_cc_config_validation(make, needle):
    _invalid(make, needle)


def test_cc_config_valid_forms():
    c = CcConfig_v1(rank_id=3, device_id=1, model_id="llama2-13b", tp_world_size=4, rank_in_tp_group=3, kvcache_type="mla")
    assert c.kvcache_type == KvCacheType.MLA and c.shares_kv_across_tp
    assert not CcConfig_v1(0, 0, "m", kvcache_type=KvCacheType.GQA).shares_kv_across_tp
    assert CcConfig(rank_id=5, device_id=0, model_id="m", tp_world_size=2, pp_world_size=4).tp_rank == 1
    assert CcConfig(rank_id=0, device_id=0, model_id="m." + "x" * 510).model_id


def test_config_type_checks():
    _invalid(lambda: Ems.init(EmsConfig(cc_config="m")), "cc_config")
    _invalid(lambda: Ems.init(EmsConfig(cc_config_v1=CcConfig(0, 0, "m"))), "cc_config_v1")
    _invalid(lambda: Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "m"), cc_config_v1=CcConfig_v1(0, 0, "m"))), "cc_config")
    assert Ems.get_cc() is None


def test_bad_device_setting_fails_init_cleanly():
    _invalid(lambda: Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "m"), device="not-a-device")), "device")
    assert Ems.get_cc() is None and Ems.check_health() is False
    Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "m"), pool_capacity="1MiB"))
    assert Ems.get_cc() is not None


def test_sdk_log_directory(monkeypatch, tmp_path):
    import logging
    import os

    monkeypatch.setenv("EMS_SDK_LOG", str(tmp_path / "logs"))
    logger = logging.getLogger("ems")
    before = list(logger.handlers)
    try:
        Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "m"), pool_capacity="1MiB"))
        path = tmp_path / "logs" / f"ems-sdk-{os.getpid()}.log"
        for h in logger.handlers:
            h.flush()
        assert path.exists() and "EMS initialised" in path.read_text()
    finally:
        for h in logger.handlers[:]:
            if h not in before:
                logger.removeHandler(h)
                h.close()
        logger.setLevel(logging.NOTSET)


def test_profiling_logs_stages(monkeypatch, caplog):
    import logging

    from ems_testlib import make_cache

    monkeypatch.setenv("ENABLE_CC_PROFILING", "1")
    Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "m"), pool_capacity="1MiB"))
    cc = Ems.get_cc()
    cc.register_kvcache(make_cache(blocks=2, block_size=2))
    with caplog.at_level(logging.INFO, logger="ems.profile"):
        cc.save([0, 1], [1], [2])
        cc.load([0, 1], [1], [2])
    text = caplog.text
    assert "save 1/1 blocks" in text and "load 1/1 blocks" in text


def test_forcing_triton_where_it_cannot_run_is_an_invalid_argument(clean_ems, monkeypatch):
    """Without TRITON_INTERPRET the triton backend cannot serve CPU tensors: a clear EmsException, not a RuntimeError."""
    import torch

    from ems import CcConfig, Ems, EmsConfig, EmsErrorCode, EmsException
    from ems.kernels.select import get_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    get_backend.cache_clear()
    Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "m"), kernel_backend="triton"))
    kv = [[torch.randn(4, 4, 2, 8) for _ in range(2)]]
    try:
        Ems.get_cc().register_kvcache(kv)
    except EmsException as exc:
        assert exc.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
        assert "kernel_backend" in exc.message()
    else:  # the interpreter was already active in this process (kernel tests ran first): triton serves the CPU
        assert "triton" in Ems.get_cc().kernel_backend
    finally:
        get_backend.cache_clear()

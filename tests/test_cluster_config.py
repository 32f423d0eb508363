"""The cluster settings: pool_etcd, pool_cluster, pool_replicas (arguments, environment, defaults, bad values)."""

from __future__ import annotations

import pytest

from ems import CcConfig, Ems, EmsConfig, EmsErrorCode, EmsException
from ems.settings import resolve_settings

# no EMS_* settings in the environment and no initialised `Ems`, before and after each test
pytestmark = pytest.mark.usefixtures("clean_ems")


def _invalid(fn, needle):
    with pytest.raises(EmsException) as info:
        fn()
    assert info.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    assert needle in info.value.message(), info.value.message()


def test_defaults_keep_the_embedded_pool():
    s = resolve_settings(EmsConfig())
    assert (s.pool_etcd, s.pool_cluster, s.pool_replicas) == (None, "default", 1)
    assert s.embedded


def test_arguments_and_environment(monkeypatch):
    s = resolve_settings(EmsConfig(pool_etcd="http://10.0.0.9:2379", pool_cluster="prod-a", pool_replicas=3))
    assert (s.pool_etcd, s.pool_cluster, s.pool_replicas) == ("http://10.0.0.9:2379", "prod-a", 3)
    assert not s.embedded  # etcd alone (no pool_nodes) means remote nodes
    monkeypatch.setenv("EMS_POOL_ETCD", "http://127.0.0.1:2379")
    monkeypatch.setenv("EMS_POOL_CLUSTER", "blue")
    monkeypatch.setenv("EMS_POOL_REPLICAS", "2")
    s = resolve_settings(EmsConfig())
    assert (s.pool_etcd, s.pool_cluster, s.pool_replicas) == ("http://127.0.0.1:2379", "blue", 2)
    assert resolve_settings(EmsConfig(pool_replicas=1)).pool_replicas == 1  # an argument wins


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"pool_replicas": 0}, "pool_replicas"),
        ({"pool_replicas": True}, "pool_replicas"),
        ({"pool_replicas": 1.5}, "pool_replicas"),
        ({"pool_replicas": "two"}, "pool_replicas"),
        ({"pool_etcd": "127.0.0.1:2379"}, "pool_etcd"),
        ({"pool_etcd": "https://etcd:2379"}, "pool_etcd"),
        ({"pool_etcd": 2379}, "pool_etcd"),
        ({"pool_etcd": "http://etcd:2379/v3"}, "pool_etcd"),
        ({"pool_cluster": "Prod"}, "pool_cluster"),
        ({"pool_cluster": ""}, "pool_cluster"),
        ({"pool_cluster": "a/b"}, "pool_cluster"),
    ],
)
def test_bad_values_are_invalid_arguments(kwargs, needle, clean_ems):
    _invalid(lambda: resolve_settings(EmsConfig(**kwargs)), needle)
    _invalid(lambda: Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m"), **kwargs)), needle)
    assert Ems.get_cc() is None


def test_bad_environment_value(monkeypatch, clean_ems):
    monkeypatch.setenv("EMS_POOL_REPLICAS", "0")
    _invalid(lambda: resolve_settings(EmsConfig()), "pool_replicas")


def test_replicas_on_the_embedded_pool_are_harmless(clean_ems):
    import torch
    from ems_testlib import make_cache, slots_of_blocks

    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m"), pool_replicas=3))
    cc = Ems.get_cc()
    cache = make_cache(layers=1, blocks=4, block_size=4, heads=1, head_size=8, dtype=torch.float16)
    cc.register_kvcache(cache)
    assert cc.save(slots_of_blocks([0, 1], 4), [1, 2], [4, 4]).success == 2
    assert cc.load(slots_of_blocks([0, 1], 4), [1, 2], [4, 4]).success == 2

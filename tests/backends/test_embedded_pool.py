"""The embedded pool as a backend of its own (`ems.backends.embedded.EmbeddedPool`): what `Ems.init` builds without pool
nodes, the one-pass jobs and `exists` on its store, and the `PoolBackend` contract for the calls the pipelined jobs use."""

from __future__ import annotations

import time

import numpy as np
import pytest
from ems_testlib import keyed, make_cache

from ems import CcConfig, CcKvOption, CcResult, Ems, EmsConfig, EmsException
from ems.backends.base import PoolCall, ReadCheck
from ems.backends.embedded import EmbeddedPool
from ems.errors import EmsErrorCode
from ems.records import Deadline, JobKind
from ems.store.kv_store import KvStore
from ems.store.value_format import ExpectedValues, ValueKind, build_headers, checksum
from ems.transport.exists_holds import Hold

OPTION = CcKvOption()


def _values(n: int, size: int) -> list[bytes]:
    rng = np.random.default_rng(5)
    payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]
    expected = ExpectedValues(ValueKind.BLOCKS_V1, 7, np.arange(n, dtype=np.uint64), np.full(n, size, dtype=np.int64))
    headers = build_headers(expected, [checksum([p]) for p in payloads])
    return [h + p for h, p in zip(headers, payloads)]


@pytest.fixture
def pool():
    pool = EmbeddedPool(KvStore(1 << 20))
    yield pool
    pool.close()


def test_init_without_nodes_runs_the_one_pass_jobs_and_exists_on_the_embedded_pool():
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="embedded"), pool_capacity="8MiB"))
    try:
        cc = Ems.get_cc()
        assert cc is not None and Ems.check_health()
        cache = make_cache(layers=2, blocks=8, block_size=4)
        cc.register_kvcache(cache)
        assert cc.save([0, 1, 2, 3, 4, 5, 6, 7], [1, 2], [4, 4]) == CcResult(2, 2)
        assert cc.jobs.last(JobKind.SAVE).path == "one-pass"
        assert cc.exists([1, 2, 3]) == CcResult(2, 3)
        assert cc.exists([1, 2], lease_ms=60_000) == CcResult(2, 2)  # held: leased by the store
        assert cc.load([16, 17, 18, 19, 20, 21, 22, 23], [1, 2], [4, 4]) == CcResult(2, 2)
        assert cc.jobs.last(JobKind.LOAD).path == "one-pass"
        for layer in cache:
            for t in layer:
                assert t[4:6].equal(t[0:2])
        assert cc.metrics()["exists_calls"] == 2
    finally:
        Ems.shutdown()


def test_put_get_get_into_and_exists_answer_per_key_in_request_order(pool):
    values = _values(3, 100)
    keys = [b"a", b"b", b"c"]
    stored = pool.put(keyed(keys[:2], OPTION), [[v] for v in values[:2]])
    assert stored.results == [True, True] and stored.errors == [] and stored.nodes_contacted == 1
    got = pool.get(keyed(keys, OPTION))
    assert [None if v is None else bytes(v) for v in got.results] == [values[0], values[1], None]
    assert pool.read_check is ReadCheck.NONE  # the caller checks the values
    outs = [np.zeros(len(values[0]), np.uint8), np.zeros(len(values[1]) - 1, np.uint8), np.zeros(8, np.uint8)]
    placed = pool.get_into(keyed(keys, OPTION), outs)
    assert placed.results == [True, False, False]  # b: another length than its buffer; c: a miss
    assert outs[0].tobytes() == values[0]
    assert pool.exists(keyed(keys, OPTION)).results == [True, True, False]
    assert pool.exists(keyed(keys, OPTION), Hold.lease(60_000)).results == [True, True, False]
    assert pool.store.stats().leased_bytes > 0


def test_a_request_needs_one_route_key_and_one_expected_value_per_key():
    expected = ExpectedValues(ValueKind.BLOCKS_V1, 7, np.arange(2, dtype=np.uint64), np.full(2, 8, dtype=np.int64))
    for route_keys, keys, values in (([b"a"], [b"a", b"b"], None), ([b"a", b"b"], [b"a"], None), ([b"a"], [b"a"], expected)):
        with pytest.raises(EmsException) as raised:
            PoolCall(route_keys, keys, OPTION, expected=values)
        assert raised.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    request = keyed([b"a", b"b"], OPTION, expected=expected)
    assert request.deadline is None and request.until().left() > 0  # the option's timeout, from the call


def test_a_malformed_value_is_refused(pool):
    (value,) = _values(1, 64)
    damaged = bytearray(value)
    damaged[-1] ^= 0xFF
    assert pool.put(keyed([b"k"], OPTION), [[bytes(damaged)]]).results == [False]
    assert pool.exists(keyed([b"k"], OPTION)).results == [False]


def test_a_call_past_its_deadline_fails_its_keys_as_a_timeout(pool):
    values = _values(2, 32)
    past = Deadline(time.monotonic() - 1.0)
    outcome = pool.put(keyed([b"a", b"b"], OPTION, past), [[v] for v in values])
    assert outcome.results == [False, False] and outcome.unreachable
    error = outcome.first_error()
    assert error is not None and error.status_code() == EmsErrorCode.EMS_IO_TIMEOUT
    assert pool.exists(keyed([b"a"], OPTION)).results == [False]  # nothing was stored
    outs = [np.zeros(len(values[0]), np.uint8)]
    assert pool.put(keyed([b"a"], OPTION), [[values[0]]]).results == [True]
    late = pool.get_into(keyed([b"a"], OPTION, past), outs)
    assert late.results == [False] and late.unreachable


def test_no_keys_contact_nothing(pool):
    for outcome in (
        pool.put(keyed([], OPTION), []),
        pool.get(keyed([], OPTION)),
        pool.get_into(keyed([], OPTION), []),
        pool.exists(keyed([], OPTION)),
    ):
        assert outcome.results == [] and outcome.nodes_contacted == 0 and not outcome.unreachable


def test_it_lends_its_values_to_the_jobs_and_needs_no_staging_of_its_own(pool):
    assert pool.in_place is pool.store
    assert pool.shm_staging(1 << 10) is None
    assert pool.healthy(0.0) and pool.describe() == "embedded"
    with pytest.raises(ValueError):
        pool.get_into(keyed([b"a"], OPTION), [])

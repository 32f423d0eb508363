"""Cross-tenant attempts against a node with access keys: read, exists, overwrite, and handshake abuse (skipped
AUTH, a request before AUTH, a replayed MAC, a second HELLO, another tenant's MAC). Nothing of tenant alpha's may
reach or change for tenant beta, whatever beta sends."""

from __future__ import annotations

import pytest
from pool_testlib import KEY_A, KEY_B, joined, make_values
from raw_ucx import CLOSED, SILENT, RawSession, Reply

from ems.transport import metas, protocol

pytestmark = pytest.mark.slow
TENANTS = {"alpha": KEY_A, "beta": KEY_B}


@pytest.fixture(scope="module")
def keyed_node():
    from pool_testlib import PoolProcess

    node = PoolProcess("64MiB", TENANTS)
    yield node
    node.cleanup()


@pytest.fixture
def alpha_data(keyed_node, node_clients):
    alpha = node_clients(keyed_node.address, access_id="alpha", access_key=KEY_A)
    keys = [b"a-small", b"a-big"]
    values = [make_values(1, 5000, seed=1)[0], make_values(1, protocol.SEGMENT_BYTES, seed=2)[0]]
    assert alpha.put(keys, values, 5.0) == [True, True]
    return alpha, keys, values


def _refused(outcome) -> bool:
    return outcome in (CLOSED, SILENT) or (isinstance(outcome, Reply) and outcome.header.status != protocol.Status.OK)


def test_another_tenant_cannot_read_test_or_overwrite(keyed_node, node_clients, alpha_data):
    alpha, keys, values = alpha_data
    beta = node_clients(keyed_node.address, access_id="beta", access_key=KEY_B)
    assert beta.get(keys, 5.0) == [None, None]
    assert beta.exists(keys, 5.0) == [False, False]
    mine = make_values(2, 7000, seed=3)
    assert beta.put(keys, mine, 5.0) == [True, True]  # stored in beta's own namespace
    assert [bytes(v) for v in alpha.get(keys, 5.0)] == [joined(v) for v in values]
    assert [bytes(v) for v in beta.get(keys, 5.0)] == [joined(v) for v in mine]


def test_an_access_id_crafted_to_overlap_a_namespace_is_separate(keyed_node, alpha_data):
    """Tenant prefixes are length-prefixed: no key of beta can spell alpha's namespaced key."""
    _alpha, keys, _values = alpha_data
    with RawSession(keyed_node.port) as raw:
        raw.login("beta", KEY_B)
        crafted = [b"\x05\x00alpha" + k for k in keys] + [b"alpha" + k for k in keys]
        assert raw.get(crafted) == [None] * 4


@pytest.mark.parametrize(
    "abuse",
    [
        "skip-auth",
        "put-before-auth",
        "replayed-mac",
        "second-hello",
        "other-tenants-mac",
        "id-swap",
        "anonymous",
        "long-mac",
        "empty-mac",
    ],
)
def test_handshake_abuse_is_refused(keyed_node, alpha_data, abuse):
    _alpha, keys, _values = alpha_data
    key_meta = metas.encode_keys_meta(keys)
    get = [
        protocol.pack_header(protocol.Op.GET, count=len(keys), meta_len=len(key_meta), meta_end=protocol.end_byte(key_meta)),
        key_meta,
    ]
    with RawSession(keyed_node.port) as raw:
        if abuse == "skip-auth":
            raw.hello("alpha")
            raw.send(*get)
            outcome = raw.reply(timeout_s=2.0)
        elif abuse == "put-before-auth":
            frames = raw.put_frames(b"x", 10, [b"0123456789"])
            raw.send(*frames)
            outcome = raw.reply(timeout_s=2.0)
        elif abuse == "replayed-mac":
            with RawSession(keyed_node.port) as first:
                first.hello("alpha")
                old_mac = protocol.auth_mac(KEY_A, first.nonce, "alpha")
            raw.hello("alpha")
            outcome = raw.auth(old_mac)
        elif abuse == "second-hello":
            raw.hello("beta")
            outcome = raw.hello("alpha")
        elif abuse == "other-tenants-mac":
            raw.hello("beta")
            outcome = raw.auth(protocol.auth_mac(KEY_A, raw.nonce, "alpha"))
        elif abuse == "id-swap":
            raw.hello("alpha")
            outcome = raw.auth(protocol.auth_mac(KEY_B, raw.nonce, "alpha"))
        elif abuse == "anonymous":
            raw.hello("")
            outcome = raw.auth(b"")
        elif abuse == "long-mac":
            raw.hello("alpha")
            outcome = raw.auth(protocol.auth_mac(KEY_A, raw.nonce, "alpha") + b"x")
        else:
            raw.hello("alpha")
            outcome = raw.auth(b"")
        assert _refused(outcome), outcome
        # whatever the node answered, this connection can never read alpha's values
        after = raw.get(keys, timeout_s=2.0)
        assert not (isinstance(after, list) and any(v is not None for v in after)), after

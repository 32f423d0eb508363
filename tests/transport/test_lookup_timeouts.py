"""A lookup that times out on a busy pool node leaves the connection to the calls beside it: it used to abort the
connection, failing every load, save and record read in flight on it ("Request canceled"), and the backoff then
failed every call for a while ("no answer within ... (next reconnect attempt in ...)")."""

from __future__ import annotations

import threading
import time

import pytest
from pool_testlib import joined, make_values

from ems.errors import EmsErrorCode
from ems.transport.base import TransportError

pytestmark = pytest.mark.slow

VALUE = 64 << 10


def test_a_lookup_that_times_out_leaves_the_connection_to_the_calls_beside_it(pool_nodes, node_clients):
    """The node stops answering (SIGSTOP) while a load (long timeout) is in flight on the connection; a lookup with a
    short timeout times out beside it. Once the node answers again the load completes, and the next call goes
    straight through: no aborted connection, no backoff."""
    node = pool_nodes("64MiB")
    client = node_clients(node.address)
    values = make_values(2, VALUE, seed=3)
    assert all(client.put([b"a", b"b"], values, 5.0))
    node.pause()
    got: list = []

    def load() -> None:
        try:
            got.append(client.get([b"a", b"b"], 20.0))
        except TransportError as error:
            got.append(error)

    loader = threading.Thread(target=load)
    try:
        loader.start()
        time.sleep(0.2)
        with pytest.raises(TransportError) as timed_out:
            client.exists([b"a"], 0.3)
        assert timed_out.value.status_code() == EmsErrorCode.EMS_IO_TIMEOUT
    finally:
        node.resume()
    loader.join(30)
    assert not isinstance(got[0], TransportError), got[0]
    assert [bytes(v) for v in got[0]] == [joined(v) for v in values]
    assert client.exists([b"a", b"b"], 5.0) == [True, True]  # at once: no "next reconnect attempt in ..."

"""The etcd client and membership against a real etcd (skipped without the binary): kv, leases, watch, resync."""

from __future__ import annotations

import threading
import time

import pytest

from ems.cluster.etcd import EtcdClient, EtcdError, WatchHandle, parse_url, prefix_end
from ems.cluster.membership import (
    MembershipWatcher,
    NodeInfo,
    Registration,
    read_members,
    wait_for,
)


def test_prefix_end_and_url():
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff\xff") == b"b"
    assert prefix_end(b"\xff") == b"\0"
    assert parse_url("http://h:1234") == ("h", 1234)
    assert parse_url("http://h") == ("h", 2379)
    for bad in ("h:1234", "https://h:1", "http://h:1/x", ""):
        with pytest.raises(ValueError):
            parse_url(bad)


def test_unreachable_etcd_raises_within_the_timeout():
    client = EtcdClient("http://127.0.0.1:1", timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(EtcdError, match="unreachable"):
        client.get_prefix(b"/x/")
    assert time.monotonic() - t0 < 2.0


def test_kv_lease_and_watch(etcd):
    client = EtcdClient(etcd.url)
    prefix = b"/test/kv/"
    client.put(prefix + b"a", b"1")
    kvs, rev = client.get_prefix(prefix)
    assert [(kv.key, kv.value) for kv in kvs] == [(prefix + b"a", b"1")] and rev > 0
    events: list = []
    handle = WatchHandle()
    created = threading.Event()
    thread = threading.Thread(target=client.watch_prefix, args=(prefix, rev + 1, events.extend, handle, created.set), daemon=True)
    thread.start()
    assert created.wait(5)
    lease = client.grant(2)
    client.put(prefix + b"b", b"2", lease)
    client.put(b"/test/other", b"x")  # outside the prefix: not seen
    assert client.delete(prefix + b"a") == 1
    client.revoke(lease)  # deletes b
    assert wait_for(lambda: len(events) == 3, 5)
    assert [(e.key, e.deleted) for e in events] == [(prefix + b"b", False), (prefix + b"a", True), (prefix + b"b", True)]
    assert client.keepalive(lease) == 0  # revoked
    handle.stop()
    thread.join(5)
    assert not thread.is_alive()


def test_registration_watcher_and_resync_after_an_etcd_restart(etcd):
    seen: list[dict] = []
    watcher = MembershipWatcher(etcd.url, "resync", lambda m: seen.append(m), retry_s=0.1)
    reconnected = threading.Event()
    a = Registration(etcd.url, "resync", NodeInfo("10.0.0.1:1", "10.0.0.1:9"), ttl_s=2, on_reconnect=reconnected.set)
    a.start()
    try:
        assert watcher.start() == {"10.0.0.1:1": NodeInfo("10.0.0.1:1", "10.0.0.1:9")}
        assert wait_for(lambda: watcher.connected, 5)
        b = Registration(etcd.url, "resync", NodeInfo("10.0.0.2:1"), ttl_s=2)
        b.start()
        assert wait_for(lambda: set(watcher.members) == {"10.0.0.1:1", "10.0.0.2:1"}, 5)
        etcd.stop()
        assert wait_for(lambda: not watcher.connected, 5)
        assert set(watcher.members) == {"10.0.0.1:1", "10.0.0.2:1"}  # the last set is kept
        time.sleep(1.0)  # longer than a's lease refresh period (ttl / 3): one refresh fails
        assert not reconnected.is_set()
        etcd.start()
        assert wait_for(reconnected.is_set, 10)  # a's refresh found etcd again and said so
        b.deregister()  # a change after the restart: seen by the resynced watch
        assert wait_for(lambda: set(watcher.members) == {"10.0.0.1:1"}, 10)
        assert wait_for(lambda: watcher.connected, 5)
        members, _ = read_members(EtcdClient(etcd.url), "resync")
        assert set(members) == {"10.0.0.1:1"}  # a's lease survived the restart
        assert seen[-1] == watcher.members
    finally:
        watcher.close()
        a.deregister()
        if etcd.proc is None or etcd.proc.poll() is not None:
            etcd.start()


def test_a_quiet_watch_is_renewed_and_still_sees_changes(etcd):
    watcher = MembershipWatcher(etcd.url, "quiet", lambda m: None, retry_s=0.1, idle_s=0.3)
    try:
        assert watcher.start() == {}
        time.sleep(1.0)  # three idle periods: the watch is renewed, the view stays connected
        assert watcher.connected and watcher.renewals >= 2 and watcher.disconnects == 0
        node = Registration(etcd.url, "quiet", NodeInfo("10.0.0.3:1"), ttl_s=2)
        node.start()
        assert wait_for(lambda: set(watcher.members) == {"10.0.0.3:1"}, 5)
        node.deregister()
        assert wait_for(lambda: watcher.members == {}, 5)
    finally:
        watcher.close()


def test_resync_renews_a_running_watch_at_once(etcd):
    """`resync()` ends the running watch (as a quiet one would end after `idle_s`) and reads the set anew at once:
    what a node cut off from etcd does when etcd answers it again, instead of waiting on a stale stream."""
    watcher = MembershipWatcher(etcd.url, "renew", lambda m: None, retry_s=0.1, idle_s=60)
    try:
        assert watcher.start() == {}
        assert wait_for(lambda: watcher.connected, 5)
        watcher.resync()
        assert wait_for(lambda: watcher.renewals == 1, 2)  # not 60 s later
        assert watcher.connected and watcher.disconnects == 0
        node = Registration(etcd.url, "renew", NodeInfo("10.0.0.4:1"), ttl_s=2)
        node.start()
        assert wait_for(lambda: set(watcher.members) == {"10.0.0.4:1"}, 5)  # the renewed watch sees changes
        node.deregister()
        assert wait_for(lambda: watcher.members == {}, 5)
    finally:
        watcher.close()

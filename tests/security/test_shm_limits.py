"""Resource attacks on same-host shared memory, as a hostile local user would try them against a node with
`--shm-bytes 64MiB --shm-total 128MiB`: piling up regions on one connection or across reconnects while keeping
every descriptor, holding the hand-over socket's slots without a key, and leaving tokens unpresented. The host's
shared memory is measured from outside the node (the pages of every `ems-shm` memfd the node and the attacker
hold, told apart by inode), never from the node's own counters; the node's metrics are checked against it."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence

import numpy as np
import pytest
from cluster_testlib import free_port
from pool_testlib import KEY_A, KEY_B, PoolProcess, make_values, scrape_metrics, wait_until

from ems.transport import protocol
from ems.transport.base import TransportError
from ems.transport.shm import wire
from ems.transport.shm.client import ShmMode
from ems.transport.shm.regions import TOKEN_TTL_S

pytestmark = pytest.mark.slow

REGION, TOTAL = 64 << 20, 128 << 20
SHM_ARGS = ("--shm-bytes", "64MiB", "--shm-total", "128MiB")
NOBODY = 65534


def memfd_pages(pid: int, fds: Sequence[int] = ()) -> int:
    """Bytes of the pages held by the distinct `ems-shm` memfds that process `pid` (the node) holds open or that are
    among this process's descriptors `fds` (the regions the attacker took): the host's shared memory those regions
    take, whoever faulted it in. (Not every memfd of this process: regions of other tests' nodes that it has not
    released yet are no part of this node's.)"""
    pages: dict[int, int] = {}
    paths = [f"/proc/{pid}/fd/{name}" for name in os.listdir(f"/proc/{pid}/fd")] + [f"/proc/self/fd/{fd}" for fd in fds]
    for path in paths:
        try:
            if os.readlink(path).startswith("/memfd:ems-shm"):
                info = os.stat(path)
                pages[info.st_ino] = info.st_blocks * 512
        except OSError:  # closed meanwhile
            continue
    return sum(pages.values())


def _offer(client, populate_mib: int = 0) -> wire.OpenReply:
    """SHM_OPEN on `client`'s connection (this process's uid and pid), asking the node to populate `populate_mib`."""
    from ems.transport.ucx.client_requests import request

    meta = wire.encode_open(os.getuid(), os.getpid())

    def run(ex, rid):
        reply, body = request(ex, rid, protocol.Op.SHM_OPEN, count=populate_mib, meta=meta)
        return wire.decode_open_reply(bytes(body[: reply.meta_len]))

    return client._call(run, 5.0)


def _take(offer: wire.OpenReply) -> int:
    """Present the offer's token; the descriptor handed over."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5.0)
        sock.connect(offer.socket_name)
        sock.sendall(offer.token)
        message, fds, _, _ = socket.recv_fds(sock, 1, 4)
    assert message == b"\1" and len(fds) == 1, (message, fds)
    return fds[0]


def _touch(fd: int, nbytes: int) -> None:
    """Write every page of the region behind `fd` (the attacker faults it all in itself, too)."""
    with mmap.mmap(fd, nbytes) as m:
        np.frombuffer(m, dtype=np.uint8)[:: mmap.PAGESIZE] = 1


@pytest.fixture
def attacked(request):
    """A node with two tenants' keys and the limits above (and metrics); the descriptors the attacker took are
    closed and the node killed after the test."""
    metrics = f"127.0.0.1:{free_port()}"
    node = PoolProcess("64MiB", {"alpha": KEY_A, "beta": KEY_B}, args=(*SHM_ARGS, "--metrics", metrics))
    node.metrics = metrics
    node.held = []
    yield node
    for fd in node.held:
        os.close(fd)
    node.cleanup()


@pytest.mark.parametrize("how", ["one-connection", "reconnecting"])
def test_regions_piled_up_and_kept_never_hold_more_than_the_total(attacked, node_clients, how):
    """A tenant asks for a region again and again (on one connection, or on a new connection each time, dropping
    the old one), keeps every descriptor, asks the node to populate all of it and touches all of it itself: the
    host's shared memory for the node's regions never exceeds --shm-total (it used to grow by a region a round,
    4x the total in 8 rounds), and the node's metrics say what the host holds."""
    pytest.importorskip("prometheus_client")
    node = attacked
    client = node_clients(node.address, access_id="alpha", access_key=KEY_A, shm=ShmMode.OFF)
    peak = 0
    for _ in range(6):
        if how == "reconnecting":
            client.close()
            client = node_clients(node.address, access_id="alpha", access_key=KEY_A, shm=ShmMode.OFF)
        offer = _offer(client, populate_mib=REGION >> 20)
        if offer.region_bytes == 0:  # refused for now (an old region still being freed): the limit holds
            time.sleep(0.2)
            continue
        fd = _take(offer)
        node.held.append(fd)
        _touch(fd, offer.region_bytes)
        peak = max(peak, memfd_pages(node.proc.pid, node.held))
    assert REGION <= peak <= TOTAL, peak
    # the node's own figures say the same as the host: what it counts, and the pages its live regions hold
    held = memfd_pages(node.proc.pid, node.held)
    metrics = scrape_metrics(node.metrics)
    assert metrics[("ems_pool_shm_bytes", ())] <= TOTAL
    assert metrics[("ems_pool_shm_resident_bytes", ())] <= held <= TOTAL
    client.close()  # once the connection has ended, nothing of its regions is left, descriptors kept or not
    assert wait_until(lambda: memfd_pages(node.proc.pid, node.held) == 0, 10), memfd_pages(node.proc.pid, node.held)
    assert wait_until(lambda: scrape_metrics(node.metrics)[("ems_pool_shm_bytes", ())] == 0, 10)
    # and a region the attacker still maps reads as zeros: its pages are gone from every mapping
    with mmap.mmap(node.held[-1], REGION) as m:
        assert not np.frombuffer(m, dtype=np.uint8)[:: mmap.PAGESIZE * 64].any()


def test_random_sequences_of_opens_hand_overs_and_hang_ups_stay_within_the_limits(attacked, node_clients):
    """Two tenants, three connections each, 80 random steps: ask for a region (asking the node to populate it or
    not), present the token or not, touch the region, hang up, reconnect, wait. After every step the host's memory
    in the regions stays within --shm-total and the node never counts more than it; once every connection has
    ended nothing is left, whatever descriptors the attackers kept."""
    rng = np.random.default_rng(35)
    node = attacked
    keys = {"alpha": KEY_A, "beta": KEY_B}

    def connect(tenant: str):
        return node_clients(node.address, access_id=tenant, access_key=keys[tenant], shm=ShmMode.OFF)

    clients = {(t, i): connect(t) for t in keys for i in range(3)}
    offers: dict = {}
    offer_times: dict = {}
    live: dict = {}  # connection -> the descriptor of its current region (touching one the node has freed would
    # fault pages of the attacker's own, as in any memfd it makes: not the node's, so not touched here)
    for _ in range(80):
        who = list(clients)[int(rng.integers(len(clients)))]
        step = rng.choice(["open", "open", "open", "present", "present", "present", "touch", "touch", "hang-up", "wait"])
        if step == "open":
            live.pop(who, None)  # a new SHM_OPEN ends the connection's region
            offer = _offer(clients[who], populate_mib=int(rng.choice([0, 64])))
            offers[who] = offer if offer.region_bytes else None
            offer_times[who] = time.monotonic()
        elif step == "present" and offers.get(who) is not None:
            offer = offers.pop(who)
            fd = _take(offer) if time.monotonic() < offer_times[who] + TOKEN_TTL_S - 1 else None
            if fd is not None:  # (a token near its expiry is left to expire)
                node.held.append(fd)
                live[who] = fd
        elif step == "touch" and who in live:
            _touch(live[who], REGION)
        elif step == "hang-up":
            clients[who].close()
            clients[who] = connect(who[0])
            offers.pop(who, None)
            live.pop(who, None)
        elif step == "wait":
            time.sleep(float(rng.uniform(0.05, 0.5)))
        held = memfd_pages(node.proc.pid, node.held)
        assert held <= TOTAL, (step, held)
    assert scrape_metrics(node.metrics)[("ems_pool_shm_bytes", ())] <= TOTAL
    for client in clients.values():
        client.close()
    assert wait_until(lambda: memfd_pages(node.proc.pid, node.held) == 0, 10), memfd_pages(node.proc.pid, node.held)


def test_one_tenant_cannot_take_every_region(attacked, node_clients):
    """With two tenants' keys each holds at most half of --shm-total by default: alpha's second region is refused
    (counted as `tenant`), and beta still gets one (it used to be offered size 0)."""
    pytest.importorskip("prometheus_client")
    node = attacked
    first = node_clients(node.address, access_id="alpha", access_key=KEY_A, shm=ShmMode.OFF)
    second = node_clients(node.address, access_id="alpha", access_key=KEY_A, shm=ShmMode.OFF)
    assert _offer(first).region_bytes == REGION
    assert _offer(second).region_bytes == 0
    beta = node_clients(node.address, access_id="beta", access_key=KEY_B)
    assert beta.put([b"k"], make_values(1, 1000), 5.0) == [True]
    assert beta.shm._region is not None
    assert scrape_metrics(node.metrics)[("ems_pool_shm_refusals_total", (("reason", "tenant"),))] >= 1


def test_unpresented_tokens_free_their_regions_when_they_expire(pool_nodes, node_clients):
    """A tenant takes the whole total with two regions whose tokens it never presents: another tenant's client gets
    no region meanwhile, then, once the tokens expire (their regions freed at once, the connections still open),
    gets one on the same connection: it asks again after a back-off instead of giving up for good."""
    node = pool_nodes("64MiB", args=SHM_ARGS)  # no keys: tenants by name, no per-tenant share below the total
    hog = [node_clients(node.address, access_id="alpha", shm=ShmMode.OFF) for _ in range(2)]
    assert [_offer(c).region_bytes for c in hog] == [REGION, REGION]
    started = time.monotonic()
    victim = node_clients(node.address, access_id="beta")
    values = make_values(1, 1000)
    assert victim.put([b"k"], values, 5.0) == [True]  # over UCX: no region to be had
    assert victim.shm._region is None
    ep = victim._link.current
    assert wait_until(lambda: victim.put([b"k"], values, 5.0) == [True] and victim.shm._region is not None, 40, 0.25)
    assert victim._link.current is ep  # the same connection, asking again
    # the regions went when their tokens expired, not when their connections ended (still open)
    assert time.monotonic() - started >= TOKEN_TTL_S - 1
    assert all(c.ping(5.0) for c in hog)


_FLOOD = r"""
import os, select, socket, sys, time
name, count, seconds = bytes.fromhex(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
def connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect(name)
    except BlockingIOError:  # the backlog is full: keep it, it connects (or fails) later
        pass
    except OSError:
        s.close()
        return None
    return s
socks = [connect() for _ in range(count)]
print("flooding", os.getuid(), flush=True)
reconnects, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    for i, s in enumerate(socks):
        if s is None:
            socks[i] = connect()
            continue
        ready, _, _ = select.select([s], [], [], 0)
        if ready:  # the node closed it (or answered): reconnect at once, as the attack does
            s.close()
            socks[i] = connect()
            reconnects += 1
    time.sleep(0.001)
print("reconnects", reconnects, flush=True)
"""


def _handover_socket(node_pid: int) -> bytes:
    """The node's hand-over socket, as any local user finds it: /proc/net/unix lists abstract names."""
    with open("/proc/net/unix", encoding="ascii", errors="replace") as table:
        for line in table:
            path = line.split()[-1]
            if path.startswith(f"@ems-shm-{node_pid}-"):
                return b"\0" + path[1:].encode()
    raise AssertionError("no hand-over socket in /proc/net/unix")


def _as_nobody() -> None:
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _interpreter_for_nobody() -> str | None:
    """A Python the user nobody can run (this one may live under a home folder closed to others), or None (not
    root, or none found): then the attacker runs as this user, in another process, which no region waits for
    either."""
    if os.getuid() != 0:
        return None
    for candidate in (sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            if subprocess.run([candidate, "-c", "pass"], preexec_fn=_as_nobody, timeout=30).returncode == 0:
                return candidate
        except OSError:
            continue
    return None


def test_a_local_user_without_a_key_cannot_hold_the_hand_over_slots(attacked, node_clients):
    """Another user (uid nobody when the tests run as root) keeps 200 connections to the hand-over socket open and
    reconnects each one the node closes: the node closes them at accept (no region waits for that uid and pid, so
    none takes a slot), and a real client still gets its region (it used to get none, for good)."""
    pytest.importorskip("prometheus_client")
    node = attacked
    client = node_clients(node.address, access_id="alpha", access_key=KEY_A, shm=ShmMode.OFF)
    node.held.append(_take(_offer(client)))  # (the socket is listed once the node has started it)
    name = _handover_socket(node.proc.pid)
    nobody_python = _interpreter_for_nobody()
    flood = subprocess.Popen(
        [nobody_python or sys.executable, "-c", textwrap.dedent(_FLOOD), name.hex(), "200", "60"],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=_as_nobody if nobody_python else None,
    )
    try:
        assert flood.stdout.readline().split() == ["flooding", str(NOBODY if nobody_python else os.getuid())]
        time.sleep(1.0)  # the flood is on
        victim = node_clients(node.address, access_id="beta", access_key=KEY_B)
        values = make_values(1, 1000)

        def victim_holds_a_region() -> bool:
            try:  # (on two busy cores a connect can time out while the flood runs: the client tries again)
                return victim.put([b"k"], values, 5.0) == [True] and victim.shm._region is not None
            except TransportError:
                return False

        assert wait_until(victim_holds_a_region, 30, 0.2)
        assert flood.poll() is None  # (still flooding)
        metrics = scrape_metrics(node.metrics)
        assert metrics[("ems_pool_shm_refusals_total", (("reason", "unexpected_peer"),))] >= 200
    finally:
        flood.kill()
        flood.wait(10)

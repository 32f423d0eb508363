"""Pool nodes with a disk tier (`--disk`), as real processes on loopback: a working set bigger than DRAM, restarts
(SIGKILL mid-burst included), damaged and truncated records, a filling and a failing disk, tenants, and a random
sequence of saves, loads and restarts against a model."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import threading

import pytest
from disk_testlib import record_files, small_filesystem
from pool_testlib import KEY_A, KEY_B, joined, make_values, wait_until

from ems.transport.ucx.remote import connect

pytestmark = pytest.mark.slow
MiB = 1 << 20
T = 10.0  # seconds, per call


def _put_all(client, keys, values, batch: int = 4) -> None:
    for i in range(0, len(keys), batch):
        assert client.put(keys[i : i + batch], values[i : i + batch], T) == [True] * len(keys[i : i + batch])


def _exact_or_miss(client, keys, values) -> list[bool]:
    """Load every key; each is its exact value or a miss (never another value). Returns which were found."""
    got = client.get(keys, T)
    found = []
    for key, value, loaded in zip(keys, values, got):
        if loaded is not None:
            assert bytes(loaded) == joined(value), f"{key!r} loaded another value"
        found.append(loaded is not None)
    return found


def test_working_set_bigger_than_dram_served_byte_exact_from_both_tiers(tmp_path, disk_nodes):
    node = disk_nodes(tmp_path / "disk", capacity="8MiB", disk_capacity="128MiB")
    client = connect(node.address)
    try:
        keys = [f"block-{i}".encode() for i in range(48)]  # 48 MiB through an 8 MiB DRAM
        values = make_values(48, MiB - 40, seed=1)
        _put_all(client, keys, values)
        assert node.drained()
        assert client.exists(keys, T) == [True] * 48  # both tiers answer
        for i in range(0, 48, 6):  # loads of a few blocks, as an engine's; every one exact
            assert _exact_or_miss(client, keys[i : i + 6], values[i : i + 6]) == [True] * 6
        assert _exact_or_miss(client, keys[-4:], values[-4:]) == [True] * 4  # just promoted: from DRAM
        m = node.scrape()
        assert m[("ems_pool_tier_hits_total", (("tier", "disk"),))] >= 40
        assert m[("ems_pool_tier_hits_total", (("tier", "dram"),))] >= 4
        assert m[("ems_pool_tier_writes_total", (("tier", "disk"),))] >= 40
        assert m[("ems_pool_tier_values", (("tier", "disk"),))] >= 40
        assert m[("ems_pool_get_hits_total", ())] == 52 and m[("ems_pool_get_misses_total", ())] == 0
        assert m[("ems_pool_tier_errors_total", (("kind", "integrity"), ("tier", "disk")))] == 0
        status = subprocess.run(
            [sys.executable, "-m", "ems.pool", "status", "--nodes", node.metrics, "--interval", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        lines = status.stdout.splitlines()
        assert status.returncode == 0 and any(line.split()[:2] == ["dram", "up"] for line in lines), status.stdout
        assert any(line.split()[:2] == ["disk", "up"] for line in lines), status.stdout
    finally:
        client.close()


def test_restart_serves_what_reached_the_disk_and_replaces_nothing(tmp_path, disk_nodes):
    node = disk_nodes(tmp_path / "disk", capacity="4MiB", disk_capacity="64MiB")
    client = connect(node.address)
    keys = [f"k{i}".encode() for i in range(24)]
    values = make_values(24, 512 * 1024, seed=2)
    _put_all(client, keys, values)
    assert node.drained()
    client.close()
    node.restart(kill=False)
    client = connect(node.address)
    try:
        found = _exact_or_miss(client, keys, values)
        assert all(found[:12]), found  # the oldest ones were evicted from DRAM and written: all back
        assert node.scrape()[("ems_pool_disk_restored_values", ())] >= 12
        # a new value of a restored key replaces the old one everywhere, also after another restart
        newer = make_values(1, 512 * 1024, seed=3)
        assert client.put([keys[0]], newer, T) == [True]
        _put_all(client, [f"push{i}".encode() for i in range(12)], make_values(12, 512 * 1024, seed=4))
        assert node.drained()
        client.close()
        node.restart(kill=True)
        client = connect(node.address)
        assert _exact_or_miss(client, keys[:1], newer) == [True]
    finally:
        client.close()


def test_sigkill_during_a_write_burst_leaves_every_block_exact_or_missing(tmp_path, disk_nodes):
    node = disk_nodes(tmp_path / "disk", capacity="2MiB", disk_capacity="256MiB")
    keys = [f"burst-{i}".encode() for i in range(160)]
    values = make_values(160, 256 * 1024, seed=5)
    client = connect(node.address)
    stop = threading.Event()

    def burst() -> None:
        for i in range(0, len(keys), 2):
            if stop.is_set():
                return
            try:
                client.put(keys[i : i + 2], values[i : i + 2], 2.0)
            except Exception:  # the node is gone
                return

    writer = threading.Thread(target=burst)
    writer.start()
    assert wait_until(lambda: node.tier("ems_pool_tier_writes_total") >= 20, 20)
    node.process.kill()  # SIGKILL, mid-burst: values in the write queue and files being written are cut off
    stop.set()
    writer.join(10)
    client.close()
    node.process.start()
    assert not list((tmp_path / "disk").glob("*/*.tmp"))  # what was being written is gone
    client = connect(node.address)
    try:
        found = _exact_or_miss(client, keys, values)
        assert sum(found) >= 10, sum(found)
        assert node.scrape()[("ems_pool_tier_errors_total", (("kind", "integrity"), ("tier", "disk")))] == 0
    finally:
        client.close()


def test_a_flipped_byte_or_a_truncated_record_is_a_miss_and_is_dropped(tmp_path, disk_nodes):
    disk = tmp_path / "disk"
    node = disk_nodes(disk, capacity="2MiB", disk_capacity="64MiB")
    client = connect(node.address)
    keys = [f"d{i}".encode() for i in range(20)]
    values = make_values(20, 300_000, seed=6)
    _put_all(client, keys, values)
    assert node.drained()
    client.close()
    assert node.process.terminate() == 0
    files = record_files(disk)
    assert len(files) >= 6
    damaged = files[:4]
    for path, offset in zip(damaged[:3], (10, 40, 100_000)):  # record header, key, payload
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))
    with open(damaged[3], "r+b") as f:  # a truncated record
        f.truncate(os.path.getsize(damaged[3]) // 2)
    node.process.start()
    client = connect(node.address)
    try:
        found = _exact_or_miss(client, keys, values)
        assert sum(found) == len(files) - 4, found  # what was in DRAM at the stop is gone, the damaged are misses
        assert not any(path.exists() for path in damaged)  # dropped with their files
        m = node.scrape()
        assert m[("ems_pool_tier_errors_total", (("kind", "integrity"), ("tier", "disk")))] == 4
        assert client.exists(keys, T).count(True) == len(files) - 4
    finally:
        client.close()


def test_a_disk_filling_up_is_eviction_never_an_error(tmp_path, disk_nodes):
    with small_filesystem(tmp_path / "small", "6m") as disk:
        # the tier's capacity is far above what the filesystem holds: ENOSPC must be handled as eviction
        node = disk_nodes(disk, capacity="2MiB", disk_capacity="1GiB")
        client = connect(node.address)
        try:
            keys = [f"f{i}".encode() for i in range(40)]  # 20 MiB into 2 MiB DRAM + a 6 MiB disk
            values = make_values(40, 512 * 1024, seed=7)
            _put_all(client, keys, values)  # never an error to the client
            assert node.drained()
            held = client.exists(keys, T)
            assert all(held[-6:]) and 4 <= sum(held) <= 24, held  # the newest are there, the oldest made room
            assert _exact_or_miss(client, keys[-6:], values[-6:]) == [True] * 6
            assert node.tier("ems_pool_tier_up") == 1.0 and node.tier("ems_pool_tier_evictions_total") > 0
            _put_all(client, keys[:8], values[:8])  # and it keeps working
            assert node.drained()
            assert _exact_or_miss(client, keys[:8], values[:8]) == [True] * 8
        finally:
            client.close()


def test_disk_capacity_evicts_least_recently_used_records(tmp_path, disk_nodes):
    node = disk_nodes(tmp_path / "disk", capacity="2MiB", disk_capacity="6MiB")
    client = connect(node.address)
    try:
        keys = [f"l{i}".encode() for i in range(24)]
        values = make_values(24, 512 * 1024, seed=8)
        _put_all(client, keys, values)
        assert node.drained()
        assert node.tier("ems_pool_tier_bytes") <= 6 * MiB
        held = client.exists(keys, T)  # (exists: a load would promote, and so reorder what it reads)
        assert all(held[-12:]) and not any(held[:8]), held
        # a load makes a record recently used: it outlives the older records, and those written before it
        first = held.index(True)
        assert _exact_or_miss(client, keys[first : first + 1], values[first : first + 1]) == [True]
        _put_all(client, [f"n{i}".encode() for i in range(8)], make_values(8, 512 * 1024, seed=13))
        assert node.drained()
        assert client.exists(keys[first : first + 3], T) == [True, False, False]
    finally:
        client.close()


def test_a_failing_disk_turns_the_node_dram_only(tmp_path, disk_nodes):
    disk = tmp_path / "disk"
    node = disk_nodes(disk, capacity="2MiB", disk_capacity="64MiB")
    client = connect(node.address)
    try:
        keys = [f"x{i}".encode() for i in range(16)]
        values = make_values(16, 256 * 1024, seed=9)
        _put_all(client, keys[:8], values[:8])
        assert node.drained()
        shutil.rmtree(disk)  # the disk goes away under the node
        _put_all(client, keys[8:], values[8:])  # evictions now fail to be written: never an error to the client
        assert wait_until(lambda: node.tier("ems_pool_tier_up") == 0.0, 10)
        assert _exact_or_miss(client, keys[-4:], values[-4:]) == [True] * 4  # DRAM still serves
        _exact_or_miss(client, keys, values)
        assert "serves from DRAM only" in node.process.log_text()
        assert node.process.proc.poll() is None and "Traceback" not in node.process.log_text()
    finally:
        client.close()


def test_a_read_only_disk_turns_the_node_dram_only(tmp_path, disk_nodes):
    with small_filesystem(tmp_path / "ro", "16m") as disk:
        node = disk_nodes(disk, capacity="2MiB", disk_capacity="16MiB")
        client = connect(node.address)
        try:
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
            keys = [f"r{i}".encode() for i in range(16)]
            values = make_values(16, 256 * 1024, seed=10)
            _put_all(client, keys, values)
            assert wait_until(lambda: node.tier("ems_pool_tier_up") == 0.0, 10)
            assert _exact_or_miss(client, keys[-4:], values[-4:]) == [True] * 4
            assert node.process.proc.poll() is None
        finally:
            client.close()


def test_another_tenant_never_reads_a_restored_value(tmp_path, disk_nodes):
    tenants = {"alpha": KEY_A, "beta": KEY_B}
    node = disk_nodes(tmp_path / "disk", capacity="2MiB", disk_capacity="64MiB", keys=tenants)
    alpha = connect(node.address, access_id="alpha", access_key=KEY_A)
    keys = [f"t{i}".encode() for i in range(16)]
    values = make_values(16, 256 * 1024, seed=11)
    _put_all(alpha, keys, values)
    assert node.drained()
    alpha.close()
    node.restart(kill=True)
    beta = connect(node.address, access_id="beta", access_key=KEY_B)
    alpha = connect(node.address, access_id="alpha", access_key=KEY_A)
    try:
        assert beta.get(keys, T) == [None] * 16 and beta.exists(keys, T) == [False] * 16
        assert sum(_exact_or_miss(alpha, keys, values)) >= 8
        assert beta.get(keys, T) == [None] * 16  # also once alpha's values are back in DRAM
    finally:
        alpha.close()
        beta.close()


def test_a_restarted_disk_node_registers_again_and_serves_what_it_had(tmp_path, disk_nodes, etcd):
    from ems.cluster.etcd import EtcdClient
    from ems.cluster.membership import read_members

    members = lambda: set(read_members(EtcdClient(etcd.url, timeout_s=5), "disk")[0])
    node = disk_nodes(
        tmp_path / "disk",
        capacity="2MiB",
        disk_capacity="64MiB",
        extra=("--etcd", etcd.url, "--cluster", "disk", "--drain", "0.1"),
    )
    client = connect(node.address)
    keys = [f"e{i}".encode() for i in range(16)]
    values = make_values(16, 256 * 1024, seed=14)
    _put_all(client, keys, values)
    assert node.drained() and members() == {node.address}
    client.close()
    assert node.process.terminate() == 0
    assert members() == set()  # deregistered on SIGTERM
    node.process.start()  # same directory, same port
    assert members() == {node.address}
    client = connect(node.address)
    try:
        assert sum(_exact_or_miss(client, keys, values)) >= 8
    finally:
        client.close()


def test_random_saves_loads_and_restarts_against_a_model(tmp_path, disk_nodes):
    """Keys drawn from a small space, values of a few sizes, loads, exists, graceful and SIGKILL restarts.

    Model: per key, its newest value and what a load must return: FOUND (the newest value, exactly), GONE (a miss
    until saved again) or UNKNOWN (after a restart: the newest value or a miss; the first load decides it for good).
    The disk holds every key, so nothing written is evicted there; before a restart the write queue is drained,
    so a key is lost by a restart only if it was in DRAM then."""
    rng = random.Random(12)
    node = disk_nodes(tmp_path / "disk", capacity="1MiB", disk_capacity="64MiB")
    client = connect(node.address)
    space = [f"m{i}".encode() for i in range(20)]
    pool = {size: make_values(6, size, seed=size) for size in (20_000, 90_000, 200_000)}
    newest: dict[bytes, list[bytes]] = {}
    state: dict[bytes, str] = {}
    try:
        for step in range(200):
            op = rng.random()
            if op < 0.45:
                batch = rng.sample(space, rng.randint(1, 3))
                chosen = [rng.choice(pool[rng.choice(list(pool))]) for _ in batch]
                assert client.put(batch, chosen, T) == [True] * len(batch)
                for key, value in zip(batch, chosen):
                    newest[key], state[key] = value, "FOUND"
            elif op < 0.9:
                batch = rng.sample(space, rng.randint(1, 4))
                got = client.get(batch, T)
                for key, loaded in zip(batch, got):
                    expect = state.get(key, "GONE")
                    if loaded is not None:
                        assert expect != "GONE" and bytes(loaded) == joined(newest[key]), (step, key, expect)
                        state[key] = "FOUND"
                    else:
                        assert expect != "FOUND", (step, key)
                        state[key] = "GONE"
            elif op < 0.97:
                batch = rng.sample(space, 4)
                flags = client.exists(batch, T)
                for key, flag in zip(batch, flags):
                    assert not (state.get(key) == "FOUND" and not flag), (step, key)
                    assert not (state.get(key, "GONE") == "GONE" and flag), (step, key)
            else:
                assert node.drained()
                client.close()
                node.restart(kill=rng.random() < 0.5)
                client = connect(node.address)
                for key in state:
                    if state[key] == "FOUND":
                        state[key] = "UNKNOWN"
        m = node.scrape()
        assert m[("ems_pool_tier_errors_total", (("kind", "integrity"), ("tier", "disk")))] == 0
        assert m[("ems_pool_tier_errors_total", (("kind", "dropped_write"), ("tier", "disk")))] == 0
    finally:
        client.close()


def test_random_saves_loads_evictions_and_restarts_on_a_small_disk(tmp_path, disk_nodes):
    """The same kind of sequence on a disk that holds about a third of the keys, so records are evicted as well
    (and a SIGKILL restart may bring back a record whose eviction it cut short: still that key's newest value).
    What must hold: a load returns its key's newest value exactly or a miss, never another value; what was just
    saved is found; what was never saved is never found."""
    rng = random.Random(15)
    node = disk_nodes(tmp_path / "disk", capacity="1MiB", disk_capacity="2MiB")
    client = connect(node.address)
    space = [f"s{i}".encode() for i in range(24)]
    pool = {size: make_values(6, size, seed=size + 1) for size in (30_000, 120_000, 250_000)}
    newest: dict[bytes, list[bytes]] = {}
    evictions = 0.0
    try:
        for step in range(150):
            op = rng.random()
            if op < 0.5:
                batch = rng.sample(space, rng.randint(1, 3))
                chosen = [rng.choice(pool[rng.choice(list(pool))]) for _ in batch]
                assert client.put(batch, chosen, T) == [True] * len(batch)
                newest.update(zip(batch, chosen))
                assert _exact_or_miss(client, batch, chosen) == [True] * len(batch), step
            elif op < 0.96:
                batch = rng.sample(space, rng.randint(1, 5))
                for key, loaded in zip(batch, client.get(batch, T)):
                    if loaded is not None:
                        assert key in newest and bytes(loaded) == joined(newest[key]), (step, key)
            else:
                evictions += node.tier("ems_pool_tier_evictions_total")
                client.close()
                node.restart(kill=rng.random() < 0.5)
                client = connect(node.address)
        assert evictions + node.tier("ems_pool_tier_evictions_total") > 0
        assert node.scrape()[("ems_pool_tier_errors_total", (("kind", "integrity"), ("tier", "disk")))] == 0
    finally:
        client.close()


def test_disk_options_are_checked():
    for args in (
        ["--disk-capacity", "1GiB"],
        ["--disk", "/tmp/x"],
        ["--disk", "/tmp/x", "--disk-capacity", "0"],
        ["--disk", "/tmp/x", "--disk-capacity", "lots"],
    ):
        done = subprocess.run([sys.executable, "-m", "ems.pool", *args], capture_output=True, text=True, timeout=30)
        assert done.returncode == 2, (args, done.stderr)
    # a directory that cannot be used at start: exit 1 with the reason, before the ready line
    done = subprocess.run(
        [sys.executable, "-m", "ems.pool", "--listen", "127.0.0.1:0", "--disk", "/proc/ems-disk", "--disk-capacity", "1GiB"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1 and "cannot use --disk /proc/ems-disk" in done.stderr and not done.stdout, done

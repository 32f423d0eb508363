"""epoch: one record per model namespace in the pool; a reset by one client is what every later reader of that
model sees, other models are untouched, and keys of two epochs never meet. Against a real local pool node (with
this user's key), each "engine" its own `Ems` client."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ems import CcConfig_v1, CcKvOption, Ems, EmsConfig, EmsException, KvBufferWrapper, PrimaryKey
from ems.integrations.engine_keys import block_keys, lookup_keys
from ems.integrations.epoch import EPOCH_BYTES, EpochRead, EpochRecord, EpochWatch, new_epoch
from ems.integrations.local_pool import LocalPool, ensure_local_pool, stop_local_pool


@pytest.fixture
def node(tmp_path):
    pool = ensure_local_pool(str(tmp_path), "16MiB")
    yield pool
    stop_local_pool(str(tmp_path))


def record(pool: LocalPool, model_id: str) -> EpochRecord:
    """A fresh client of `model_id` on the node (as a new engine process would be)."""
    Ems.shutdown()
    Ems.init(
        EmsConfig(
            access_id=pool.access_id,
            access_key=pool.access_key,
            pool_nodes=[pool.address],
            # a fresh client's first connect took over the default 3 s with both cores busy; these tests are about
            # the epoch record, not start-up time
            connect_timeout_ms=30_000,
            cc_config_v1=CcConfig_v1(rank_id=0, device_id=0, model_id=model_id),
        )
    )
    cc = Ems.get_cc()
    assert cc is not None
    return EpochRecord(cc, timeout_ms=3000)


def test_one_epoch_per_model_and_a_reset_reaches_every_later_reader(node):
    first = record(node, "m1").current()
    assert first.ok and len(first.epoch) == EPOCH_BYTES
    assert record(node, "m1").current() == first  # a second engine of the model: the same epoch
    other = record(node, "m2").current()
    assert other.ok and other.epoch != first.epoch  # another model: its own record
    new = record(node, "m1").reset()
    assert new is not None and new != first.epoch
    assert record(node, "m1").current().epoch == new
    assert record(node, "m2").current() == other  # untouched


def test_the_record_is_pinned_and_outlives_a_flood(tmp_path):
    """Another model's saves fill a small node many times over: the pinned record is still the epoch every reader
    sees (an evicted record would make the next reader start a new epoch: a silent reset of every engine's hits)."""
    pool = ensure_local_pool(str(tmp_path), "4MiB")
    try:
        reader = record(pool, "m1")
        first = reader.current()
        assert first.ok and reader.pinned
        flood = record(pool, "m2")._cc
        buffer = torch.ones(64 << 10, dtype=torch.uint8)
        for i in range(200):  # 12.5 MiB
            wrapper = [[KvBufferWrapper(buffer.data_ptr(), buffer.numel())]]
            flood.save(CcKvOption(write_rcache=False), [PrimaryKey(distribute_key=f"f{i}", attribute_key="a")], wrapper)
        assert record(pool, "m1").current() == first
    finally:
        Ems.shutdown()
        stop_local_pool(str(tmp_path))


def test_engines_that_write_the_record_at_once_converge_soon(node):
    """Two engines start together: both find no record and both write one. The one whose write came first learns the
    other's epoch within RETRY_S (it reads again soon after writing), not at its next refresh; the same after a
    reset."""
    first = record(node, "race")
    watch = EpochWatch(first, refresh_s=60.0)  # its refresh alone would take a minute
    try:
        other = new_epoch()
        assert first.write(other)  # the other engine's write, just after this one's
        deadline = time.monotonic() + 5
        while watch.epoch != other and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.epoch == other
        assert watch.reset()
        again = new_epoch()
        assert first.write(again)  # another engine reset at the same moment
        deadline = time.monotonic() + 5
        while watch.epoch != again and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.epoch == again
    finally:
        watch.close()


def test_a_reset_holds_against_reads_running_beside_it(node):
    """A watch's refresh reads the record while the engine resets it (a real pool, reads in a loop on another
    thread): every reset's epoch is what the record then holds (the record's reads and writes never mix their
    buffer), and the watch keeps it (a read that began before the reset ended is not taken: it may hold the epoch
    the reset replaced, which would bring back, until the next read, the blocks the reset hid)."""
    reader = record(node, "beside")
    watch = EpochWatch(reader, refresh_s=0.001)  # reads back to back, beside every reset
    stop = threading.Event()

    def read_on() -> None:
        while not stop.is_set():
            reader.read()

    hammer = threading.Thread(target=read_on, daemon=True)
    hammer.start()
    try:
        for _ in range(30):
            assert watch.reset()
            new = watch.epoch
            assert reader.read() == new  # the record holds the reset's epoch, whole
            time.sleep(0.01)  # reads that overlapped the reset come back meanwhile: none undoes it
            assert watch.epoch == new
    finally:
        stop.set()
        hammer.join(5)
        watch.close()


class _SlowRecord:
    """A record whose reads are held: the held read returns the epoch it had when it began, once `release` is set;
    every read after it waits for `later`."""

    def __init__(self, epoch: bytes) -> None:
        self.epoch = epoch
        self.reading = threading.Event()
        self.release = threading.Event()
        self.later = threading.Event()
        self.held = 0

    def current(self) -> EpochRead:
        began = self.epoch
        if self.reading.is_set():
            self.held += 1
            (self.release if self.held == 1 else self.later).wait(10)
        return EpochRead(began, True)

    def reset(self) -> bytes:
        self.epoch = new_epoch()
        return self.epoch


def test_a_read_that_began_before_a_reset_is_not_taken():
    old = new_epoch()
    slow = _SlowRecord(old)
    watch = EpochWatch(slow, refresh_s=0.01)  # type: ignore[arg-type]
    try:
        slow.reading.set()  # the watch's next read begins, with the old epoch, and waits
        time.sleep(0.2)
        assert slow.held == 1
        assert watch.reset()
        new = watch.epoch
        assert new != old
        slow.release.set()  # the read that began before the reset returns the old epoch
        time.sleep(0.2)  # (the watch's next read waits meanwhile)
        assert watch.epoch == new
        slow.later.set()  # later reads, begun after the reset, are taken as usual
        time.sleep(0.1)
        assert watch.epoch == slow.epoch == new
    finally:
        slow.release.set()
        slow.later.set()
        watch.close()


def test_a_watch_ends_when_its_client_is_shut_down(node, caplog):
    """An engine that never closed its watch: once its client is shut down the watch's thread ends, instead of reading
    (and logging a failed read) every RETRY_S for the rest of the process; a direct read is refused, not a private
    epoch."""
    reader = record(node, "m1")
    watch = EpochWatch(reader, refresh_s=0.05)
    first = watch.epoch
    Ems.shutdown()
    watch._thread.join(timeout=5)
    assert not watch._thread.is_alive()
    assert watch.epoch == first
    assert "could not read the namespace epoch" not in caplog.text
    with pytest.raises(EmsException):
        reader.current()


def test_an_unreachable_pool_gives_a_private_epoch(node, tmp_path):
    reader = record(node, "m1")
    shared = reader.current()
    assert stop_local_pool(str(tmp_path))  # the node goes away under a live client
    lost, again = reader.current(), reader.current()
    assert not lost.ok and not again.ok and len({shared.epoch, lost.epoch, again.epoch}) == 3
    assert reader.reset() is None  # a reset the pool did not take is reported, not assumed


def test_keys_of_two_epochs_never_meet():
    hashes = [bytes([i]) * 32 for i in range(64)]
    a, b = b"\x01" * EPOCH_BYTES, b"\x02" * EPOCH_BYTES  # structured epochs and hashes: still never the same key
    for tp_size, shared in ((1, False), (4, False), (2, True)):
        keys_a = set(lookup_keys(hashes, tp_size, shared, a))
        keys_b = set(lookup_keys(hashes, tp_size, shared, b))
        assert not keys_a & keys_b and len(keys_a) == len(hashes) * (1 if shared else tp_size)
    assert block_keys(hashes, 0, 1, False, b"") == block_keys(hashes, 0, 1, False)  # no epoch: the plain keys
    ints = list(range(1000))  # int engine hashes (e.g. a 64-bit xxhash): small, structured
    assert not set(block_keys(ints, 0, 1, False, a)) & set(block_keys(ints, 0, 1, False, b))

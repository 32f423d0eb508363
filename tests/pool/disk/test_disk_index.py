"""The disk tier's index (`ems.pool.disk.index.DiskIndex`) driven as the writer and the callers drive it, against a
simulated directory and a model of the LRU order: the bytes it counts are the bytes of the files there, every
path it hands out is a file there of the right size, evictions take the least recently used records first, and the
capacity holds except for the one record a batch may overshoot with."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from ems.pool.disk.index import DiskIndex, IndexedRecord
from ems.pool.disk.records import ALIGN, key_hash, temporary_path

ROOT = "/disk"
KEYS = [key_hash(f"key-{i}".encode()) for i in range(12)]

write = st.tuples(
    st.just("write"), st.lists(st.tuples(st.integers(0, 11), st.integers(1, 4), st.booleans()), min_size=1, max_size=4)
)
one_key = st.tuples(st.sampled_from(["invalidate", "touch", "discard"]), st.integers(0, 11))
full = st.tuples(st.just("full"), st.integers(0, 3))


class Directory:
    """Files by path and their sizes; each operation checks that the file it names is there (or is not)."""

    def __init__(self) -> None:
        self.files: dict[str, int] = {}

    def create(self, path: str, nbytes: int) -> None:
        assert path not in self.files, path
        self.files[path] = nbytes

    def rename(self, source: str, target: str) -> None:
        assert source in self.files and target not in self.files, (source, target)
        self.files[target] = self.files.pop(source)

    def unlink(self, path: str) -> None:
        assert path in self.files, path
        del self.files[path]


class Model:
    """The index under test, the directory it manages, and the LRU order it must keep."""

    def __init__(self, capacity: int) -> None:
        self.index = DiskIndex(ROOT, capacity)
        self.disk = Directory()
        self.lru: OrderedDict[bytes, int] = OrderedDict()  # digest -> file bytes, least recently used first
        self.seq = 0
        self.by_path: dict[str, bytes] = {}
        self.ceiling = capacity  # the bytes the files may take: the capacity, or what a full filesystem held

    def evicted(self, paths: list[str]) -> None:
        """`paths` were dropped from the index: they must be the oldest records, in order, and files that exist."""
        for path in paths:
            if path in self.by_path:  # a record (not a spare): the least recently used one
                digest = self.by_path.pop(path)
                oldest = next(iter(self.lru))
                assert digest == oldest, "evicted a record that was not the least recently used"
                del self.lru[digest]
            self.disk.unlink(path)

    def write(self, batch: list[tuple[int, int, bool]]) -> None:
        """One writer batch: reserve room for each (the first may overshoot), write, then name or keep as a spare."""
        jobs = []
        for key, pages, superseded in batch:
            nbytes = pages * ALIGN
            fits, reuse, doomed = self.index.reserve(nbytes, overshoot=not jobs)
            self.evicted(doomed)
            if reuse is not None and reuse in self.by_path:  # a record of the size evicted to be overwritten
                self.evicted_keep(reuse)
            if not fits:
                break
            self.seq += 1
            tmp = temporary_path(self.index.path(KEYS[key], IndexedRecord(nbytes, self.seq)))
            if reuse is not None:
                assert self.disk.files[reuse] == nbytes, "a reused file of another size"
                self.disk.rename(reuse, tmp)
            else:
                self.disk.create(tmp, nbytes)
            jobs.append((key, nbytes, self.seq, tmp, superseded))
        for key, nbytes, seq, tmp, superseded in jobs:
            self.index.release(nbytes)
            if superseded:
                self.index.add_spare(tmp, nbytes)
                continue
            digest = KEYS[key]
            record = IndexedRecord(nbytes, seq)
            path = self.index.path(digest, record)
            self.disk.rename(tmp, path)
            old = self.index.insert(digest, record)
            self.lru.pop(digest, None)
            self.lru[digest] = nbytes
            self.by_path = {p: d for p, d in self.by_path.items() if d != digest}
            self.by_path[path] = digest
            if old is not None:
                self.keep_spare(*old)
        if sum(self.disk.files.values()) > self.ceiling:  # only the batch's first record overshoots
            assert set(self.lru) <= {KEYS[key] for key, _, _ in batch}, "over the capacity with older records kept"

    def evicted_keep(self, path: str) -> None:
        """A record evicted to have its file overwritten: the least recently used one; its file stays."""
        digest = self.by_path.pop(path)
        assert digest == next(iter(self.lru)), "evicted a record that was not the least recently used"
        del self.lru[digest]

    def keep_spare(self, path: str, nbytes: int) -> None:
        spare = temporary_path(path)
        self.disk.rename(path, spare)
        self.index.spare_kept(spare, nbytes)

    def one_key(self, op: str, key: int) -> None:
        digest = KEYS[key]
        if op == "invalidate":
            retired = self.index.retire(digest)
            assert (retired is not None) == (digest in self.lru)
            if retired is not None:
                del self.lru[digest]
                self.by_path.pop(retired[0])
                self.keep_spare(*retired)
        elif op == "touch":
            assert self.index.touch(digest) == (digest in self.lru)
            if digest in self.lru:
                self.lru.move_to_end(digest)
        else:
            record = self.index.get(digest)
            if record is not None:
                path = self.index.discard(digest, record)
                assert path is not None and self.index.discard(digest, record) is None
                del self.lru[digest]
                self.by_path.pop(path)
                self.disk.unlink(path)

    def full(self, drops: int) -> None:
        """The filesystem was found full: keep within what it holds, and make room `drops` times."""
        self.ceiling = min(self.ceiling, max(ALIGN, sum(self.disk.files.values())))
        self.index.found_full(0)
        for _ in range(drops):
            dropped = self.index.make_room()
            assert len(dropped) == 1 or not self.disk.files, "nothing dropped while files are there"
            self.evicted(dropped)

    def check(self) -> None:
        assert self.index.used + self.index.spare_bytes == sum(self.disk.files.values())
        assert self.index.used == sum(self.lru.values()) and len(self.index) == len(self.lru)
        for path, digest in self.by_path.items():
            record = self.index.get(digest)
            assert record is not None and self.index.path(digest, record) == path
            assert self.disk.files[path] == record.nbytes


@settings(max_examples=300, deadline=None)
@given(capacity_pages=st.integers(2, 16), ops=st.lists(st.one_of(write, one_key, full), max_size=60))
def test_the_index_counts_the_files_there_and_evicts_least_recently_used_first(capacity_pages, ops):
    model = Model(capacity_pages * ALIGN)
    for op in ops:
        if op[0] == "write":
            model.write(op[1])
        elif op[0] == "full":
            model.full(op[1])
        else:
            model.one_key(*op)
        model.check()
    model.evicted(model.index.evict_to(0))  # the rest, least recently used first
    assert not model.lru and model.index.used == 0
    model.evicted(model.index.drop_spares(0))
    assert model.index.spare_bytes == 0 and not model.disk.files


def test_restore_indexes_oldest_first_and_evicts_down_to_the_capacity():
    index = DiskIndex(ROOT, 3 * ALIGN)
    found = {KEYS[i]: IndexedRecord(ALIGN, seq=i) for i in range(5)}
    doomed = index.restore(found)
    assert doomed == [index.path(KEYS[i], found[KEYS[i]]) for i in range(2)]
    assert index.used == 3 * ALIGN and [KEYS[i] in index for i in range(5)] == [False, False, True, True, True]


def test_a_touched_record_outlives_older_ones():
    model = Model(3 * ALIGN)
    for key in range(3):
        model.write([(key, 1, False)])
    model.one_key("touch", 0)
    model.write([(3, 1, False)])  # evicts the least recently used: key 1, not the touched key 0
    model.check()
    assert list(model.lru) == [KEYS[2], KEYS[0], KEYS[3]]

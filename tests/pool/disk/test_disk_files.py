"""The disk tier's directory (`ems.pool.disk.files`) on a real directory: what a restart finds from the names alone
(oldest first, the newer of a key's two records, temporary files and the older record stale, other names ignored),
and reads of record files (a truncated file reads as the bytes there are, which the record check then refuses)."""

from __future__ import annotations

import os

import numpy as np
from pool_testlib import joined, make_values

from ems.pool.disk import files
from ems.pool.disk.records import ALIGN, decode_record, encode_record, key_hash, record_bytes, record_path


def _write_record(root: str, key: bytes, value: bytes, seq: int) -> str:
    data = bytearray(record_bytes(len(key), len(value)))
    nbytes = encode_record(np.frombuffer(data, dtype=np.uint8), key, value, seq)
    path = record_path(root, key_hash(key), seq, nbytes)
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_scan_finds_records_oldest_first_and_names_what_is_stale(tmp_path):
    root = str(tmp_path)
    files.prepare(root)
    value = joined(make_values(1, 3000, seed=1)[0])
    keys = [f"k{i}".encode() for i in range(6)]
    seqs = [50, 10, 40, 20, 30, 60]
    paths = [_write_record(root, k, value, s) for k, s in zip(keys, seqs)]
    older = _write_record(root, keys[0], value, 5)  # killed between naming the newer record and dropping this one
    cut_short = os.path.join(os.path.dirname(paths[1]), os.path.basename(paths[1])[:-4] + ".tmp")
    open(cut_short, "wb").close()
    foreign = os.path.join(os.path.dirname(paths[2]), "notes.txt")
    open(foreign, "wb").close()
    found = files.scan(root)
    by_seq = sorted(zip(seqs, keys))
    # oldest first (the LRU order); key 0's newer record (50) in its own place, not its older one's (5)
    assert list(found.records) == [key_hash(k) for _, k in by_seq]
    assert [r.seq for r in found.records.values()] == sorted(seqs)
    assert all(r.nbytes == record_bytes(2, len(value)) for r in found.records.values())
    assert found.last_seq == 60
    assert sorted(found.stale) == sorted([older, cut_short])
    assert os.path.exists(foreign)  # never ours to remove


def test_scan_of_an_empty_directory(tmp_path):
    files.prepare(str(tmp_path))
    found = files.scan(str(tmp_path))
    assert found.records == {} and found.last_seq == 0 and found.stale == []


def test_a_truncated_record_reads_short_and_is_refused(tmp_path):
    root = str(tmp_path)
    files.prepare(root)
    key = b"tenant/key"
    value = joined(make_values(1, 9000, seed=2)[0])
    path = _write_record(root, key, value, 1)
    reader = files.RecordReader()
    reader.direct = files.probe_direct(root)
    nbytes = record_bytes(len(key), len(value))
    assert bytes(decode_record(reader.read(path, nbytes), key)) == value
    os.truncate(path, nbytes - ALIGN)
    data = reader.read(path, nbytes)
    assert data.size == nbytes - ALIGN and decode_record(data, key) is None

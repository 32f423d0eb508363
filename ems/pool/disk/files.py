"""The disk tier's directory on the callers' side: its folders, the I/O mode, what a restart finds, reads of record
files, removing files. No state of the tier and no lock: the tier calls these without holding its lock.

Contract:
* `prepare(root)` creates the root and its 256 folders (`records.folder_name`).
* `probe_direct(root)`: `os.O_DIRECT` when the filesystem takes it (tmpfs before Linux 6.6 and some others refuse
  it), else 0 (buffered I/O); docs/guides/disk-tier.md says why O_DIRECT.
* `scan(root)`: what a restart finds, from the names alone (a listing of each folder, its names parsed in one
  vectorised pass, no file opened): every record, oldest sequence first (the LRU order); where a key has two records
  (killed between naming the new one and dropping the old one) the newer wins, in its own place in that order, and
  the older is stale, as is every temporary file (a write cut short: never named, never served).
* `RecordReader.read(path, nbytes)`: a record file's bytes (a truncated file: the bytes there are) in this thread's
  aligned bounce buffer, valid until this thread's next read; OSError as the system call raised it.
* `unlink_all(paths)`: removes what is there, quietly (already gone, or the disk failed: nothing to do either way).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ems.pool.disk.index import IndexedRecord
from ems.pool.disk.records import ALIGN, TMP_SUFFIX, aligned_buffer, parse_names, record_path

FOLDERS = [f"{i:02x}" for i in range(256)]


def prepare(root: str) -> None:
    os.makedirs(root, exist_ok=True)
    for folder in FOLDERS:
        os.makedirs(os.path.join(root, folder), exist_ok=True)


def probe_direct(root: str) -> int:
    """os.O_DIRECT when the filesystem takes it, else 0 (see the module docstring)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return 0
    path = os.path.join(root, f"probe{TMP_SUFFIX}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o600)
        try:
            os.pwrite(fd, aligned_buffer(ALIGN).data, 0)
        finally:
            os.close(fd)
        return flag
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        return 0
    finally:
        unlink_all([path])


@dataclass
class Scan:
    """What a restart found: the records by key hash, oldest first, the newest sequence, and the files to remove."""

    records: dict[bytes, IndexedRecord]
    last_seq: int
    stale: list[str]


def scan(root: str) -> Scan:
    """The records under `root` from their names (see the module docstring)."""
    stale: list[str] = []
    hashes: list[bytes] = []
    seq_parts, size_parts = [], []
    for name in FOLDERS:
        folder = os.path.join(root, name)
        names = os.listdir(folder)
        # a write cut short: never named, never served
        stale += [os.path.join(folder, n) for n in names if n.endswith(TMP_SUFFIX)]
        found, seqs, sizes, _ = parse_names(names)
        hashes += found
        seq_parts.append(seqs)
        size_parts.append(sizes)
    seqs = np.concatenate(seq_parts)
    order = np.argsort(seqs, kind="stable")  # oldest first: the LRU order
    ordered_hashes = [hashes[j] for j in order.tolist()]
    records = list(map(IndexedRecord._make, zip(np.concatenate(size_parts)[order].tolist(), seqs[order].tolist())))
    ordered = dict(zip(ordered_hashes, records))  # a key written twice: the newer wins
    if len(ordered) < len(records):  # killed between naming a new record and dropping the old one
        kept = {id(r) for r in ordered.values()}
        stale += [record_path(root, h, r.seq, r.nbytes) for h, r in zip(ordered_hashes, records) if id(r) not in kept]
        # and it takes the newer one's place in the LRU order (a dict keeps a key where it was first inserted)
        ordered = {h: ordered[h] for h in reversed(dict.fromkeys(reversed(ordered_hashes)))}
    return Scan(ordered, int(seqs.max()) if seqs.size else 0, stale)


class RecordReader:
    """Reads record files into a per-thread aligned bounce buffer (see the module docstring)."""

    def __init__(self) -> None:
        self.direct = 0  # os.O_DIRECT or 0 (`probe_direct`), set when the tier opens
        self._local = threading.local()

    def read(self, path: str, nbytes: int) -> np.ndarray:
        bounce: np.ndarray | None = getattr(self._local, "bounce", None)
        if bounce is None or bounce.size < nbytes:
            bounce = aligned_buffer(max(nbytes, 1 << 20))
            self._local.bounce = bounce
        fd = os.open(path, os.O_RDONLY | self.direct)
        try:
            got = os.preadv(fd, [bounce.data[:nbytes]], 0)
        finally:
            os.close(fd)
        return bounce[:got]


def unlink_all(paths: Sequence[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError:  # already gone, or the disk failed: nothing to do either way
            pass

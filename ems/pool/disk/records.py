"""The disk tier's record file: its bytes and its name. Pure functions of their arguments (no I/O, no state, no lock).

Contract:
* Bytes: `HEADER_BYTES` header (magic 'EMSD', version, key length, value length, sequence number, and an XXH3 over
  those fields, the key and the value's own 40-byte header), the full key (tenant prefix included), the EMS value;
  zero padding to `ALIGN` (O_DIRECT; no stale bytes of an earlier record of the file). The value's header carries
  the payload's checksum (`ems.store.value_format`), so the record's check and the value's check together cover
  every byte. `decode_record` trusts nothing: a record whose header, key, lengths or checksums do not match (a
  flipped byte, a truncated file, another key's record) is None.
* Names: `XX/<xxh3-128 of the key>-<sequence>-<file bytes>.rec` under the tier's root (XX: the hash's first byte;
  the numbers as 16 hex digits, so every name has one length, `NAME_LENGTH`), and `.tmp` for a file not (or no
  longer) named as a record. `parse_names` reads a folder's names back in one vectorised pass (a restart parses
  every record's name) and leaves out any other name.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Sequence

import numpy as np
import xxhash

from ems.buffers import Buffer
from ems.store.value_format import HEADER_SIZE, is_well_formed

ALIGN = 4096
MAGIC = 0x44534D45  # b"EMSD" read as little-endian u32
RECORD_VERSION = 1
_HEADER = struct.Struct("<IHHQQQ")  # magic, version, key_len, value_len, seq, check
HEADER_BYTES = _HEADER.size  # 32
_CHECKED = struct.Struct("<IHHQQ")  # the fields the check covers (all but the check itself)
SUFFIX = ".rec"
TMP_SUFFIX = ".tmp"
NAME_LENGTH = 32 + 1 + 16 + 1 + 16 + len(SUFFIX)
_HEX = np.full(256, 255, dtype=np.uint8)
_HEX[np.frombuffer(b"0123456789abcdef", dtype=np.uint8)] = np.arange(16, dtype=np.uint8)
_SHIFTS = np.arange(60, -4, -4, dtype=np.uint64)


def key_hash(key: bytes) -> bytes:
    """The 128-bit hash a record of `key` is named and indexed by."""
    return xxhash.xxh3_128_digest(key)


def record_bytes(key_len: int, value_len: int) -> int:
    """File bytes of a record: header, key and value, padded to ALIGN."""
    return -(-(HEADER_BYTES + key_len + value_len) // ALIGN) * ALIGN


def record_name(digest: bytes, seq: int, nbytes: int) -> str:
    """A record file's name: fixed width (`NAME_LENGTH`), so a folder's names are parsed in one vectorised pass."""
    return f"{digest.hex()}-{seq:016x}-{nbytes:016x}{SUFFIX}"


def folder_name(digest: bytes) -> str:
    """The folder (under the root) of a key hash's records: its first byte in hex."""
    return f"{digest[0]:02x}"


def record_path(root: str, digest: bytes, seq: int, nbytes: int) -> str:
    """The path of a named record."""
    return os.path.join(root, folder_name(digest), record_name(digest, seq, nbytes))


def temporary_path(path: str) -> str:
    """The temporary name beside a record's path (a file being written, or kept as a spare)."""
    return path[: -len(SUFFIX)] + TMP_SUFFIX


def aligned_buffer(nbytes: int) -> np.ndarray:
    """`nbytes` (a multiple of ALIGN) of page-aligned anonymous memory (O_DIRECT needs aligned buffers)."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, ALIGN)), dtype=np.uint8)[:nbytes]


def _record_check(fields: bytes, key: Buffer, value_header: Buffer) -> int:
    hasher = xxhash.xxh3_64()
    hasher.update(fields)
    hasher.update(key)
    hasher.update(value_header)
    return hasher.intdigest()


def encode_record(target: np.ndarray, key: bytes, value: Buffer, seq: int) -> int:
    """Write the record of (key, value) into `target` (at least `record_bytes` long); returns its file bytes."""
    view = np.frombuffer(value, dtype=np.uint8)
    fields = _CHECKED.pack(MAGIC, RECORD_VERSION, len(key), view.size, seq)
    check = _record_check(fields, key, view[:HEADER_SIZE].data)
    nbytes = record_bytes(len(key), view.size)
    target[:HEADER_BYTES] = np.frombuffer(fields + struct.pack("<Q", check), dtype=np.uint8)
    target[HEADER_BYTES : HEADER_BYTES + len(key)] = np.frombuffer(key, dtype=np.uint8)
    start = HEADER_BYTES + len(key)
    target[start : start + view.size] = view
    target[start + view.size : nbytes] = 0  # padding: no stale bytes of an earlier record on disk
    return nbytes


def value_of(record: np.ndarray, key_len: int, value_len: int) -> np.ndarray:
    """The value's bytes inside an encoded record (of a key of `key_len` bytes and a value of `value_len`)."""
    start = HEADER_BYTES + key_len
    return record[start : start + value_len]


def decode_record(data: np.ndarray, key: bytes) -> np.ndarray | None:
    """The value in record bytes `data` when it is a whole, undamaged record of `key`, else None."""
    if data.size < HEADER_BYTES:
        return None
    magic, version, key_len, value_len, seq, check = _HEADER.unpack(data[:HEADER_BYTES].tobytes())
    start = HEADER_BYTES + key_len
    if magic != MAGIC or version != RECORD_VERSION or key_len != len(key) or start + value_len > data.size:
        return None
    if value_len < HEADER_SIZE or data[HEADER_BYTES:start].tobytes() != key:
        return None
    value = data[start : start + value_len]
    fields = _CHECKED.pack(magic, version, key_len, value_len, seq)
    if _record_check(fields, key, value[:HEADER_SIZE].data) != check or not is_well_formed(value.data):
        return None
    return value


def parse_names(names: Sequence[str]) -> tuple[list[bytes], np.ndarray, np.ndarray, np.ndarray]:
    """The record names among `names`: (key hashes, sequences u64, file bytes u64, their positions in `names`),
    parsed in one vectorised pass (a restart parses every record's name). Any other name is left out."""
    positions = np.flatnonzero(np.fromiter(map(len, names), dtype=np.int64, count=len(names)) == NAME_LENGTH)
    joined = "".join([names[i] for i in positions.tolist()])
    if not joined.isascii():  # not ours (our names are hex): parse the ASCII ones only
        ascii_positions = [i for i in positions.tolist() if names[i].isascii()]
        positions = np.asarray(ascii_positions, dtype=np.int64)
        joined = "".join([names[i] for i in ascii_positions])
    chars = np.frombuffer(joined.encode("ascii"), dtype=np.uint8).reshape(-1, NAME_LENGTH)
    digits = _HEX[chars]
    hex_columns = np.r_[0:32, 33:49, 50:66]
    ok = (
        (digits[:, hex_columns] != 255).all(axis=1)
        & (chars[:, 32] == ord("-"))
        & (chars[:, 49] == ord("-"))
        & (chars[:, 66:] == np.frombuffer(SUFFIX.encode(), dtype=np.uint8)).all(axis=1)
    )
    digits, positions = digits[ok], positions[ok]
    raw = (digits[:, 0:32:2] << 4 | digits[:, 1:32:2]).tobytes()
    hashes = [raw[i : i + 16] for i in range(0, len(raw), 16)]
    seqs = (digits[:, 33:49].astype(np.uint64) << _SHIFTS).sum(axis=1, dtype=np.uint64)
    sizes = (digits[:, 50:66].astype(np.uint64) << _SHIFTS).sum(axis=1, dtype=np.uint64)
    return hashes, seqs, sizes, positions

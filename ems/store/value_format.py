"""The stored value format: a fixed header, then the payload (the block's bytes).

Every value in the pool carries a 40-byte little-endian header, so that a value written by a differently shaped
engine, a torn write or a damaged byte is detected and treated as a miss, never copied into an engine's cache:

    magic u32 'EMSV' | version u16 | kind u16 | layout_sig u64 | tokens_digest u64 | payload_len u64 | checksum u64

`layout_sig` is the registered layout's signature (V1) or 0 (V0 raw values); `tokens_digest` identifies how many
tokens of each layer group the value holds; `checksum` is XXH3-64 of the payload.

Versions. `version` names the payload's format. A client accepts only values of its own `VERSION`: a value written
by another version is a miss (recomputed, then overwritten), never a wrong block. A pool node, which only checks
that a value is well formed (header, length, checksum), stores every version it knows (`NODE_VERSIONS`), so
clients and nodes can be upgraded in any order.
* 1: a V1 value is per layer group `[tokens, planes, row]`, every plane of the group with one row size and dtype.
* 2: a V1 value is per layer group, token by token, every plane's row back to back; planes may differ in row size
  and dtype (MLA with split K/V). The layout signature names every plane's dtype, heads and head size.
* 3 (now): a V1 value is per layer group, plane by plane: plane p's rows of the block's n tokens back to back
  (`[planes][n][row]`; planes may still differ in row size and dtype). A (block, plane) is then one contiguous
  run in the value AND, where the engine's rows are contiguous in a block, in the cache: gather and scatter move
  whole spans instead of token rows. Same header; only the payload's order changed, so a version-2 value (same
  length, same checksum rules) must be, and is, a miss for a version-3 client.
"""

from __future__ import annotations

import ctypes
import enum
import importlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import xxhash

from ems.buffers import Buffer
from ems.kernels.host_copy import buffer_addresses, copy_buffers, copy_lengths, host_copy

MAGIC = 0x56534D45  # b"EMSV" read as little-endian u32
VERSION = 3
NODE_VERSIONS = frozenset(range(1, VERSION + 1))  # what a pool node stores (see the module docstring)
HEADER_DTYPE = np.dtype(
    [
        ("magic", "<u4"),
        ("version", "<u2"),
        ("kind", "<u2"),
        ("layout_sig", "<u8"),
        ("tokens_digest", "<u8"),
        ("payload_len", "<u8"),
        ("checksum", "<u8"),
    ]
)
HEADER_SIZE = HEADER_DTYPE.itemsize  # 40
# A value placed this many bytes past a 64-byte boundary has its payload (after the header) on a cache line: stored
# buffers and staging values are placed so, and the copy backends then read and write whole lines (index_select
# into a line-aligned target is measurably faster: perf/RESULTS.md, "Figures behind design choices").
VALUE_LEAD = (-HEADER_SIZE) % 64
header_struct = struct.Struct("<IHHQQQQ")  # the same fields, for a few headers at a time (or one by one)
_FEW = 4
_SUM_IN_PYTHON_UP_TO = 64  # values: ExpectedValues.payload_bytes


class ValueKind(enum.IntEnum):
    RAW_V0 = 1  # concatenated KvBufferWrapper ranges
    BLOCKS_V1 = 2  # one block: per layer group `[planes, tokens, row]` (version 3)
    NS_RECORD = 3  # a namespace record: JSON (`ems.store.ns_records`)


def _xxh3_holding_the_gil() -> Callable[[int, int], int] | None:
    """XXH3-64 (seed 0) of `length` bytes at an address, through the xxhash extension's own exported C function,
    called with the GIL held (`ctypes.PyDLL` does not release it); None where the extension does not export it.

    Why: xxhash's Python functions release the GIL for a large input, and beside a thread that keeps the GIL (an
    engine's busy Python loop) each release can cost a switch interval (5 ms) to get it back: once per value of a
    load's verify (perf/RESULTS.md, "The 62 MiB load beside a busy Python thread"). Hashing holds the GIL for the
    time of the hash instead (tens of µs for a block)."""
    try:
        extension = importlib.import_module("xxhash._xxhash")  # its C module (not in xxhash's type stubs)
        library = ctypes.PyDLL(extension.__file__)
        function = getattr(library, "XXH3_64bits_dispatch", None) or library.XXH3_64bits  # (see `_xxh3_addresses`)
    except (ImportError, OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    function.restype = ctypes.c_uint64
    return cast(Callable[[int, int], int], function)


def _xxh3_addresses(names: Sequence[str]) -> list[int] | None:
    """The addresses of the xxhash extension's exported C functions `names` (for the C loops of
    `kernels/host_copy.c`), each replaced by its `_dispatch` form where the extension exports one (the same digests,
    computed with the widest vector unit of the CPU running it); None where any is missing."""
    try:
        library = ctypes.PyDLL(importlib.import_module("xxhash._xxhash").__file__)
        functions = [getattr(library, n + "_dispatch", None) or getattr(library, n) for n in names]
    except (ImportError, OSError, AttributeError):
        return None
    return [cast(int, ctypes.cast(f, ctypes.c_void_p).value) for f in functions]


_XXH3_HOLDING_THE_GIL = _xxh3_holding_the_gil()
# XXH3-64's address, for `payload_checksums`'s one C loop over many values and for a copy backend that verifies
# while it scatters (None where xxhash does not export it)
_ONE_SHOT = _xxh3_addresses(["XXH3_64bits"])
PAYLOAD_HASH_ADDRESS: int | None = None if _ONE_SHOT is None else _ONE_SHOT[0]
# XXH3-64's streaming functions (create, free, reset, update, digest: `host_copy.c`'s `ems_stream_hash`), for a
# copy that hashes each step as it copies it (`copy_well_formed_many`); None where xxhash does not export them
_STREAM_HASH = _xxh3_addresses(
    ["XXH3_createState", "XXH3_freeState", "XXH3_64bits_reset", "XXH3_64bits_update", "XXH3_64bits_digest"]
)
STREAM_HASH_TABLE: np.ndarray | None = None if _STREAM_HASH is None else np.array(_STREAM_HASH, dtype=np.int64)
# from this size on xxhash's own call may release the GIL (it does at 512 KiB, not at 64 KiB, on xxhash 3.x and 4.x);
# below it the direct call is cheaper than taking the buffer's address
_GIL_HELD_FROM = 64 << 10


def checksum(parts: Sequence[Buffer]) -> int:
    """XXH3-64 of the concatenation of `parts` (streamed, no copy). A large single part is hashed with the GIL held
    (`_xxh3_holding_the_gil`); the result is the same."""
    if len(parts) == 1:
        return part_checksum(parts[0])
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)
    return hasher.intdigest()


def part_checksum(part: Buffer) -> int:
    """`checksum([part])`: XXH3-64 of one buffer (a small one straight through xxhash, a large one with the GIL
    held). The per-value call of every save's encode and every load's verify."""
    if len(part) < _GIL_HELD_FROM or _XXH3_HOLDING_THE_GIL is None:
        return xxhash.xxh3_64_intdigest(part)
    try:
        view = np.frombuffer(part, dtype=np.uint8)  # any contiguous buffer, read-only ones included
    except (ValueError, TypeError):
        return xxhash.xxh3_64_intdigest(part)
    return int(_XXH3_HOLDING_THE_GIL(view.ctypes.data, view.nbytes))  # `view` keeps the buffer alive


def payload_checksums(values: Sequence[Buffer]) -> list[int]:
    """`part_checksum` of each value's payload (its bytes after the header; each value at least HEADER_SIZE bytes,
    contiguous). Two values or more go through one C loop (`kernels/host_copy`, xxhash's own XXH3): one call per
    load's verify or save's encode instead of one per value, holding the GIL for a small batch and releasing it
    once for a large one. The digests are the same either way."""
    library = host_copy() if len(values) > 1 else None
    if library is None or PAYLOAD_HASH_ADDRESS is None:
        return [part_checksum(memoryview(v)[HEADER_SIZE:]) for v in values]
    lens = [memoryview(v).nbytes - HEADER_SIZE for v in values]
    if min(lens) < 0:
        raise ValueError("a value shorter than its header")
    ptrs = buffer_addresses(values) + HEADER_SIZE  # (`values` keeps every buffer alive through the call)
    digests = library.hash_many(PAYLOAD_HASH_ADDRESS, ptrs, np.array(lens, dtype=np.int64), sum(lens))
    return cast(list[int], digests.tolist())


def tokens_digest(token_counts: np.ndarray) -> np.ndarray:
    """One u64 per block from its per-group token counts.

    token_counts: int `[blocks, groups]`. Vectorised: sum over groups of count * odd multiplier, mod 2**64.
    """
    counts = np.asarray(token_counts, dtype=np.uint64)
    multipliers = (np.arange(counts.shape[1], dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)
    digests: np.ndarray = (counts * multipliers).sum(axis=1, dtype=np.uint64)
    return digests


@dataclass(frozen=True)
class ExpectedValues:
    """What a request expects each of its values to be; anything else is a miss."""

    kind: ValueKind
    layout_sig: int
    tokens_digest: np.ndarray  # u64 [n]
    payload_len: np.ndarray  # int64 [n]

    def payload_bytes(self, a: int = 0, b: int | None = None) -> int:
        """The payload bytes of values a..b-1 (b None: to the end). Python's sum for a few values (numpy's per-call
        overhead is the larger cost there: a small call reads this several times)."""
        lengths = self.payload_len[a:b]
        return sum(lengths.tolist()) if lengths.size <= _SUM_IN_PYTHON_UP_TO else int(lengths.sum())

    def range(self, a: int, b: int) -> ExpectedValues:
        """Values a..b-1 (value 0 of the result is value a of this)."""
        return ExpectedValues(self.kind, self.layout_sig, self.tokens_digest[a:b], self.payload_len[a:b])


def build_headers(expected: ExpectedValues, checksums: Sequence[int], start: int = 0) -> list[bytes]:
    """The header of each of values start .. start + len(checksums) - 1, as `bytes` of `HEADER_SIZE` (vectorised)."""
    n = len(checksums)
    if n <= _FEW:  # a small call: struct is several times faster than numpy's per-call overhead
        return [
            header_struct.pack(
                MAGIC,
                VERSION,
                int(expected.kind),
                expected.layout_sig,
                int(expected.tokens_digest[start + i]),
                int(expected.payload_len[start + i]),
                checksums[i],
            )
            for i in range(n)
        ]
    headers = np.zeros(n, dtype=HEADER_DTYPE)
    headers["magic"] = MAGIC
    headers["version"] = VERSION
    headers["kind"] = int(expected.kind)
    headers["layout_sig"] = expected.layout_sig
    headers["tokens_digest"] = expected.tokens_digest[start : start + n]  # a save may stop early, or go by chunks
    headers["payload_len"] = expected.payload_len[start : start + n]
    headers["checksum"] = np.asarray(checksums, dtype=np.uint64)
    packed = headers.tobytes()
    return [packed[i * HEADER_SIZE : (i + 1) * HEADER_SIZE] for i in range(n)]


_HEAD_NAMES = [name for name in HEADER_DTYPE.names or () if name != "checksum"]
_HEAD_DTYPE = np.dtype({"names": _HEAD_NAMES, "formats": [HEADER_DTYPE[name] for name in _HEAD_NAMES]})
HEAD_BYTES = _HEAD_DTYPE.itemsize  # 32: a header's fields before its checksum (known before the payload is)


def expected_heads(expected: ExpectedValues, a: int, b: int) -> np.ndarray:
    """uint8 `[b - a, 32]`: the first `HEAD_BYTES` of the headers of values a..b-1 (magic .. payload length:
    everything but the checksum), as a save writes them and a load expects them."""
    heads = np.empty(b - a, dtype=_HEAD_DTYPE)
    heads["magic"] = MAGIC
    heads["version"] = VERSION
    heads["kind"] = int(expected.kind)
    heads["layout_sig"] = expected.layout_sig
    heads["tokens_digest"] = expected.tokens_digest[a:b]
    heads["payload_len"] = expected.payload_len[a:b]
    return heads.view(np.uint8).reshape(b - a, HEAD_BYTES)


def encode_in_place(
    values: Sequence[Buffer], expected: ExpectedValues, start: int = 0, addresses: Sequence[int] | np.ndarray | None = None
) -> None:
    """A save's encode: `values[i]` is the whole buffer of value `start + i` of `expected` (writable, contiguous,
    `HEADER_SIZE` + its payload length; checked), its payload already in place; its payload's checksum is computed
    and its header written before it. More than a few values take one C call (`kernels/host_copy.c`
    `ems_encode_values`: each value hashed and headed in turn, one GIL hand-over for a large batch); `addresses`
    (optional) are the buffers' addresses where the caller already knows them."""
    n = len(values)
    lengths = expected.payload_len[start : start + n]
    library = host_copy() if n > _FEW else None
    if library is None or PAYLOAD_HASH_ADDRESS is None:
        views = [memoryview(value).cast("B") for value in values]
        if [view.nbytes - HEADER_SIZE for view in views] != lengths.tolist():
            raise ValueError("every value must be its header and payload long")
        kind, signature, pack = int(expected.kind), expected.layout_sig, header_struct.pack_into
        for view, digest, length in zip(views, expected.tokens_digest[start : start + n].tolist(), lengths.tolist()):
            pack(view, 0, MAGIC, VERSION, kind, signature, digest, length, part_checksum(view[HEADER_SIZE:]))
        return
    sizes = np.fromiter(map(len, values), dtype=np.int64, count=n)  # bytes: numpy arrays and memoryviews of uint8
    if lengths.size != n or not np.array_equal(sizes, lengths + HEADER_SIZE):
        raise ValueError("every value must be its header and payload long")
    # (`values` keeps every buffer alive through the call)
    at = buffer_addresses(values) if addresses is None else np.asarray(addresses, dtype=np.int64)
    if at.shape != (n,):
        raise ValueError("addresses must be one per value")
    total = int(sizes.sum())
    library.encode_values(PAYLOAD_HASH_ADDRESS, expected_heads(expected, start, start + n), at, lengths, total)


def parse_header(value: Buffer, versions: frozenset[int] = frozenset({VERSION})) -> np.void | None:
    """The header fields of a stored value, or None when it is too short, not an EMS value, or of a version not in
    `versions` (by default this client's own)."""
    if len(value) < HEADER_SIZE:
        return None
    header: np.void = np.frombuffer(value, dtype=HEADER_DTYPE, count=1)[0]
    if int(header["magic"]) != MAGIC or int(header["version"]) not in versions:
        return None
    return header


def is_well_formed(value: Buffer) -> bool:
    """Header of a known version (`NODE_VERSIONS`), length consistent and checksum right: what a pool node checks
    before storing."""
    stated = _stated_checksum(value)
    return stated is not None and part_checksum(memoryview(value)[HEADER_SIZE:]) == stated


def _stated_checksum(value: Buffer) -> int | None:
    """The checksum a value's header states, when the header is of a known version (`NODE_VERSIONS`) and the
    length it states is the value's; else None."""
    header = parse_header(value, NODE_VERSIONS)
    if header is None or len(value) != HEADER_SIZE + int(header["payload_len"]):
        return None
    return int(header["checksum"])


def well_formed_many(values: Sequence[Buffer]) -> list[bool]:
    """`is_well_formed` of each value, their checksums in one batch (`payload_checksums`: one call, which gives the
    GIL away once for a large batch, so that a node's event loop keeps progressing UCX while its worker verifies)."""
    ok = [False] * len(values)
    candidates: list[int] = []
    stated: list[int] = []
    for i, value in enumerate(values):
        checksum = _stated_checksum(value)
        if checksum is not None:
            candidates.append(i)
            stated.append(checksum)
    for i, computed, want in zip(candidates, payload_checksums([values[i] for i in candidates]), stated):
        ok[i] = computed == want
    return ok


def copy_well_formed_many(dsts: Sequence[Buffer], srcs: Sequence[Buffer]) -> list[bool]:
    """Copy each value of `srcs` into the writable buffer of `dsts` beside it (same lengths), then `is_well_formed`
    of each copy: what a node stores out of memory its client can still write (a shared-memory region), so the copy
    is what is checked, never the source. Two values or more go through one C loop that hashes each copy 64 KiB at a
    time, right after copying them, while they are in cache: one pass over the bytes instead of a copy and a hash
    batch (half the time of the two for 32 x 1 MiB on this project's CI host, perf/RESULTS.md)."""
    library = host_copy() if len(srcs) > 1 else None
    if library is None or STREAM_HASH_TABLE is None:
        copy_buffers(dsts, srcs)
        return well_formed_many(dsts)
    lengths = copy_lengths(dsts, srcs)
    long_enough = lengths >= HEADER_SIZE
    if not long_enough.all():  # (too short to hold a header: copied as they are, never well formed)
        short = np.flatnonzero(~long_enough).tolist()
        copy_buffers([dsts[i] for i in short], [srcs[i] for i in short])
    chosen = np.flatnonzero(long_enough).tolist()
    picked_dsts = [dsts[i] for i in chosen]
    digests = library.copy_hash_many(
        STREAM_HASH_TABLE,
        buffer_addresses(picked_dsts),
        buffer_addresses([srcs[i] for i in chosen]),
        lengths[long_enough],
        HEADER_SIZE,
    ).tolist()
    ok = [False] * len(srcs)
    for i, copy, digest in zip(chosen, picked_dsts, digests):
        ok[i] = _stated_checksum(copy) == digest  # the header read from the copy, as the payload was hashed
    return ok


def matches(value: Buffer | None, expected: ExpectedValues, i: int) -> bool:
    """Whether `value` is present and exactly value i of `expected` (header fields, length and checksum)."""
    return valid_prefix([value], expected.range(i, i + 1)) == 1


def valid_flags(values: Sequence[Buffer | None], expected: ExpectedValues) -> list[bool]:
    """`matches` of every value (not only a leading run): the headers one by one, then the payloads of the values
    whose headers are right in one batch (`payload_checksums`: one GIL hand-over for a large batch)."""
    kind, signature = int(expected.kind), expected.layout_sig
    candidates: list[int] = []
    stated: list[int] = []
    for i, (value, digest, length) in enumerate(zip(values, expected.tokens_digest.tolist(), expected.payload_len.tolist())):
        found = _expected_checksum(value, kind, signature, digest, length)
        if found is not None:
            candidates.append(i)
            stated.append(found)
    flags = [False] * len(values)
    computed = payload_checksums([cast(Buffer, values[i]) for i in candidates])
    for i, computed_checksum, want in zip(candidates, computed, stated):
        flags[i] = computed_checksum == want
    return flags


def stated_checksums(values: Sequence[Buffer | None], expected: ExpectedValues) -> list[int]:
    """The checksums stated by the leading values whose headers and lengths are exactly what `expected` describes
    (stopping at the first that is not, or is absent); the payloads are not read. Headers are read with `struct` (a
    fraction of a microsecond each: this runs once per value of every load)."""
    kind, signature = int(expected.kind), expected.layout_sig
    stated: list[int] = []
    for value, digest, length in zip(values, expected.tokens_digest.tolist(), expected.payload_len.tolist()):
        found = _expected_checksum(value, kind, signature, digest, length)
        if found is None:
            break
        stated.append(found)
    return stated


def _expected_checksum(value: Buffer | None, kind: int, signature: int, digest: int, length: int) -> int | None:
    """The checksum `value`'s header states, when the value is present and its header and length are exactly these."""
    if value is None or len(value) != HEADER_SIZE + length:
        return None
    magic, version, value_kind, value_signature, value_digest, value_length, value_checksum = header_struct.unpack_from(value)
    if (
        magic != MAGIC
        or version != VERSION
        or value_kind != kind
        or value_signature != signature
        or value_digest != digest
        or value_length != length
    ):
        return None
    return int(value_checksum)


def valid_prefix(values: Sequence[Buffer | None], expected: ExpectedValues) -> int:
    """How many values, from the first, are present and exactly what `expected` describes (checksum included): the
    headers first (`stated_checksums`), then the payloads of the values whose headers are right, in one batch
    (`payload_checksums`)."""
    stated = stated_checksums(values, expected)
    candidates = cast(Sequence[Buffer], values[: len(stated)])
    for i, (computed, want) in enumerate(zip(payload_checksums(candidates), stated)):
        if computed != want:
            return i
    return len(stated)

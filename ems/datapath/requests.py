"""Binding and checking the arguments of save/load/exists, before anything moves.

`bind_request(op, args, kwargs, layout)` turns the three call forms of the SDK into one typed request:

* V0:                      `(option, key_list, value_list)`
* V1, slot_mapping form:   `(slot_mapping, hashes, offsets, option=None)`
* V1, chunk_descs form:    `(hashes=..., chunk_descs=..., option=None)`

This package's addition to both V1 hash forms (and `exists`): `chain_prefix=<the hashes of the blocks before
hashes[0], from the chain's first block>` (any length, empty: hashes[0] is the chain's first block) says where the
blocks sit in their prefix chain, so they are stored under their placement unit (`ems.datapath.keys.chain_keys`:
locality); without it a block is placed by its hash alone. V0 and the token form refuse it.

A CcKvOption first means the V0 form; when the rest looks like the V1 form (ints where V0 has its keys, more
arguments than V0 takes, a V1 keyword), the error gives the V1 form's order instead of the V0 form's arity.

(The SDK's fourth form, token semantics `(slot_mapping, option=None, token_ids=..., mask=...)`, is bound by
`ems.datapath.tokens`, with these checks.)

Every check happens here, vectorised where it concerns tokens: a bad argument raises
`EmsException(EMS_INVALID_ARGUMENT)` naming the argument and the offending index, and nothing has been written.
A slot outside the registered cache never reaches a kernel (that would be memory corruption).
"""

from __future__ import annotations

import array as pyarray
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ems.datapath.layout import RegisteredLayout
from ems.errors import invalid_argument
from ems.kernels.plan import runs_to_slots
from ems.kernels.raw_memory import host_array
from ems.transport.holds import Hold
from ems.types import (
    DEFAULT_OPTION,
    CcKvOption,
    KvBufferWrapper,
    PrimaryKey,
    V0Key,
    check_str_key,
)

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# A block hash is any int from -2**255 to 2**256 - 1: signed int64 (Python's hash() values), unsigned u64 (xxhash
# digests in numpy u64 arrays) and whole SHA-256 digests (vLLM's block hashes, wider keys that fold in a rank). Wider
# ints are refused: a key stays a few dozen bytes, far inside the wire protocol's key size.
MIN_HASH, MAX_HASH = -(1 << 255), (1 << 256) - 1


class Operation(str, enum.Enum):
    SAVE = "save"
    LOAD = "load"


@dataclass(frozen=True)
class RawRequest:
    """V0: value i is the concatenation of the device ranges `segments[seg_start[i]:seg_start[i+1]]`."""

    option: CcKvOption
    keys: list[V0Key]  # PrimaryKey or plain str keys
    ptrs: np.ndarray  # int64 [S] device addresses
    lengths: np.ndarray  # int64 [S] bytes
    seg_start: np.ndarray  # int64 [n+1]

    @property
    def total(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class SlotRequest:
    """V1 slot_mapping: block i is `hashes[i]`, the tokens `slots[tok_start[i]:tok_start[i+1]]`."""

    option: CcKvOption
    hashes: list[int]
    slots: np.ndarray  # int64 [T]
    offsets: np.ndarray  # int64 [n] tokens per block
    # (first slot, tokens) when the request is one block whose slots are consecutive (the engine's small call)
    one_run: tuple[int, int] | None = None
    # the hashes of the chain's blocks before hashes[0] (`chain_prefix`), None: the position is unknown
    chain_prefix: Sequence[int] | None = None

    @property
    def total(self) -> int:
        return len(self.hashes)


@dataclass(frozen=True)
class ChunkRequest:
    """V1 chunk_descs: block i of group g is the run `starts[g, i] .. starts[g, i] + lengths[g, i] - 1`."""

    option: CcKvOption
    hashes: list[int]
    starts: np.ndarray  # int64 [G, n]
    lengths: np.ndarray  # int64 [G, n]
    chain_prefix: Sequence[int] | None = None  # as SlotRequest's

    @property
    def total(self) -> int:
        return len(self.hashes)


Request = RawRequest | SlotRequest | ChunkRequest

_V0_NAMES = ("option", "key_list", "value_list")
_V1_NAMES = ("slot_mapping", "hashes", "offsets", "option")


def _bind_names(op: str, names: Sequence[str], args: tuple, kwargs: dict, extra: Sequence[str] = ()) -> dict:
    if len(args) > len(names):
        raise invalid_argument(f"{op}() takes at most {len(names)} positional arguments ({', '.join(names)})")
    bound = dict(zip(names, args))
    for name, value in kwargs.items():
        if name not in names and name not in extra:
            raise invalid_argument(f"{op}() got an unexpected argument {name!r}")
        if name in bound:
            raise invalid_argument(f"{op}() got argument {name!r} twice")
        bound[name] = value
    return bound


def _option(value: object, required: bool) -> CcKvOption:
    if value is None:
        if required:
            raise invalid_argument("option must be a CcKvOption, not None")
        return DEFAULT_OPTION
    if not isinstance(value, CcKvOption):
        raise invalid_argument(f"option must be a CcKvOption, got {type(value).__name__}")
    return value


_UNSIGNED_TENSOR = frozenset((torch.uint8, torch.uint16, torch.uint32, torch.uint64))
_HOST_VIEWABLE = frozenset((torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8))  # what host_array views
_SHORT_LIST = 64  # items: up to here a list or tensor is read item by item, without numpy's inference
_PLAIN_INT = {int}  # the item types of a list taken without numpy's type inference (bool is not int here)
_BOOLS = frozenset((bool, np.bool_))  # refused as ints (numpy would take them as 0 and 1)


def int_array(name: str, value: object) -> np.ndarray:
    """An int64 numpy copy of a list/tuple/ndarray/tensor of integers; floats, bools and strings are refused."""
    if isinstance(value, torch.Tensor):
        if value.dtype in _HOST_VIEWABLE and value.device.type == "cpu":
            # through a view of the caller's memory, copied: `.numpy()` costs several µs per small call and gives the
            # GIL away (perf/RESULTS.md, "Which ops give the GIL away"); these dtypes all fit int64
            if value.dim() == 1 and value.numel() <= _SHORT_LIST:  # a small call's: Python ints are cheaper still
                return np.array(value.tolist(), dtype=np.int64)
            array = host_array(value)
            if array.ndim != 1:
                raise invalid_argument(f"{name} must be a flat list of ints, got shape {array.shape}")
            return array.astype(np.int64)
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise invalid_argument(f"{name} must hold integers, got a {value.dtype} tensor")
        array = value.detach().to("cpu").numpy()
    elif isinstance(value, (list, tuple)) and len(value) <= _SHORT_LIST and set(map(type, value)) <= _PLAIN_INT:
        try:  # a short list of plain ints (the usual small call): no type inference, no bool scan
            return np.array(value, dtype=np.int64)
        except OverflowError:
            array = np.asarray(value, dtype=object)  # outside int64: reported below, item by item
    elif isinstance(value, (list, tuple)) and (packed := _packed_ints(value)) is not None:
        return packed
    elif isinstance(value, (list, tuple, np.ndarray)):
        try:
            array = np.asarray(value)
        except (ValueError, OverflowError):
            array = np.asarray(value, dtype=object)
    else:
        raise invalid_argument(f"{name} must be a list of ints, got {type(value).__name__}")
    if array.ndim != 1:
        raise invalid_argument(f"{name} must be a flat list of ints, got shape {array.shape}")
    # numpy turns [0, True] into ints and [0, 1.0] into floats: look at the caller's own items for the culprit
    items = value if isinstance(value, (list, tuple)) else None
    if items is not None and array.dtype.kind in "iu" and not _BOOLS.isdisjoint(map(type, items)):
        array = np.asarray(items, dtype=object)
    if array.size and array.dtype.kind not in "iu":
        # object arrays and lists numpy could not type: every item must be an int within int64 (rare path, per item)
        source = items if items is not None else array.tolist()
        for i, item in enumerate(source):
            if isinstance(item, (bool, np.bool_)) or not isinstance(item, (int, np.integer)):
                raise invalid_argument(f"{name}[{i}] must be an int, got {type(item).__name__} {item!r}")
            if not INT64_MIN <= int(item) <= INT64_MAX:
                raise invalid_argument(f"{name}[{i}] = {_describe_int(int(item))} is outside the int64 range")
        return np.fromiter((int(item) for item in source), dtype=np.int64, count=len(source))
    if array.dtype.kind == "u" and array.size and int(array.max()) > np.iinfo(np.int64).max:
        raise invalid_argument(f"{name} holds integers outside the int64 range")
    # a list's array is already the caller-independent copy; an array or tensor's is copied (the caller may reuse it)
    return array.astype(np.int64, copy=items is None)


def _packed_ints(items: list | tuple) -> np.ndarray | None:
    """A long list of ints as int64, about 3x cheaper than numpy's inference plus a scan of every item's type; None
    when an item is not an int (or is a bool, or outside int64): the general path then says which. `array("q")`
    takes ints (and integers with `__index__`) only, so floats and strings raise; a bool becomes 0 or 1, so only the
    items that came out 0 or 1 need their type looked at."""
    try:
        array = np.frombuffer(pyarray.array("q", items), dtype=np.int64)
    except (TypeError, OverflowError):
        return None
    for i in np.flatnonzero((array >> 1) == 0).tolist():
        if type(items[i]) in _BOOLS:
            return None
    return array


def _describe_int(value: int) -> str:
    """An int for a message: in full unless it is huge."""
    return str(value) if value.bit_length() <= 128 else f"a {value.bit_length()}-bit int"


def _hashes(value: object, name: str = "hashes", chain: bool = False) -> list[int]:
    """Block hashes, checked (`chain`: a `chain_prefix`, which may be empty and repeat a hash)."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "uO" and value.ndim == 1:
        value = value.tolist()  # u64 hashes are keys, not offsets: no int64 limit; object arrays are checked as lists
    elif isinstance(value, torch.Tensor) and value.dtype in _UNSIGNED_TENSOR and value.dim() == 1:
        value = value.tolist()  # the same for torch's unsigned dtypes (uint64 values up to 2**64 - 1)
    elif isinstance(value, (np.ndarray, torch.Tensor)):
        value = int_array(name, value).tolist()
    if not isinstance(value, (list, tuple)) or not (value or chain):
        raise invalid_argument(f"{name} must be a {'' if chain else 'non-empty '}list of ints")
    hashes = list(value)
    for i, h in enumerate(hashes):
        if type(h) is not int:
            if isinstance(h, np.integer):
                hashes[i] = int(h)
            else:
                raise invalid_argument(f"{name}[{i}] must be an int, got {type(h).__name__} {h!r}")
        if not MIN_HASH <= hashes[i] <= MAX_HASH:
            raise invalid_argument(
                f"{name}[{i}] = {_describe_int(hashes[i])} is outside the accepted range -2**255 .. 2**256 - 1"
            )
    if chain:
        return hashes
    if len(set(hashes)) != len(hashes):
        seen: dict[int, int] = {}
        for i, h in enumerate(hashes):
            if h in seen:
                raise invalid_argument(f"hashes[{i}] repeats hashes[{seen[h]}] ({h:#x}): keys must be unique in a call")
            seen[h] = i
    return hashes


def chain_prefix_of(b: dict, op: str) -> list[int] | None:
    """The call's `chain_prefix` (None when not given), checked as block hashes are."""
    value = b.get("chain_prefix")
    if value is None:
        return None
    return _hashes(value, "chain_prefix", chain=True)


def _min_max_sum(array: np.ndarray) -> tuple[int, int, int]:
    """min, max and sum of a non-empty int64 array; Python's builtins for a short one (where numpy's per-call
    overhead is the larger cost), exact either way for the sizes a request has."""
    if array.size <= 64:
        items = array.tolist()
        return min(items), max(items), sum(items)
    return int(array.min()), int(array.max()), int(array.sum())


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


_SET_CHECK_MAX = 8192  # tokens: up to here repeats are looked for with a Python set


def _check_no_repeats(name: str, slots: np.ndarray, first: int = 0) -> None:
    """A load must not write one slot twice (which copy would win is undefined). `slots` are the argument's entries
    from index `first` on (the indices a refusal names)."""
    if slots.size <= _SET_CHECK_MAX and len(set(slots.tolist())) == slots.size:
        # no repeats (the usual case). A Python set costs about what a sort does at these sizes, and keeps the GIL:
        # numpy's sort gives it away, which costs a switch interval (5 ms) beside a busy engine thread
        return
    order = np.argsort(slots, kind="stable")
    repeated = np.nonzero(slots[order][1:] == slots[order][:-1])[0]
    if repeated.size:
        i, j = sorted((int(order[repeated[0]]), int(order[repeated[0] + 1])))
        raise invalid_argument(
            f"{name}: slot {int(slots[j])} at index {first + j} repeats index {first + i}; a load writes each slot once"
        )


def _bind_slots(op: Operation, b: dict, layout: RegisteredLayout) -> SlotRequest:
    for name in ("slot_mapping", "hashes", "offsets"):
        if b.get(name) is None:
            raise invalid_argument(f"{op.value}(): {name} is required for the slot_mapping form")
    option = _option(b.get("option"), required=False)
    slots = int_array("slot_mapping", b["slot_mapping"])
    if slots.size == 0:
        raise invalid_argument("slot_mapping must not be empty")
    hashes = _hashes(b["hashes"])
    offsets = int_array("offsets", b["offsets"])
    if len(offsets) != len(hashes):
        raise invalid_argument(f"len(hashes) ({len(hashes)}) != len(offsets) ({len(offsets)})")
    # scalar bounds first; the index of a culprit is looked up only on the error path
    low, high, total = _min_max_sum(offsets)
    if low <= 0:
        i = _first(offsets <= 0)
        raise invalid_argument(f"offsets[{i}] = {int(offsets[i])}: each block holds at least one token")
    limit = layout.min_store_block_size
    if high > limit:
        i = _first(offsets > limit)
        raise invalid_argument(f"offsets[{i}] = {int(offsets[i])} exceeds the store block size {limit}")
    if total != len(slots):
        raise invalid_argument(f"sum(offsets) ({total}) != len(slot_mapping) ({len(slots)})")
    num_slots = layout.min_num_slots
    one_run = None
    if len(hashes) == 1:  # one block (at most a store block of tokens): are its slots one run?
        slot_list = slots.tolist()
        low = slot_list[0]
        one_run = (low, len(slot_list)) if slot_list == list(range(low, low + len(slot_list))) else None
    if one_run is not None:
        high = low + one_run[1] - 1
    else:
        low, high, _ = _min_max_sum(slots)
    if low < 0 or high >= num_slots:
        i = _first((slots < 0) | (slots >= num_slots))
        raise invalid_argument(f"slot_mapping[{i}] = {int(slots[i])} is outside the registered cache (slots 0..{num_slots - 1})")
    if op is Operation.LOAD and one_run is None:  # (a run repeats no slot)
        _check_no_repeats("slot_mapping", slots)
    return SlotRequest(option, hashes, slots, offsets, one_run, chain_prefix_of(b, op.value))


def _bind_chunks(op: Operation, b: dict, layout: RegisteredLayout) -> ChunkRequest:
    if b.get("hashes") is None:
        raise invalid_argument(f"{op.value}(): hashes is required with chunk_descs")
    option = _option(b.get("option"), required=False)
    hashes = _hashes(b["hashes"])
    descs = b["chunk_descs"]
    groups = len(layout.groups)
    if not isinstance(descs, (list, tuple)) or len(descs) != groups:
        got = len(descs) if isinstance(descs, (list, tuple)) else type(descs).__name__
        raise invalid_argument(f"chunk_descs must hold one list per layer group ({groups}), got {got}")
    n = len(hashes)
    starts = np.empty((groups, n), dtype=np.int64)
    lengths = np.empty((groups, n), dtype=np.int64)
    for g, (group, runs) in enumerate(zip(layout.groups, descs)):
        if not isinstance(runs, (list, tuple)) or len(runs) != n:
            got = len(runs) if isinstance(runs, (list, tuple)) else type(runs).__name__
            raise invalid_argument(f"len(chunk_descs[{g}]) must equal len(hashes) ({n}), got {got}")
        try:
            pairs = np.asarray(runs)
        except ValueError:
            pairs = np.asarray(runs, dtype=object)
        has_bool = any(isinstance(x, (bool, np.bool_)) for run in runs if isinstance(run, (list, tuple)) for x in run)
        if pairs.shape != (n, 2) or pairs.dtype.kind not in "iu" or has_bool:
            for i, run in enumerate(runs):
                if (
                    not isinstance(run, (list, tuple))
                    or len(run) != 2
                    or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in run)
                ):
                    raise invalid_argument(f"chunk_descs[{g}][{i}] must be a (start_slot, length) pair of ints, got {run!r}")
            raise invalid_argument(f"chunk_descs[{g}] holds integers outside the int64 range")
        starts[g], lengths[g] = pairs[:, 0], pairs[:, 1]
        num_slots = group.planes.num_slots
        # in this order, each check relying on the ones before it: once every length is 1..store_block_size,
        # `num_slots - length` cannot overflow, where `start + length` would wrap for a start near 2**63
        _refuse_run(g, starts[g], lengths[g], starts[g] < 0, "start_slot is negative")
        _refuse_run(g, starts[g], lengths[g], lengths[g] <= 0, "length must be >= 1")
        too_long = lengths[g] > group.store_block_size
        _refuse_run(g, starts[g], lengths[g], too_long, f"length exceeds the group's store block size {group.store_block_size}")
        leaves = starts[g] > num_slots - lengths[g]
        _refuse_run(g, starts[g], lengths[g], leaves, f"the run leaves the registered cache ({num_slots} slots)")
        if op is Operation.LOAD:
            slots = runs_to_slots(torch.from_numpy(starts[g]), torch.from_numpy(lengths[g])).numpy()
            _check_no_repeats(f"chunk_descs[{g}]", slots)
    return ChunkRequest(option, hashes, starts, lengths, chain_prefix_of(b, op.value))


def _refuse_run(g: int, starts: np.ndarray, lengths: np.ndarray, mask: np.ndarray, why: str) -> None:
    """EMS_INVALID_ARGUMENT naming the first run of layer group `g` that `mask` marks, if any."""
    if mask.any():
        i = _first(mask)
        raise invalid_argument(f"chunk_descs[{g}][{i}] = ({int(starts[i])}, {int(lengths[i])}): {why}")


def _bind_raw(op: Operation, b: dict) -> RawRequest:
    option = _option(b.get("option"), required=True)
    key_list, value_list = b.get("key_list"), b.get("value_list")
    if not isinstance(key_list, (list, tuple)) or not key_list:
        raise invalid_argument("key_list must be a non-empty list of PrimaryKey or str keys")
    if not isinstance(value_list, (list, tuple)):
        raise invalid_argument(f"value_list must be a list of lists of KvBufferWrapper, got {type(value_list).__name__}")
    if len(value_list) != len(key_list):
        raise invalid_argument(f"len(value_list) ({len(value_list)}) != len(key_list) ({len(key_list)})")
    _check_v0_keys("key_list", key_list)
    seen: dict[V0Key, int] = {}
    for i, key in enumerate(key_list):
        if key in seen:
            raise invalid_argument(f"key_list[{i}] repeats key_list[{seen[key]}] ({key}): keys must be unique")
        seen[key] = i
    ptrs: list[int] = []
    lengths: list[int] = []
    counts = np.zeros(len(key_list) + 1, dtype=np.int64)
    for i, buffers in enumerate(value_list):
        if not isinstance(buffers, (list, tuple)) or not buffers:
            raise invalid_argument(f"value_list[{i}] must be a non-empty list of KvBufferWrapper")
        for j, buffer in enumerate(buffers):
            if not isinstance(buffer, KvBufferWrapper):
                raise invalid_argument(f"value_list[{i}][{j}] must be a KvBufferWrapper, got {type(buffer).__name__}")
            # (Python ints: exact) a range ending past 2**63 - 1 would also wrap in the int64 plan arithmetic
            if buffer.data_ptr + buffer.length - 1 > INT64_MAX:
                raise invalid_argument(
                    f"value_list[{i}][{j}] = ({buffer.data_ptr:#x}, {buffer.length}) ends above 2**63, which no device maps"
                )
            ptrs.append(buffer.data_ptr)
            lengths.append(buffer.length)
        counts[i + 1] = len(buffers)
    if sum(lengths) > INT64_MAX:  # the plan's byte offsets are int64
        raise invalid_argument(f"value_list's ranges add up to {sum(lengths)} bytes, more than 2**63 - 1")
    return RawRequest(option, list(key_list), np.asarray(ptrs, np.int64), np.asarray(lengths, np.int64), np.cumsum(counts))


def _check_v0_keys(name: str, keys: Sequence[object]) -> None:
    """Every V0 key is a PrimaryKey or a plain str key (the SDK's older form) within the limits."""
    for i, key in enumerate(keys):
        if isinstance(key, str):
            check_str_key(f"{name}[{i}]", key)
        elif not isinstance(key, PrimaryKey):
            raise invalid_argument(f"{name}[{i}] must be a PrimaryKey or a str key, got {type(key).__name__}")


def bind_request(op: Operation, args: tuple, kwargs: dict, layout: RegisteredLayout | None) -> Request:
    """The request the arguments describe, fully checked against `layout` (None before registration)."""
    v0 = (args and isinstance(args[0], CcKvOption)) or "key_list" in kwargs or "value_list" in kwargs
    if v0:
        if args and isinstance(args[0], CcKvOption) and _v1_after_option(args, kwargs):
            raise invalid_argument(
                f"{op.value}(): option comes last in the V1 form, {op.value}(slot_mapping, hashes, offsets, option) "
                f"(or option=...); a CcKvOption first is the V0 form, {op.value}(option, key_list, value_list), whose "
                "key_list holds PrimaryKey or str keys"
            )
        if "chain_prefix" in kwargs:
            raise invalid_argument(f"{op.value}(): chain_prefix is for the V1 hash forms; V0 keys route by distribute_key")
        return _bind_raw(op, _bind_names(op.value, _V0_NAMES, args, kwargs))
    b = _bind_names(op.value, _V1_NAMES, args, kwargs, extra=("chunk_descs", "chain_prefix"))
    if layout is None:
        raise invalid_argument(f"{op.value}(): V1 calls need register_kvcache() first")
    if b.get("chunk_descs") is not None:
        if b.get("slot_mapping") is not None or b.get("offsets") is not None:
            raise invalid_argument(f"{op.value}(): give either slot_mapping + offsets or chunk_descs, not both semantics at once")
        return _bind_chunks(op, b, layout)
    if b.get("slot_mapping") is None and b.get("offsets") is None and b.get("hashes") is not None:
        raise invalid_argument(f"{op.value}(): give slot_mapping + offsets, or chunk_descs, with hashes")
    return _bind_slots(op, b, layout)


_V1_ONLY_NAMES = frozenset(("slot_mapping", "hashes", "offsets", "chunk_descs"))


def _v1_after_option(args: tuple, kwargs: dict) -> bool:
    """Whether a call that starts with a CcKvOption goes on like the V1 form (a V1 call given its option first):
    more arguments than the V0 form takes, a V1 keyword, or ints where V0 has its keys (PrimaryKey or str)."""
    if "key_list" in kwargs or "value_list" in kwargs:
        return False
    if len(args) > len(_V0_NAMES) or not _V1_ONLY_NAMES.isdisjoint(kwargs):
        return True
    second = args[1] if len(args) > 1 else None
    if isinstance(second, (torch.Tensor, np.ndarray)):
        return True
    if isinstance(second, (list, tuple)) and second:
        first = second[0]
        return isinstance(first, (int, np.integer)) and not isinstance(first, (bool, np.bool_))
    return False


@dataclass(frozen=True)
class ExistsRequest:
    """An exists call's arguments, checked: its keys (V1 hashes or V0 keys), option, hold and chain prefix."""

    items: list[int] | list[V0Key]
    option: CcKvOption
    hold: Hold | None
    chain_prefix: list[int] | None  # V1 hashes only


def bind_exists(hashes: object, option: object, kwargs: dict[str, Any]) -> ExistsRequest:
    """exists(hashes, option=None, lease_ms=..., pin=..., chain_prefix=...): V1 block hashes, or V0 keys (PrimaryKey
    or str), and what the pool is to keep of the keys it finds (this package's addition, `ems.transport.holds`):
    `lease_ms` (an int in 1..MAX_LEASE_MS) leases them until they are read or that time has passed, `pin=True` pins
    them; `chain_prefix` as for save and load (V1 hashes only)."""
    unknown = sorted(set(kwargs) - {"lease_ms", "pin", "chain_prefix"})
    if unknown:
        raise invalid_argument(f"exists() got unexpected arguments {unknown}")
    hold: Hold | None = None
    lease_ms, pin = kwargs.get("lease_ms"), kwargs.get("pin", False)
    if not isinstance(pin, bool):
        raise invalid_argument(f"exists(): pin must be a bool, got {type(pin).__name__}")
    if lease_ms is not None:
        if pin:
            raise invalid_argument("exists(): give lease_ms or pin=True, not both")
        try:
            hold = Hold.lease(lease_ms)
        except ValueError as error:
            raise invalid_argument(f"exists(): {error}") from None
    elif pin:
        hold = Hold.pin()
    checked_option = _option(option, required=False)
    prefix = chain_prefix_of(kwargs, "exists")
    if isinstance(hashes, (list, tuple)) and hashes and isinstance(hashes[0], (PrimaryKey, str)):
        if prefix is not None:
            raise invalid_argument("exists(): chain_prefix is for V1 hashes; V0 keys route by distribute_key")
        _check_v0_keys("hashes", hashes)
        return ExistsRequest(list(hashes), checked_option, hold, None)
    return ExistsRequest(_hashes(hashes), checked_option, hold, prefix)

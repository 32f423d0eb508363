"""The checked forms of a call (`RawCall`, `SlotCall`, `ChunkCall`; the token form's `TokenCall` is in
`ems.datapath.tokens`) and the checks every call's arguments go through (`ems.datapath.calls` binds the forms with
them).

Contract: each function takes a caller's value and returns it checked and typed (`int_array`: int64 numpy;
`hash_list`: unique block hashes as Python ints in -2**255 .. 2**256 - 1; `checked_option`: a CcKvOption;
`bind_names`: the call's arguments by name), or raises `EmsException(EMS_INVALID_ARGUMENT)` naming the argument and
the offending index. Vectorised where it concerns tokens; a short call's values stay Python ints (numpy's per-call
cost is the larger one there). Nothing here moves data.
"""

from __future__ import annotations

import array as pyarray
import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ems.errors import invalid_argument
from ems.kernels.host_copy import host_array
from ems.types import DEFAULT_OPTION, CcKvOption, PrimaryKey, V0Key, check_str_key

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# A block hash is any int from -2**255 to 2**256 - 1: signed int64 (Python's hash() values), unsigned u64 (xxhash
# digests in numpy u64 arrays) and whole SHA-256 digests (vLLM's block hashes, wider keys that fold in a rank). Wider
# ints are refused: a key stays a few dozen bytes, far inside the wire protocol's key size.
MIN_HASH, MAX_HASH = -(1 << 255), (1 << 256) - 1

V0_NAMES = ("option", "key_list", "value_list")  # the V0 form's arguments, in order
V1_NAMES = ("slot_mapping", "hashes", "offsets", "option")  # the V1 forms', in order


class Operation(str, enum.Enum):
    SAVE = "save"
    LOAD = "load"


@dataclass(frozen=True)
class RawCall:
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
class SlotCall:
    """V1 slot_mapping: block i is `hashes[i]`, the tokens `slots[tok_start[i]:tok_start[i+1]]`."""

    option: CcKvOption
    hashes: list[int]
    slots: np.ndarray  # int64 [T]
    offsets: np.ndarray  # int64 [n] tokens per block
    # (first slot, tokens) when the call is one block whose slots are consecutive (the engine's small call)
    one_run: tuple[int, int] | None = None
    # the hashes of the chain's blocks before hashes[0] (`chain_prefix`), None: the position is unknown
    chain_prefix: Sequence[int] | None = None

    @property
    def total(self) -> int:
        return len(self.hashes)


@dataclass(frozen=True)
class ChunkCall:
    """V1 chunk_descs: block i of group g is the run `starts[g, i] .. starts[g, i] + lengths[g, i] - 1`."""

    option: CcKvOption
    hashes: list[int]
    starts: np.ndarray  # int64 [G, n]
    lengths: np.ndarray  # int64 [G, n]
    chain_prefix: Sequence[int] | None = None  # as SlotCall's

    @property
    def total(self) -> int:
        return len(self.hashes)


def bind_names(op: str, names: Sequence[str], args: tuple, kwargs: dict, extra: Sequence[str] = ()) -> dict:
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


def checked_option(value: object, required: bool) -> CcKvOption:
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
BOOLS = frozenset((bool, np.bool_))  # refused as ints (numpy would take them as 0 and 1)


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
    if items is not None and array.dtype.kind in "iu" and not BOOLS.isdisjoint(map(type, items)):
        array = np.asarray(items, dtype=object)
    if array.size and array.dtype.kind not in "iu":
        # object arrays and lists numpy could not type: every item must be an int within int64 (rare path, per item)
        source = items if items is not None else array.tolist()
        for i, item in enumerate(source):
            if isinstance(item, (bool, np.bool_)) or not isinstance(item, (int, np.integer)):
                raise invalid_argument(f"{name}[{i}] must be an int, got {type(item).__name__} {item!r}")
            if not INT64_MIN <= int(item) <= INT64_MAX:
                raise invalid_argument(f"{name}[{i}] = {describe_int(int(item))} is outside the int64 range")
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
        if type(items[i]) in BOOLS:
            return None
    return array


def describe_int(value: int) -> str:
    """An int for a message: in full unless it is huge."""
    return str(value) if value.bit_length() <= 128 else f"a {value.bit_length()}-bit int"


def hash_list(value: object, name: str = "hashes", chain: bool = False) -> list[int]:
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
            raise invalid_argument(f"{name}[{i}] = {describe_int(hashes[i])} is outside the accepted range -2**255 .. 2**256 - 1")
    if chain:
        return hashes
    if len(set(hashes)) != len(hashes):
        seen: dict[int, int] = {}
        for i, h in enumerate(hashes):
            if h in seen:
                raise invalid_argument(f"hashes[{i}] repeats hashes[{seen[h]}] ({h:#x}): keys must be unique in a call")
            seen[h] = i
    return hashes


def chain_prefix_of(b: dict) -> list[int] | None:
    """A call's `chain_prefix` (None when not given), checked as block hashes are (`hash_list`)."""
    value = b.get("chain_prefix")
    if value is None:
        return None
    return hash_list(value, "chain_prefix", chain=True)


def min_max_sum(array: np.ndarray) -> tuple[int, int, int]:
    """min, max and sum of a non-empty int64 array; Python's builtins for a short one (where numpy's per-call
    overhead is the larger cost), exact either way for the sizes a call has."""
    if array.size <= 64:
        items = array.tolist()
        return min(items), max(items), sum(items)
    return int(array.min()), int(array.max()), int(array.sum())


def first_index(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


_SET_CHECK_MAX = 8192  # tokens: up to here repeats are looked for with a Python set


def check_no_repeats(name: str, slots: np.ndarray, first: int = 0) -> None:
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


def check_v0_keys(name: str, keys: Sequence[object]) -> None:
    """Every V0 key is a PrimaryKey or a plain str key (the SDK's older form) within the limits."""
    for i, key in enumerate(keys):
        if isinstance(key, str):
            check_str_key(f"{name}[{i}]", key)
        elif not isinstance(key, PrimaryKey):
            raise invalid_argument(f"{name}[{i}] must be a PrimaryKey or a str key, got {type(key).__name__}")

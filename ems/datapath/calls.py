"""A public call's arguments, bound and checked, then planned: the one home of what `save`, `load`, their async forms
and `exists` were given (`ContextCaching` is a facade over it).

The forms (a call's form is decided by its arguments):

* V0:                      `(option, key_list, value_list)` -> `RawCall`
* V1, slot_mapping form:   `(slot_mapping, hashes, offsets, option=None)` -> `SlotCall`
* V1, chunk_descs form:    `(hashes=..., chunk_descs=..., option=None)` -> `ChunkCall`
* V1, token form:          `(slot_mapping, option=None, token_ids=..., mask=...)` -> `TokenCall` (`ems.datapath.tokens`)
* exists:                  `(hashes, option=None, lease_ms=..., pin=...)` -> `ExistsCall`

This package's addition to both V1 hash forms (and `exists`): `chain_prefix=<the hashes of the blocks before
hashes[0], from the chain's first block>` (any length, empty: hashes[0] is the chain's first block) says where the
blocks sit in their prefix chain, so they are stored under their placement unit (`ems.datapath.keys.chain_keys`:
locality); without it a block is placed by its hash alone. V0 and the token form refuse it.

A CcKvOption first means the V0 form; when the rest looks like the V1 form (ints where V0 has its keys, more
arguments than V0 takes, a V1 keyword), the error gives the V1 form's order instead of the V0 form's arity.

Contract: `bind_call` checks every argument (`ems.datapath.arguments`; a bad one raises
`EmsException(EMS_INVALID_ARGUMENT)` naming the argument and the offending index, and nothing has been written; a slot
outside the registered cache never reaches a kernel); `bind_and_plan` adds the call's plan as data
(`ems.datapath.planning`: V0 keys in the V0 namespace on the raw device, V1 blocks in the registered layout's
namespace on the layout's device). `call_result` is a call's `CcResult` from the values that succeeded. Pure: nothing
here reads client state but what it is given.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ems.datapath.arguments import (
    BOOLS,
    INT64_MAX,
    V0_NAMES,
    V1_NAMES,
    ChunkCall,
    Operation,
    RawCall,
    SlotCall,
    bind_names,
    chain_prefix_of,
    check_no_repeats,
    check_v0_keys,
    checked_option,
    first_index,
    hash_list,
    int_array,
    min_max_sum,
)
from ems.datapath.layout import RegisteredLayout
from ems.datapath.planning import Plan, plan_blocks, plan_raw
from ems.datapath.tokens import TokenCall, bind_tokens, plan_tokens
from ems.errors import invalid_argument
from ems.kernels.plan import runs_to_slots
from ems.transport.exists_holds import Hold
from ems.types import CcKvOption, CcResult, KvBufferWrapper, PrimaryKey, V0Key


def _bind_slots(op: Operation, b: dict, layout: RegisteredLayout) -> SlotCall:
    for name in ("slot_mapping", "hashes", "offsets"):
        if b.get(name) is None:
            raise invalid_argument(f"{op.value}(): {name} is required for the slot_mapping form")
    option = checked_option(b.get("option"), required=False)
    slots = int_array("slot_mapping", b["slot_mapping"])
    if slots.size == 0:
        raise invalid_argument("slot_mapping must not be empty")
    hashes = hash_list(b["hashes"])
    offsets = int_array("offsets", b["offsets"])
    if len(offsets) != len(hashes):
        raise invalid_argument(f"len(hashes) ({len(hashes)}) != len(offsets) ({len(offsets)})")
    # scalar bounds first; the index of a culprit is looked up only on the error path
    low, high, total = min_max_sum(offsets)
    if low <= 0:
        i = first_index(offsets <= 0)
        raise invalid_argument(f"offsets[{i}] = {int(offsets[i])}: each block holds at least one token")
    limit = layout.min_store_block_size
    if high > limit:
        i = first_index(offsets > limit)
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
        low, high, _ = min_max_sum(slots)
    if low < 0 or high >= num_slots:
        i = first_index((slots < 0) | (slots >= num_slots))
        raise invalid_argument(f"slot_mapping[{i}] = {int(slots[i])} is outside the registered cache (slots 0..{num_slots - 1})")
    if op is Operation.LOAD and one_run is None:  # (a run repeats no slot)
        check_no_repeats("slot_mapping", slots)
    return SlotCall(option, hashes, slots, offsets, one_run, chain_prefix_of(b))


def _bind_chunks(op: Operation, b: dict, layout: RegisteredLayout) -> ChunkCall:
    if b.get("hashes") is None:
        raise invalid_argument(f"{op.value}(): hashes is required with chunk_descs")
    option = checked_option(b.get("option"), required=False)
    hashes = hash_list(b["hashes"])
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
        well_formed = pairs.shape == (n, 2) and pairs.dtype.kind in "iu"
        # (numpy takes bools as 0 and 1: the runs' own items are looked at, at C speed, once the shape is right)
        if not well_formed or not BOOLS.isdisjoint(map(type, itertools.chain.from_iterable(runs))):
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
            check_no_repeats(f"chunk_descs[{g}]", slots)
    return ChunkCall(option, hashes, starts, lengths, chain_prefix_of(b))


def _refuse_run(g: int, starts: np.ndarray, lengths: np.ndarray, mask: np.ndarray, why: str) -> None:
    """EMS_INVALID_ARGUMENT naming the first run of layer group `g` that `mask` marks, if any."""
    if mask.any():
        i = first_index(mask)
        raise invalid_argument(f"chunk_descs[{g}][{i}] = ({int(starts[i])}, {int(lengths[i])}): {why}")


def _bind_raw(op: Operation, b: dict) -> RawCall:
    option = checked_option(b.get("option"), required=True)
    key_list, value_list = b.get("key_list"), b.get("value_list")
    if not isinstance(key_list, (list, tuple)) or not key_list:
        raise invalid_argument("key_list must be a non-empty list of PrimaryKey or str keys")
    if not isinstance(value_list, (list, tuple)):
        raise invalid_argument(f"value_list must be a list of lists of KvBufferWrapper, got {type(value_list).__name__}")
    if len(value_list) != len(key_list):
        raise invalid_argument(f"len(value_list) ({len(value_list)}) != len(key_list) ({len(key_list)})")
    check_v0_keys("key_list", key_list)
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
    return RawCall(option, list(key_list), np.asarray(ptrs, np.int64), np.asarray(lengths, np.int64), np.cumsum(counts))


def _bind_hash_or_v0(op: Operation, args: tuple, kwargs: dict, layout: RegisteredLayout | None) -> RawCall | SlotCall | ChunkCall:
    """The V0, slot_mapping or chunk_descs call the arguments describe, fully checked against `layout`."""
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
        return _bind_raw(op, bind_names(op.value, V0_NAMES, args, kwargs))
    b = bind_names(op.value, V1_NAMES, args, kwargs, extra=("chunk_descs", "chain_prefix"))
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
    if len(args) > len(V0_NAMES) or not _V1_ONLY_NAMES.isdisjoint(kwargs):
        return True
    second = args[1] if len(args) > 1 else None
    if isinstance(second, (torch.Tensor, np.ndarray)):
        return True
    if isinstance(second, (list, tuple)) and second:
        first = second[0]
        return isinstance(first, (int, np.integer)) and not isinstance(first, (bool, np.bool_))
    return False


Call = RawCall | SlotCall | ChunkCall | TokenCall


def bind_call(op: Operation, args: tuple, kwargs: dict, layout: RegisteredLayout | None) -> Call:
    """The call the arguments describe, of whichever form they name, fully checked against `layout` (None before
    registration)."""
    if "token_ids" in kwargs or "mask" in kwargs:  # the token form (tokens.TOKEN_ARGUMENTS), whatever else it gives
        return bind_tokens(op, args, kwargs, layout)
    return _bind_hash_or_v0(op, args, kwargs, layout)


def bind_and_plan(
    op: Operation,
    args: tuple,
    kwargs: dict,
    layout: RegisteredLayout | None,
    v0_namespace: bytes,
    v1_namespace: bytes,
    raw_device: Callable[[], torch.device],
) -> tuple[Call, Plan, torch.device]:
    """The call, its plan and the device it moves on (`raw_device()`: the V0 device, asked only for V0)."""
    call = bind_call(op, args, kwargs, layout)
    if isinstance(call, RawCall):
        return call, plan_raw(call, v0_namespace), raw_device()
    if layout is None:  # bind_call already refuses this; kept for type narrowing
        raise invalid_argument("V1 calls need register_kvcache() first")
    if isinstance(call, TokenCall):
        return call, plan_tokens(call, layout, v1_namespace), layout.device
    return call, plan_blocks(call, layout, v1_namespace), layout.device


@dataclass(frozen=True)
class ExistsCall:
    """A checked `exists`: V1 block hashes or V0 keys, its option, and what the pool is to keep of what it finds."""

    items: list[int] | list[V0Key]
    option: CcKvOption
    hold: Hold | None
    chain_prefix: list[int] | None = None  # V1 hashes only: where they sit in their prefix chain

    @property
    def is_v0(self) -> bool:
        return isinstance(self.items[0], (PrimaryKey, str))


def bind_exists(hashes: object, option: object, kwargs: dict[str, Any]) -> ExistsCall:
    """exists(hashes, option=None, lease_ms=..., pin=..., chain_prefix=...): V1 block hashes, or V0 keys (PrimaryKey
    or str), and what the pool is to keep of the keys it finds (this package's addition, `ems.transport.exists_holds`):
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
    checked = checked_option(option, required=False)
    prefix = chain_prefix_of(kwargs)
    if isinstance(hashes, (list, tuple)) and hashes and isinstance(hashes[0], (PrimaryKey, str)):
        if prefix is not None:
            raise invalid_argument("exists(): chain_prefix is for V1 hashes; V0 keys route by distribute_key")
        check_v0_keys("hashes", hashes)
        return ExistsCall(list(hashes), checked, hold)
    return ExistsCall(hash_list(hashes), checked, hold, prefix)


def consecutive_prefix(flags: Sequence[bool]) -> int:
    """How many leading entries are true."""
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)


def call_result(call: Call, values_done: int, values: int) -> CcResult:
    """A call's `CcResult` when `values_done` of its `values` succeeded consecutively from the first: blocks (keys)
    for the hash forms and V0, tokens for the token form."""
    if isinstance(call, TokenCall):
        return call.result(values_done)
    return CcResult(values_done, values)

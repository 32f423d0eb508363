"""The SDK's token semantics (its 2025-09 edition): save and load by `slot_mapping` + `token_ids` + `mask`.

The call: `save(slot_mapping, option=None, token_ids=..., mask=...)`, the same for `async_save`, `load` and
`async_load` (`hashes` and `offsets`, positional or by keyword, stay None; no `chunk_descs`). `slot_mapping`,
`token_ids` and `mask` have one length n >= 1: token t is `token_ids[t]`, lives at slot `slot_mapping[t]`, and
`mask[t]` is 0 for the prefix the engine already holds and 1 for the suffix to copy (0…0 1…1: ints 0 and 1, or
bools). `token_ids` is a list of ints or an integer tensor on any device. `bind_tokens` checks all of it with the
checks of `ems.datapath.arguments` (every slot inside the registered cache; a load writes no slot twice) before
anything moves; a refusal is `EMS_INVALID_ARGUMENT` naming the argument and the index.

Blocks and keys. Token t belongs to block t // B, B = the registered store block size (the smallest over layer
groups: the most tokens the hash form's `offsets` allow); when B does not divide n, the last block holds the n % B
tokens left and is stored as a value of that many tokens, as the hash form stores a block of `offsets[i] < B`
tokens. Block j's digest chains over every token before it: d_j = XXH3-128(d_{j-1} || block j's tokens as int64
little-endian bytes), d_{-1} = `CHAIN_SEED` (`chain_digests`: one C loop over the blocks where the compiled host
copy builds, else one xxhash call per block). It depends on the token values alone (a list and a tensor of any
integer dtype give the same digests), never on Python's `hash()`, so the same tokens meet again in any process on
any machine. The digest is the block's hash in the caller's namespace (tenant, model, ranks, layout:
`keys.namespace`) under its own key form (`keys.FORM_TOKENS_CHAIN`): a hash-form call never reads a block the token
form wrote, nor the reverse, whatever hashes the engine gives (the two forms do not meet even for the same tokens).
Block j is at chain position j (the mask covers the whole sequence), so the token form always stores its blocks under
their placement unit (`keys.chain_keys`: the digests of blocks 0..j-1 are its chain prefix).

What moves. The blocks that hold at least one mask-1 token, from block P // B on (P = the mask's zeros). A save
stores each of them whole: the first one's masked tokens are read from their slots too, since its key and value
cover the whole block. A load writes only the mask-1 tokens of the blocks it finds (the engine's prefix rows are
never touched), from the first of those blocks to the first miss.

What a result counts (`call_result`): tokens (the SDK's `get_result` page: results "in units of tokens").
`total` = n - P, the tokens asked for; `success` = how many of them, consecutively from the first, were saved or
loaded: the mask-1 tokens of the blocks that succeeded consecutively from the first. The engine takes P + success
tokens as computed. A mask of zeros asks for nothing: `CcResult(0, 0)`, and no pool is contacted.
"""

from __future__ import annotations

import array as pyarray
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict, overload

import numpy as np
import torch
import xxhash

from ems.datapath.arguments import (
    V1_NAMES,
    Operation,
    SlotCall,
    bind_names,
    check_no_repeats,
    checked_option,
    first_index,
    int_array,
    min_max_sum,
)
from ems.datapath.keys import FORM_TOKENS_CHAIN
from ems.datapath.layout import RegisteredLayout
from ems.datapath.planning import BlockPlan, GroupRegion, plan_blocks, plane_pieces_of_runs
from ems.errors import invalid_argument
from ems.kernels.host_copy import host_copy
from ems.store.value_format import _xxh3_addresses
from ems.types import CcKvOption, CcResult

TOKEN_ARGUMENTS = ("token_ids", "mask")  # the token form's own arguments (naming either makes a call of it)
CHAIN_SEED = b"ems/token-chain1"  # d_{-1}: 16 bytes; changing it changes every token-form key
_XXH3_128 = _xxh3_addresses(["XXH3_128bits"])
_HASH_FORM_ARGUMENTS = ("hashes", "offsets", "chunk_descs")


class TokenForm(TypedDict):
    """The token form's arguments, which the SDK's calls take through `**kwargs` (`ContextCaching`'s overloads)."""

    token_ids: Sequence[int] | np.ndarray | torch.Tensor
    mask: Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor  # 0…0 1…1: the prefix held, then the suffix to copy


@dataclass(frozen=True)
class TokenCall:
    """A checked token-form call: n tokens, the first `masked` of them held by the engine already."""

    option: CcKvOption
    slots: np.ndarray  # int64 [n]
    tokens: np.ndarray  # int64 [n], contiguous
    masked: int  # P: the mask's zeros
    block_size: int  # B
    op: Operation

    @property
    def first_block(self) -> int:
        """The first block holding a mask-1 token (the first block a call moves)."""
        return self.masked // self.block_size

    def result(self, blocks_done: int) -> CcResult:
        """The call's result when its first `blocks_done` blocks succeeded (see the module docstring)."""
        n = self.slots.size
        end = min(n, (self.first_block + blocks_done) * self.block_size)
        return CcResult(end - self.masked if blocks_done else 0, n - self.masked)


def bind_tokens(op: Operation, args: tuple, kwargs: dict, layout: RegisteredLayout | None) -> TokenCall:
    """The token-form call the arguments describe, fully checked against `layout` (None before registration)."""
    if (args and isinstance(args[0], CcKvOption)) or "key_list" in kwargs or "value_list" in kwargs:
        raise invalid_argument(f"{op.value}(): token_ids and mask are the V1 token form; not with V0 arguments")
    if "chain_prefix" in kwargs:
        raise invalid_argument(
            f"{op.value}(): chain_prefix is for the hash forms; the token form knows its blocks' chain positions"
        )
    b = bind_names(op.value, V1_NAMES, args, kwargs, extra=("chunk_descs", *TOKEN_ARGUMENTS))
    if layout is None:
        raise invalid_argument(f"{op.value}(): V1 calls need register_kvcache() first")
    for name in _HASH_FORM_ARGUMENTS:
        if b.get(name) is not None:
            raise invalid_argument(
                f"{op.value}(): {name} belongs to the hash forms; give either slot_mapping + token_ids + mask or "
                "hashes with offsets or chunk_descs, not both semantics at once"
            )
    for name in ("slot_mapping", *TOKEN_ARGUMENTS):
        if b.get(name) is None:
            raise invalid_argument(f"{op.value}(): {name} is required for the token form (slot_mapping + token_ids + mask)")
    option = checked_option(b.get("option"), required=False)
    slots = int_array("slot_mapping", b["slot_mapping"])
    n = slots.size
    if n == 0:
        raise invalid_argument("slot_mapping must not be empty")
    tokens = int_array("token_ids", b["token_ids"])
    if tokens.size != n:
        raise invalid_argument(f"len(token_ids) ({tokens.size}) != len(slot_mapping) ({n})")
    masked = mask_prefix(b["mask"], n)
    num_slots = layout.min_num_slots
    low, high, _ = min_max_sum(slots)
    if low < 0 or high >= num_slots:
        i = first_index((slots < 0) | (slots >= num_slots))
        raise invalid_argument(f"slot_mapping[{i}] = {int(slots[i])} is outside the registered cache (slots 0..{num_slots - 1})")
    if op is Operation.LOAD:  # the slots a load writes: the mask-1 tokens'
        check_no_repeats("slot_mapping", slots[masked:], masked)
    return TokenCall(option, slots, np.ascontiguousarray(tokens), masked, layout.min_store_block_size, op)


def mask_prefix(value: object, n: int) -> int:
    """How many leading zeros `mask` has, once it is checked to be n entries 0…0 1…1 (ints 0 and 1, or bools; a
    list, tuple, numpy array or tensor on any device). Vectorised: no per-token Python."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex:
            raise invalid_argument(f"mask must hold 0 and 1, got a {value.dtype} tensor")
        array = value.detach().to("cpu").numpy()
    elif isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, (list, tuple)):
        try:  # ints and bools in a byte each (array("b") takes nothing else): the usual list, ~8x less to scan
            array = np.frombuffer(pyarray.array("b", value), dtype=np.int8)
        except (TypeError, OverflowError):  # nested, floats, strings, large ints: the checks below name the item
            try:
                array = np.asarray(value)
            except (ValueError, OverflowError):
                array = np.asarray(value, dtype=object)
    else:
        raise invalid_argument(f"mask must be a list of 0 and 1, got {type(value).__name__}")
    if array.ndim != 1:
        raise invalid_argument(f"mask must be a flat list of 0 and 1, got shape {array.shape}")
    if array.size != n:
        raise invalid_argument(f"len(mask) ({array.size}) != len(slot_mapping) ({n})")
    if array.dtype.kind not in "biu":  # floats, strings, None, ints beyond 64 bits: name the first such item
        source = value if isinstance(value, (list, tuple)) else array.tolist()
        for i, item in enumerate(source):
            if not isinstance(item, (int, np.integer, np.bool_)) or int(item) not in (0, 1):
                raise invalid_argument(f"mask[{i}] must be 0 or 1, got {type(item).__name__} {item!r}")
        raise invalid_argument(f"mask must hold 0 and 1, got {array.dtype} values")
    if array.dtype.kind != "b" and (int(array.min()) < 0 or int(array.max()) > 1):
        i = first_index((array < 0) | (array > 1))
        raise invalid_argument(f"mask[{i}] = {array[i].item()!r} must be 0 or 1")
    masked = n - int(np.count_nonzero(array))
    if array[:masked].any():
        ones = array.astype(bool)
        i = first_index(ones[:-1] & ~ones[1:]) + 1
        raise invalid_argument(
            f"mask[{i}] = 0 follows a 1: the mask is 0 for the prefix the engine holds, then 1 to the end (0…0 1…1)"
        )
    return masked


def chain_digests(tokens: np.ndarray, block_size: int) -> np.ndarray:
    """uint8 `[ceil(n / block_size), 16]`: the chained digest of each block of `tokens` (ints, `[n]`; see the module
    docstring), in one C loop where the compiled host copy builds, else one xxhash call per block (the same bytes)."""
    data = np.ascontiguousarray(tokens, dtype="<i8")
    library = host_copy()
    if library is not None and _XXH3_128 is not None:
        return library.chain_digests(_XXH3_128[0], CHAIN_SEED, data, block_size)
    return chain_digests_in_python(data, block_size)


def chain_digests_in_python(tokens: np.ndarray, block_size: int) -> np.ndarray:
    """`chain_digests` through xxhash's Python call, block by block (where the host copy cannot be built)."""
    data = np.ascontiguousarray(tokens, dtype="<i8")
    out = bytearray()
    previous = CHAIN_SEED
    for first in range(0, data.size, block_size):
        previous = xxhash.xxh3_128_digest(previous + data[first : first + block_size].tobytes())
        out += previous
    return np.frombuffer(bytes(out), dtype=np.uint8).reshape(-1, 16)


def plan_tokens(call: TokenCall, layout: RegisteredLayout, namespace: bytes) -> BlockPlan:
    """The plan of a token-form call: a V1 plan of the blocks it moves, keyed by their digests (`FORM_TOKENS`);
    a load's first block writes only its mask-1 tokens."""
    n, size, first = call.slots.size, call.block_size, call.first_block
    if call.masked == n:  # nothing asked for: a plan of no values
        slots = np.zeros(0, dtype=np.int64)
        return plan_blocks(SlotCall(call.option, [], slots, slots), layout, namespace, FORM_TOKENS_CHAIN)
    all_digests = chain_digests(call.tokens, size)
    digests = all_digests[first:]
    blob = digests.tobytes()
    hashes = [int.from_bytes(blob[i : i + 16], "big") for i in range(0, len(blob), 16)]
    offsets = np.full(len(hashes), size, dtype=np.int64)
    offsets[-1] = n - (first + len(hashes) - 1) * size
    slots = call.slots[first * size :]
    one_run = None
    if len(hashes) == 1 and slots.tolist() == list(range(int(slots[0]), int(slots[0]) + slots.size)):
        one_run = (int(slots[0]), slots.size)
    chain = _Digests(all_digests[:first])
    plan = plan_blocks(SlotCall(call.option, hashes, slots, offsets, one_run, chain), layout, namespace, FORM_TOKENS_CHAIN)
    skip = call.masked - first * size
    if call.op is Operation.LOAD and skip:
        plan = dataclasses.replace(plan, regions=[_without_leading_tokens(region, skip) for region in plan.regions])
    return plan


class _Digests(Sequence[int]):
    """Block digests (uint8 `[n, 16]`) as the ints they are hashes as, each converted when asked (a chain prefix's
    few anchors, not every block)."""

    def __init__(self, digests: np.ndarray) -> None:
        self._digests = digests

    def __len__(self) -> int:
        return int(self._digests.shape[0])

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return [int.from_bytes(d.tobytes(), "big") for d in self._digests[i]]
        return int.from_bytes(self._digests[i].tobytes(), "big")


def _without_leading_tokens(region: GroupRegion, skip: int) -> GroupRegion:
    """`region` with the first `skip` tokens of value 0 left out of its pieces (a load then never writes them).
    A region of cross-layer block runs (one piece per whole block) goes back to its planes' pieces first: a run
    cannot lose tokens."""
    planes, all_pieces = region.planes, region.pieces
    if planes is not region.group.planes:  # block runs
        planes = region.group.planes
        all_pieces = plane_pieces_of_runs(all_pieces, planes.block_size)
    end = int(region.piece_start[1])
    head = all_pieces[:, :end]
    cut = np.clip(skip - head[4], 0, head[1])  # tokens each of value 0's pieces loses
    keep = cut < head[1]
    kept = head[:, keep].copy()
    kept[0] += cut[keep]  # start slot (a piece is a run of slots inside one block)
    kept[1] -= cut[keep]  # count
    kept[4] += cut[keep]  # index in the value
    pieces = np.ascontiguousarray(np.concatenate([kept, all_pieces[:, end:]], axis=1))
    piece_start = region.piece_start.copy()
    piece_start[1:] -= end - kept.shape[1]
    piece_value = np.concatenate([region.piece_value[:end][keep], region.piece_value[end:]])
    return GroupRegion(region.group, planes, pieces, piece_start, piece_value)

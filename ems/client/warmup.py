"""Warm the small call's path when a CPU cache is registered, so that a process's first saves and loads run at
their steady speed.

Contract: `warm_small_calls(layout, backend)` plans a one-block request of `layout`'s first block (arithmetic
only: the registered cache is neither read nor written) and runs a few one-block saves and loads through the
embedded jobs on a scratch cache of one layer, shaped like the first one, and a scratch store of its own. Nothing
reaches the pool, and no call is counted in the ledger or the metrics. Only CPU layouts are warmed (the embedded
one-pass path); an accelerator's first launches compile kernels, which is not a cost to pay at registration. It
never raises: a warm-up that fails leaves the first calls slower, nothing else.

Why: in a fresh process the first one-block save took about 1 ms and the next ten 70-160 µs against about 55 µs
steady (perf/RESULTS.md, "The small call"). The first call builds tables (request shapes, run plans) and the copy
backend's per-layout views; the next ones run CPython's specializing interpreter in its adaptive phase, which
rewrites a function's bytecode only after that function has run several times. The backend's views of the
registered planes are still built by the first real call (they need a copy to be built, and registering moves
no data).
"""

from __future__ import annotations

import logging

import torch

from ems.datapath.arguments import Operation, SlotCall
from ems.datapath.calls import bind_call
from ems.datapath.copier import copier_for
from ems.datapath.jobs import EmbeddedLoad, EmbeddedSave, Transfer
from ems.datapath.layout import RegisteredLayout, register_layout
from ems.datapath.planning import BlockPlan, plan_blocks
from ems.kernels import CopyBackend
from ems.records import JobKind, JobRecord
from ems.store.kv_store import KvStore
from ems.types import CcKvOption

logger = logging.getLogger(__name__)

ROUNDS = 12  # one-block saves and loads: past the interpreter's adaptive phase (it specializes after a few runs)
_SCRATCH_NAMESPACE = b"ems-warm-up"  # keys of the scratch store only


def warm_small_calls(layout: RegisteredLayout, backend: CopyBackend) -> None:
    """See the module docstring."""
    if layout.device.type != "cpu":
        return
    try:
        _one_block_plan(layout, Operation.SAVE, list(range(_first_block_tokens(layout))), 0)  # cached per layout
        _save_and_load_scratch(layout, backend)
    except Exception:  # a warm-up only saves time: never fail a registration over it
        logger.warning("warming the small call's path failed; the first calls will be slower", exc_info=True)


def _one_block_plan(layout: RegisteredLayout, op: Operation, slots: torch.Tensor | list[int], block_hash: int) -> BlockPlan:
    call = bind_call(op, (slots, [block_hash], [len(slots)]), {}, layout)
    if not isinstance(call, SlotCall):  # not for these arguments; kept for type narrowing
        raise TypeError("a V1 slot_mapping call was expected")
    return plan_blocks(call, layout, _SCRATCH_NAMESPACE)


def _first_block_tokens(layout: RegisteredLayout) -> int:
    return min(layout.min_store_block_size, min(g.planes.block_size for g in layout.groups))


def _save_and_load_scratch(layout: RegisteredLayout, backend: CopyBackend) -> None:
    """One-block saves and loads of a one-layer scratch cache shaped like the first group's first layer, through
    the embedded jobs into a scratch store; slot_mapping as a tensor and as a list (engines pass either)."""
    planes = layout.groups[0].planes.planes
    k, v = planes[0], planes[-1]
    scratch = register_layout([[torch.zeros((2, *k.shape[1:]), dtype=k.dtype), torch.zeros((2, *v.shape[1:]), dtype=v.dtype)]])
    slot_tensor = torch.arange(_first_block_tokens(scratch), dtype=torch.int64)
    slot_list = slot_tensor.tolist()
    store: KvStore | None = None
    plan_device, option = torch.device("cpu"), CcKvOption()
    copier = copier_for(backend, plan_device)
    for i in range(ROUNDS):
        slots = slot_tensor if i % 2 else slot_list
        plan = _one_block_plan(scratch, Operation.SAVE, slots, i)
        if store is None:
            store = KvStore(4 * (plan.value_len(0) + (4 << 10)))  # a few values: every save fits
        save = EmbeddedSave(Transfer(plan, plan_device, copier, option, JobRecord(JobKind.SAVE)), store)
        save.begin()
        save.finish()
        load = _one_block_plan(scratch, Operation.LOAD, slots, i)
        EmbeddedLoad(Transfer(load, plan_device, copier, option, JobRecord(JobKind.LOAD)), store).run()

"""A public call's arguments -> its request and its plan (what `ContextCaching.save`/`load` and their async forms
hand to the jobs).

Contract: `bind_and_plan` picks the form by the arguments (the token form: `ems.datapath.tokens`; the hash, chunk
and V0 forms: `ems.datapath.requests`), checks them (bad input raises `EmsException(EMS_INVALID_ARGUMENT)` naming
the argument, before anything moves) and plans the call as data (`ems.datapath.planning`): V0 keys in the V0
namespace on the raw device, V1 blocks in the registered layout's namespace on the layout's device. Pure: it reads
no client state but what it is given.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ems.datapath.layout import RegisteredLayout
from ems.datapath.planning import Plan, plan_blocks, plan_raw
from ems.datapath.requests import Operation, RawRequest, Request, bind_request
from ems.datapath.tokens import TokenRequest, bind_tokens, is_token_form, plan_tokens
from ems.errors import EmsErrorCode, EmsException


def bind_and_plan(
    op: Operation,
    args: tuple,
    kwargs: dict,
    layout: RegisteredLayout | None,
    v0_namespace: bytes,
    v1_namespace: bytes,
    raw_device: Callable[[], torch.device],
) -> tuple[Request | TokenRequest, Plan, torch.device]:
    """The call's request, its plan and the device it moves on (`raw_device()`: the V0 device, asked only for V0)."""
    bind = bind_tokens if is_token_form(kwargs) else bind_request
    request = bind(op, args, kwargs, layout)
    if isinstance(request, RawRequest):
        return request, plan_raw(request, v0_namespace), raw_device()
    if layout is None:  # bind_request already refuses this; kept for type narrowing
        raise EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, "V1 calls need register_kvcache() first")
    if isinstance(request, TokenRequest):
        return request, plan_tokens(request, layout, v1_namespace), layout.device
    return request, plan_blocks(request, layout, v1_namespace), layout.device

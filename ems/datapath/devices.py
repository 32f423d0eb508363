"""Device plumbing: resolving device names, importing torch_npu only when an NPU appears, side streams.

Work on an accelerator runs on a side stream that first waits for the engine's current stream (so a save sees the
KV the engine just computed) and is synchronised before control returns to the caller (so the engine may reuse or
read the blocks at once). On CPU everything is synchronous already. `device_work(device)` is that choice made once
per device (a job's copier keeps it: `ems.datapath.copier.Copier.device_work`): what a call enters, not a helper it
calls.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ems.errors import EmsErrorCode, EmsException


def ensure_backend_for(device_type: str) -> None:
    """Import torch_npu the first time an `npu` device is named (never at `import ems`)."""
    if device_type == "npu" and "torch_npu" not in sys.modules:
        try:
            importlib.import_module("torch_npu")
        except ImportError as exc:
            raise EmsException(
                EmsErrorCode.EMS_INTERNAL_ERROR, f"an npu device needs torch_npu, which failed to import: {exc}"
            ) from exc


def parse_device(spec: str) -> torch.device:
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as exc:
        raise EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, f"device: cannot parse {spec!r}: {exc}") from exc
    ensure_backend_for(device.type)
    return device


def default_raw_device(device_id: int, registered: torch.device | None) -> torch.device:
    """Where V0 addresses live when the config does not say: see `ems.settings`."""
    if registered is not None:
        return registered
    if "torch_npu" in sys.modules:
        return torch.device("npu", device_id)
    if torch.cuda.is_available():
        return torch.device("cuda", device_id)
    return torch.device("cpu")


def device_module(device: torch.device) -> Any:
    """torch.cuda / torch.npu for an accelerator device (Any: torch.npu exists only once torch_npu is imported)."""
    ensure_backend_for(device.type)
    return getattr(torch, device.type)


@contextlib.contextmanager
def side_stream(device: torch.device) -> Iterator[None]:
    """Run the block's device work on a side stream ordered after the engine's current stream, then wait for it.

    The work also runs under `torch.inference_mode()`: engines often allocate their KV cache inside inference mode,
    and in-place writes to such tensors are refused outside it (writes to ordinary tensors are allowed inside it).
    """
    with torch.inference_mode():
        if device.type == "cpu":
            yield
            return
        module = device_module(device)
        stream = module.Stream(device=device)
        stream.wait_stream(module.current_stream(device))
        with module.stream(stream):
            yield
        stream.synchronize()


def device_work(device: torch.device) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """What a job's device work runs in on `device`, chosen once: `side_stream(device)` on an accelerator, inference
    mode alone on CPU (all `side_stream` does there)."""
    if device.type == "cpu":
        return torch.inference_mode
    return functools.partial(side_stream, device)

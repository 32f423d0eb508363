"""Backend selection: which `CopyBackend` serves a device.

Contract: `get_backend(device, requested)` obeys `requested` (the package's config layer has already resolved
`EmsConfig(kernel_backend=...)` against `EMS_KERNEL_BACKEND`) and returns one cached backend per (device,
request):

| requested | cuda / npu | cpu |
|---|---|---|
| auto | triton if `triton` imports, else torch (one warning) | host; torch without a C compiler |
| triton | triton; RuntimeError if `triton` cannot be imported | the Triton interpreter (*) |
| host | RuntimeError (CPU only) | host; RuntimeError if its C library cannot be built |
| torch | torch | torch |
| memcpy | memcpy | memcpy |

(*) RuntimeError unless `TRITON_INTERPRET=1` was set before Triton kernels were first built in the process.

The choice is logged once at INFO on `ems.kernels` per (device, backend); each backend has `.name`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

from ems.kernels.base import CopyBackend, KernelBackend
from ems.kernels.host_backend import HostBackend
from ems.kernels.host_copy import host_copy
from ems.kernels.memcpy_backend import MemcpyBackend
from ems.kernels.torch_backend import TorchBackend

log = logging.getLogger("ems.kernels")


def triton_importable() -> bool:
    """True when a `triton` module (upstream or triton-ascend) is installed; does not import it."""
    return importlib.util.find_spec("triton") is not None


def _make(device: torch.device, kind: KernelBackend) -> CopyBackend:
    if kind == KernelBackend.TORCH:
        return TorchBackend()
    if kind == KernelBackend.MEMCPY:
        return MemcpyBackend()
    if kind == KernelBackend.HOST:
        if device.type != "cpu":
            raise RuntimeError(f"kernel backend 'host' copies CPU tensors only, not {device}")
        library = host_copy()
        if library is None:
            raise RuntimeError("kernel backend 'host' requested but its C library cannot be built here (see the log)")
        return HostBackend(library)
    if kind == KernelBackend.TRITON:
        if not triton_importable():
            raise RuntimeError(
                "kernel backend 'triton' requested but no triton module is installed "
                "(pip install triton for cuda/the interpreter, triton-ascend for npu)"
            )
        from ems.kernels.triton_backend import TritonBackend

        return TritonBackend(device)  # raises a clear RuntimeError on CPU without the interpreter
    # AUTO
    if device.type in ("cuda", "npu"):
        if triton_importable():
            from ems.kernels.triton_backend import TritonBackend

            return TritonBackend(device)
        log.warning("no triton module installed: %s uses the torch copy path (slower, more device ops)", device)
    elif device.type == "cpu":
        library = host_copy()
        if library is not None:
            return HostBackend(library)
    return TorchBackend()


def get_backend(device: torch.device, requested: KernelBackend = KernelBackend.AUTO) -> CopyBackend:
    """The backend for `device` (one instance per device and request, however the arguments are spelt)."""
    # (no conversion when the arguments already have their types: this runs on every call)
    return _cached_backend(
        device if isinstance(device, torch.device) else torch.device(device),
        requested if isinstance(requested, KernelBackend) else KernelBackend(requested),
    )


@functools.cache
def _cached_backend(device: torch.device, kind: KernelBackend) -> CopyBackend:
    backend = _make(device, kind)
    _log_choice(device, backend.describe(), kind.value)
    return backend


# tests start from a clean cache; a function attribute mypy cannot type on a plain function
get_backend.cache_clear = _cached_backend.cache_clear  # type: ignore[attr-defined]


@functools.cache
def _log_choice(device: torch.device, backend: str, requested: str) -> None:
    log.info("ems.kernels: %s copies with the %s backend (requested: %s)", device, backend, requested)

"""Kernel tests: every backend (Triton interpreter, compiled host loop, torch, memcpy) on CPU tensors.

TRITON_INTERPRET=1 must be in the environment before the first Triton kernel of the process is defined (the
kernels are built lazily, at first use), so it is set here, at the top, before anything imports ems. This also
holds when the whole tests/ tree is collected in one process: conftest files are imported at collection, before
any test runs a kernel.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from collections.abc import Callable

import pytest
import torch

from ems.kernels.base import CopyBackend
from ems.kernels.host_backend import HostBackend
from ems.kernels.host_copy import host_copy
from ems.kernels.memcpy_backend import MemcpyBackend
from ems.kernels.select import triton_importable
from ems.kernels.torch_backend import TorchBackend


def _triton() -> CopyBackend:
    from ems.kernels.triton_backend import TritonBackend

    return TritonBackend(torch.device("cpu"))


def _host() -> CopyBackend:
    library = host_copy()
    if library is None:
        pytest.fail("the compiled host copy did not build (a C compiler is on every CI machine)")
    return HostBackend(library)


FACTORIES: dict[str, Callable[[], CopyBackend]] = {
    "triton": _triton,
    "host": _host,
    "torch": TorchBackend,
    "memcpy": MemcpyBackend,
}


@pytest.fixture(params=list(FACTORIES))
def backend(request: pytest.FixtureRequest) -> CopyBackend:
    """A fresh backend of each kind; the Triton one runs in the interpreter."""
    if request.param == "triton" and not triton_importable():
        pytest.skip("triton is not installed")
    return FACTORIES[request.param]()

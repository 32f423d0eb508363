"""Kernel tests: every backend (Triton interpreter, torch, memcpy) on CPU tensors.

TRITON_INTERPRET=1 must be in the environment before the first Triton kernel of the process is defined (the
kernels are built lazily, at first use), so it is set here, at the top, before anything imports ems. This also
holds when the whole tests/ tree is collected in one process: conftest files are imported at collection, before
any test runs a kernel.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from typing import Callable, Dict  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from ems.kernels.base import CopyBackend  # noqa: E402
from ems.kernels.memcpy_backend import MemcpyBackend  # noqa: E402
from ems.kernels.select import triton_importable  # noqa: E402
from ems.kernels.torch_backend import TorchBackend  # noqa: E402


def _triton() -> CopyBackend:
    from ems.kernels.triton_backend import TritonBackend

    return TritonBackend(torch.device("cpu"))


FACTORIES: Dict[str, Callable[[], CopyBackend]] = {
    "triton": _triton,
    "torch": TorchBackend,
    "memcpy": MemcpyBackend,
}


@pytest.fixture(params=list(FACTORIES))
def backend(request: pytest.FixtureRequest) -> CopyBackend:
    """A fresh backend of each kind; the Triton one runs in the interpreter."""
    if request.param == "triton" and not triton_importable():
        pytest.skip("triton is not installed")
    return FACTORIES[request.param]()

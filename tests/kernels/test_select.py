"""Backend selection, validation, and the Triton backend's one-warning fallback."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from kernel_cases import make_layout, pieces_case, reference_pieces

from ems.kernels.base import Fusion, KernelBackend
from ems.kernels.memcpy_backend import MemcpyBackend
from ems.kernels.planes import PlaneSet
from ems.kernels.select import get_backend, triton_importable

CPU = torch.device("cpu")
needs_triton = pytest.mark.skipif(not triton_importable(), reason="triton is not installed")


def test_auto_on_cpu_is_the_host_loop() -> None:
    assert get_backend(CPU).name == "host"
    assert get_backend(CPU).fusion is Fusion.FUSED
    assert get_backend(CPU, KernelBackend.HOST).name == "host"
    assert get_backend(CPU, KernelBackend.TORCH).name == "torch"
    assert get_backend(CPU, KernelBackend.MEMCPY).name == "memcpy"
    assert get_backend(CPU) is get_backend(CPU, KernelBackend.AUTO)  # cached


@needs_triton
def test_forced_triton_on_cpu_runs_the_interpreter() -> None:
    backend = get_backend(CPU, KernelBackend.TRITON)
    assert backend.name == "triton"
    assert "interpreter" in backend.describe()


def test_choice_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    get_backend.cache_clear()
    from ems.kernels import select

    select._log_choice.cache_clear()
    with caplog.at_level(logging.INFO, logger="ems.kernels"):
        get_backend(CPU, KernelBackend.MEMCPY)
        get_backend.cache_clear()
        get_backend(CPU, KernelBackend.MEMCPY)
    lines = [r for r in caplog.records if r.name == "ems.kernels" and "memcpy" in r.getMessage()]
    assert len(lines) == 1


@needs_triton
def test_triton_on_cpu_without_interpreter_explains() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch\n"
        "from ems.kernels import get_backend, KernelBackend\n"
        "try:\n"
        "    get_backend(torch.device('cpu'), KernelBackend.TRITON)\n"
        "except RuntimeError as e:\n"
        "    print('RAISED', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "RAISED" in done.stdout and "TRITON_INTERPRET=1" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("kind", ["triton", "memcpy"])
def test_out_of_range_piece_is_refused(kind: str) -> None:
    if kind == "triton" and not triton_importable():
        pytest.skip("triton is not installed")
    backend = get_backend(CPU, KernelBackend(kind))
    gen = torch.Generator().manual_seed(1)
    _, planes = make_layout("plain", layers=1, blocks=2, block_size=4, heads=1, head_size=4, dtype=torch.float16, gen=gen)
    pieces, _, _, total = pieces_case(planes, [0, 1], [2])
    out = torch.zeros(total, dtype=torch.uint8)
    backend.gather_pieces(planes, pieces, out)
    for bad in ([[7], [2], [40], [2], [0]], [[-1], [1], [40], [2], [0]]):  # past the cache; a negative slot
        with pytest.raises(ValueError):
            backend.gather_pieces(planes, torch.tensor(bad, dtype=torch.int64), out)
    with pytest.raises(ValueError):
        backend.gather_pieces(planes, pieces, out[:-1])  # staging too short


@needs_triton
def test_compile_failure_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import ems.kernels.triton_backend as tb

    backend = tb.TritonBackend(CPU)

    class Broken:
        def __getitem__(self, grid: tuple) -> Broken:
            return self

        def __call__(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("simulated compile failure")

    monkeypatch.setattr(tb, "_build", lambda: {"pieces": Broken(), "segments": Broken(), "interpreted": True})
    gen = torch.Generator().manual_seed(2)
    _, planes = make_layout("plain", layers=1, blocks=3, block_size=4, heads=1, head_size=6, dtype=torch.bfloat16, gen=gen)
    slots = [1, 2, 9, 0]
    pieces, tok_start, part_base, total = pieces_case(planes, slots, [3, 1])
    expected, _ = reference_pieces(planes, slots, tok_start, part_base, total)
    with caplog.at_level(logging.WARNING, logger="ems.kernels"):
        for _ in range(3):
            out = expected.clone().fill_(0xA5)
            backend.gather_pieces(planes, pieces, out)
            assert torch.equal(out, expected)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "ems.kernels"]
    assert len(warnings) == 1 and "torch" in warnings[0].getMessage()
    assert "fell back" in backend.describe()


def test_planeset_rejects_mixed_planes() -> None:
    with pytest.raises(ValueError):
        PlaneSet(())
    assert isinstance(get_backend(CPU, KernelBackend.MEMCPY), MemcpyBackend)


@needs_triton
@pytest.mark.parametrize("device", ["cuda"])  # "npu" is unknown to torch without torch_npu
def test_auto_on_accelerators_is_triton(device: str) -> None:
    """Building the backend touches no device (kernels and core counts are resolved at first launch)."""
    backend = get_backend(torch.device(device), KernelBackend.AUTO)
    assert backend.name == "triton"


@needs_triton
def test_bad_segments_are_refused() -> None:
    backend = get_backend(CPU, KernelBackend.TRITON)
    buf = torch.ones(64, dtype=torch.uint8)
    out = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError):
        backend.gather_segments(torch.tensor([0]), torch.tensor([8]), out)  # null address
    with pytest.raises(ValueError):
        backend.gather_segments(torch.tensor([buf.data_ptr()]), torch.tensor([4]), out)  # lengths != out size
    with pytest.raises(ValueError):
        backend.gather_segments(torch.tensor([buf.data_ptr()]), torch.tensor([8]), out.view(2, 4))  # not 1-D


@needs_triton
def test_mismatched_planes_are_refused() -> None:
    backend = get_backend(CPU, KernelBackend.TRITON)
    a = torch.ones(2, 4, 1, 8, dtype=torch.float16)
    b = torch.ones(3, 4, 1, 8, dtype=torch.float16)
    with pytest.raises(ValueError):
        backend.gather_pieces(PlaneSet((a, b)), torch.tensor([[0], [1], [0], [1], [0]]), torch.empty(32, dtype=torch.uint8))


def test_host_array_views_a_cpu_tensor_as_numpy_does() -> None:
    """`host_array` (what the CPU copy path uses instead of `Tensor.numpy()`, which gives the GIL away): the same
    memory, shape and strides, for strided int views and empty tensors alike (numpy before 2.4 refuses address 0)."""
    import numpy as np

    from ems.kernels.host_copy import host_array

    base = torch.arange(96, dtype=torch.int64)
    for tensor in (base, base.as_strided((5, 4), (16, 1)), base.view(torch.uint8)[8:40], torch.empty(0, dtype=torch.uint8)):
        view = host_array(tensor)
        assert view.shape == tuple(tensor.shape) and np.array_equal(view, tensor.numpy())
        if tensor.numel():
            assert view.ctypes.data == tensor.data_ptr() and view.strides == tensor.numpy().strides
    with pytest.raises(ValueError, match="byte or int dtype"):
        host_array(torch.zeros(3))


def test_auto_on_cpu_falls_back_to_torch_without_the_host_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """No C library (no compiler, or EMS_HOST_COPY=off): AUTO copies with torch, HOST says why it cannot."""
    from ems.kernels import host_copy

    monkeypatch.setenv("EMS_HOST_COPY", "off")
    host_copy.host_copy.cache_clear()
    get_backend.cache_clear()
    try:
        assert get_backend(CPU).name == "torch"
        with pytest.raises(RuntimeError, match="host"):
            get_backend(CPU, KernelBackend.HOST)
    finally:
        monkeypatch.delenv("EMS_HOST_COPY")
        host_copy.host_copy.cache_clear()
        get_backend.cache_clear()


def test_host_loop_builds_into_a_fresh_cache(tmp_path: os.PathLike, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh cache directory gets the library built once; a second process start loads the same file."""
    from ems.kernels import host_copy

    monkeypatch.setenv("EMS_CACHE_DIR", str(tmp_path))
    host_copy.host_copy.cache_clear()
    try:
        library = host_copy.host_copy()
        assert library is not None and library.path.parent == tmp_path
        built = sorted(p.name for p in tmp_path.iterdir())
        assert built == [library.path.name]  # no temporary file left behind
        host_copy.host_copy.cache_clear()
        again = host_copy.host_copy()
        assert again is not None and again.path == library.path
    finally:
        host_copy.host_copy.cache_clear()


def test_host_backend_refuses_other_devices() -> None:
    with pytest.raises(RuntimeError, match="CPU tensors only"):
        get_backend(torch.device("meta"), KernelBackend.HOST)

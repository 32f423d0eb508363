"""The wheel holds every module of the package: `pyproject.toml` lists packages one by one (kernels/ and transport/
install as ems.kernels and ems.transport), so a subpackage missing from the list would be missing from every
non-editable install while editable installs and the rest of the suite never notice."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALLED_AS = {"ems": "ems", "kernels": "ems/kernels", "transport": "ems/transport"}  # (pyproject's package-dir)


@pytest.mark.slow
def test_the_wheel_holds_every_module(tmp_path):
    # from a clean copy: an editable install's egg-info lists every file, and setuptools then packs the unlisted
    # subpackages as data of their parents, which hides the gap that a fresh clone's wheel has
    source = tmp_path / "source"
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".venv*", ".git", "build", "dist", "*.egg-info", "__pycache__", "*.png")
    )
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if built.returncode != 0 and "No module named" in built.stderr:
        pytest.skip(f"cannot build a wheel here: {built.stderr.strip()[-200:]}")
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("ems_kvcache-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"{INSTALLED_AS[top]}/{path.relative_to(ROOT / top).as_posix()}"
        for top in INSTALLED_AS
        for path in (ROOT / top).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    missing = sorted(expected - names)
    assert not missing, f"modules missing from the wheel (add their package to pyproject.toml): {missing}"
    assert "ems/kernels/host_copy.c" in names  # compiled on first use

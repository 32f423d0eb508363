"""`python -m ems` (`ems/__main__.py`): run from the parent of a clone named `ems`, Python imports the clone as a
namespace package; the command says so instead of failing on an import (README.md, Troubleshooting)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_run_from_the_parent_of_a_clone_named_ems_names_the_folder(tmp_path):
    (tmp_path / "ems").symlink_to(ROOT, target_is_directory=True)  # a clone named ems, seen from its parent
    found = _run(tmp_path, "-c", "import ems; print(ems.__file__)")
    if found.stdout.strip() != "None":  # a regular install is found before the folder: nothing to explain
        pytest.skip(f"ems is the installed package here ({found.stdout.strip() or found.stderr.strip()})")
    out = _run(tmp_path, "-m", "ems", "demo")
    assert out.returncode == 2, out
    assert f"imported the folder {tmp_path / 'ems'} as the package ems" in out.stderr, out.stderr
    assert "Troubleshooting" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_the_package_itself_gives_no_such_message(capsys):
    from ems.__main__ import main

    assert main(["--help"]) == 0
    captured = capsys.readouterr()
    assert "usage: python -m ems demo" in captured.out and captured.err == ""

"""Every name a benchmark in perf/ imports from the package exists (benchmarks run by hand, not in CI: a name moved
by a refactoring would otherwise break them unnoticed), whether imported at the top or inside a function."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parent.parent / "perf"


def _package_imports(path: Path) -> list[tuple[str, str, int]]:
    """(module, name, line) of every `from ems... import name` in the file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ems":
            found.extend((node.module, alias.name, node.lineno) for alias in node.names)
    return found


@pytest.mark.parametrize("script", sorted(PERF.glob("*.py")), ids=lambda p: p.name)
def test_the_names_a_benchmark_imports_exist(script: Path) -> None:
    missing, unchecked = [], []
    for module, name, line in _package_imports(script):
        try:
            imported = importlib.import_module(module)
            found = hasattr(imported, name)
        except ModuleNotFoundError as error:  # a module of the package that needs an engine this venv lacks (vllm)
            if (error.name or "ems").split(".")[0] == "ems":
                raise
            unchecked.append(f"{script.name}:{line}: {module}.{name} needs {error.name}")
            continue
        if not found:
            try:
                importlib.import_module(f"{module}.{name}")  # a submodule
            except ImportError:
                missing.append(f"{script.name}:{line}: {module}.{name}")
    assert not missing, missing
    if unchecked:
        pytest.skip(f"not installed here: {unchecked}")

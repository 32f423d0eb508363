"""The transport's layering: no `ems.transport.*` module imports the store or the node that serves through it
(`ems.pool`), not even for type checking, and `Buffer` has one definition.

Each module is imported in a fresh interpreter, since this test process has long imported `ems.store.kv_store`.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import ems.buffers
import ems.store.value_format
import ems.transport
from ems.transport import base

# every module, the media's subpackages (`ucx`, `shm`) and their modules included
TRANSPORT_MODULES = sorted(m.name for m in pkgutil.walk_packages(ems.transport.__path__, "ems.transport."))
# the ems modules a transport module may import: leaf modules that import nothing of ems themselves
ALLOWED_EMS = {"ems", "ems.buffers", "ems.errors", "ems.records", "ems.transport"}


@pytest.mark.parametrize("module", TRANSPORT_MODULES)
def test_transport_module_imports_no_store(module: str) -> None:
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'ems' or m.startswith('ems.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert module in loaded  # the probe did import the module it names
    assert "ems.store.kv_store" not in loaded
    outside = {m for m in loaded if not m.startswith("ems.transport.")} - ALLOWED_EMS
    assert outside == set(), f"{module} imports {sorted(outside)}"


def _imported_names(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` of the file names, wherever it stands (`TYPE_CHECKING` blocks,
    functions), resolved for relative imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative to the file's package (`ems.transport`, or one of its subpackages)
                package = ["ems", "transport", *path.parent.relative_to(TRANSPORT_ROOT).parts]
                base = ".".join([*package[: len(package) - (node.level - 1)], *filter(None, [base])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


TRANSPORT_ROOT = Path(ems.transport.__path__[0])
TRANSPORT_FILES = sorted(TRANSPORT_ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", TRANSPORT_FILES, ids=lambda p: p.relative_to(TRANSPORT_ROOT).as_posix())
def test_transport_never_names_the_node_or_the_store(path: Path) -> None:
    """The node (`ems.pool`) serves through `transport.handler`'s protocols: no transport file imports it (nor the
    store), even only for type checking or inside a function."""
    forbidden = {
        n
        for n in _imported_names(path)
        if n.split(".")[:2] in (["ems", "pool"], ["ems", "store"]) or n in ("ems.pool", "ems.store")
    }
    assert forbidden == set(), f"{path.name} imports {sorted(forbidden)}"


def test_transport_files_are_found() -> None:
    found = {p.relative_to(TRANSPORT_ROOT).as_posix() for p in TRANSPORT_FILES}
    assert {"handler.py", "ucx/server.py", "shm/server.py", "shm/__init__.py"} <= found


def test_buffer_has_one_definition() -> None:
    assert ems.store.value_format.Buffer is ems.buffers.Buffer
    assert base.Buffer is ems.buffers.Buffer


def test_transport_list_is_not_empty() -> None:
    assert {"ems.transport.base", "ems.transport.inprocess", "ems.transport.ucx.client", "ems.transport.shm.client"} <= set(
        TRANSPORT_MODULES
    )

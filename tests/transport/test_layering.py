"""The transport's layering: no `ems.transport.*` module imports the store, and `Buffer` has one definition.

Each module is imported in a fresh interpreter, since this test process has long imported `ems.store.kv_store`.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import ems.buffers
import ems.store.value_format
import ems.transport
from ems.transport import base

TRANSPORT_MODULES = sorted(f"ems.transport.{m.name}" for m in pkgutil.iter_modules(ems.transport.__path__))
# the ems modules a transport module may import: leaf modules that import nothing of ems themselves
ALLOWED_EMS = {"ems", "ems.buffers", "ems.deadline", "ems.errors", "ems.transport"}


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


def test_buffer_has_one_definition() -> None:
    assert ems.store.value_format.Buffer is ems.buffers.Buffer
    assert base.Buffer is ems.buffers.Buffer


def test_transport_list_is_not_empty() -> None:
    assert {"ems.transport.base", "ems.transport.inprocess", "ems.transport.ucx"} <= set(TRANSPORT_MODULES)

"""The ucxx and UCX internals ems.transport reaches into are all there, and all listed (transport/ucx/ucxx_internals.py).

When ucxx moves one, `test_every_internal_is_present` names it; when a transport module starts importing a private
ucxx name, `test_every_private_import_is_listed` asks for its entry in the table (and with it, a second look at the
pin in pyproject.toml)."""

from __future__ import annotations

import ast
import importlib.util
import re
from importlib.metadata import version
from pathlib import Path

import pytest

pytest.importorskip("ucxx")

import ems.transport
from ems.transport.ucx import config as ucx_config
from ems.transport.ucx import ucxx_internals

TRANSPORT = Path(ems.transport.__file__).resolve().parent  # transport/, the media's subpackages included
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def ucx_environment():
    ucx_config.apply_env_defaults()  # as init_ucx does before ucxx loads


def test_every_internal_is_present():
    import ucxx  # noqa: F401 - loads libucp and libucs for the C symbols

    gone = ucxx_internals.missing()
    assert not gone, "ucxx internals gone: " + "; ".join(f"{i.where}.{i.name} (used by {i.used_by})" for i in gone)
    ucxx_internals.check()


def test_the_installed_ucxx_is_the_tested_series():
    assert version("ucxx-cu12").startswith(ucxx_internals.TESTED_UCXX + "."), version("ucxx-cu12")


def test_the_pin_matches_the_tested_series():
    pyproject = (ROOT / "pyproject.toml").read_text()
    pins = set(re.findall(r'"ucxx-cu12([^"]*)"', pyproject))
    major, minor = ucxx_internals.TESTED_UCXX.split(".")
    assert pins == {f">={major}.{minor},<{major}.{int(minor) + 1}"}, pins


def test_a_missing_internal_is_named(monkeypatch):
    fake = ucxx_internals.Internal("ucxx.core", "no_such_name", "nothing")
    monkeypatch.setattr(ucxx_internals, "INTERNALS", (*ucxx_internals.INTERNALS, fake))
    with pytest.raises(RuntimeError, match=r"ucxx\.core\.no_such_name \(used by nothing\)"):
        ucxx_internals.check()


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent is a module, not a package
        return False


def _private_imports() -> set[tuple[str, str]]:
    """(module, name) for every `from ucxx.<private> import name` and `import ucxx.<private> as alias` + `alias.name`
    in transport/ (every folder)."""
    found: set[tuple[str, str]] = set()
    for path in TRANSPORT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ucxx."):
                for a in node.names:
                    if _is_module(f"{node.module}.{a.name}"):
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    else:
                        found.add((node.module, a.name))
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("ucxx.")})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                found.add((aliases[node.value.id], node.attr))
    return found


def test_every_private_import_is_listed():
    listed = {(i.where, i.name.split(".")[0]) for i in ucxx_internals.INTERNALS}
    unlisted = sorted(_private_imports() - listed)
    assert not unlisted, f"add these to transport/ucx/ucxx_internals.py INTERNALS: {unlisted}"

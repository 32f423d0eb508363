"""The package's layers, read from its source: which part of `ems` imports which, and that it never goes in a circle.

Every module of the package (`ems/`, and `kernels/` and `transport/`, installed as `ems.kernels` and
`ems.transport`) is parsed with `ast`; every import counts, wherever it stands: at the top, inside a function, under
`TYPE_CHECKING`. Each module belongs to one part: its subpackage (`ems.datapath`, `ems.kernels`, ...), or itself for
a top-level module (`ems.config`, `ems.staging`, ...; `ems` is `ems/__init__.py`, the public facade). The parts'
graph must be:

* one-way where the architecture says so: the backends build on the cluster's membership and placement, and the data
  path builds on the backends' contract, never the reverse (`ems.backends` imports nothing of `ems.datapath`,
  `ems.cluster` nothing of `ems.backends`);
* staging below both the data path and the backends, which both use it: its module is in neither and imports
  neither;
* free of cycles, type-only imports included (a part's own modules may import each other).

Inside the transport, by medium: its contract (the modules of `transport/` itself: `base`, `protocol`, `handler`, ...)
imports no medium (`ems.transport.ucx`, `ems.transport.shm`, `ems.transport.tcp`), shared memory and the TCP lookup
channel import no other medium (each client is handed what it needs of its node client), and no module of the
transport imports, through any chain of the transport's modules, one that imports it (type-only imports included).

No module is over `MAX_MODULE_LINES` lines: what was split too fine is merged, and what grows past the limit is
split along its contract.

A failure names each offending import with its file and line.
"""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# where each installed package's source lies (pyproject.toml's package-dir)
SOURCES = {"ems": ROOT / "ems", "ems.kernels": ROOT / "kernels", "ems.transport": ROOT / "transport"}
STAGING = "ems.staging"  # the staging pool's module (`StagingPool`)
MAX_MODULE_LINES = 400
NEVER = {  # importer -> imported: the one-way layers
    ("ems.backends", "ems.datapath"): "the data path builds on the backends' contract, not the reverse",
    ("ems.cluster", "ems.backends"): "the backends build on the cluster's membership and placement, not the reverse",
}
TRANSPORT = "ems.transport"  # the transport's contract: the modules of transport/ itself
MEDIA = ("ems.transport.ucx", "ems.transport.shm", "ems.transport.tcp")  # its subpackages, one per medium
_HANDED = "is handed what it needs of its node client (`transport.base.NodeLink`), it does not reach into another medium"
TRANSPORT_NEVER = {  # importer -> imported, inside the transport
    **{(TRANSPORT, medium): "the contract is what every medium shares: it names none of them" for medium in MEDIA},
    ("ems.transport.shm", "ems.transport.ucx"): f"shared memory {_HANDED}",
    ("ems.transport.shm", "ems.transport.tcp"): f"shared memory {_HANDED}",
    ("ems.transport.tcp", "ems.transport.ucx"): f"the lookup channel {_HANDED}",
    ("ems.transport.tcp", "ems.transport.shm"): f"the lookup channel {_HANDED}",
}


@dataclass(frozen=True)
class Import:
    """One import statement's target: the module that imports (`source`, its file and line) and the one it names."""

    source: str
    target: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.source} imports {self.target}"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its `__init__.py`)."""
    modules: dict[str, Path] = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


MODULES = _modules()


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The `ems` modules an import names (`from a import b` names `a.b` where that is a module, else `a`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join([*anchor, *filter(None, [base])])
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]


def imports_of(name: str, path: Path, source: str) -> list[Import]:
    """Every import of an `ems` module in module `name`'s `source`, wherever it stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[Import, None] = {}  # (ordered, once each: `from a import b, c` may name `a` twice)
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _targets(node, package):
                if target == "ems" or target.startswith("ems."):
                    found[Import(name, target, path, node.lineno)] = None
    return list(found)


IMPORTS = [imp for name, path in MODULES.items() for imp in imports_of(name, path, path.read_text())]


def part(module: str) -> str:
    """The part a module belongs to: `ems.<subpackage>`, or the top-level module itself (`ems` for the facade)."""
    return ".".join(module.split(".")[:2])


def _between_parts() -> dict[tuple[str, str], list[Import]]:
    edges: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for imp in IMPORTS:
        if part(imp.source) != part(imp.target):
            edges[part(imp.source), part(imp.target)].append(imp)
    return edges


EDGES = _between_parts()


def transport_part(module: str) -> str:
    """The transport's part a module of it belongs to: its medium's subpackage, or the contract."""
    return next((medium for medium in MEDIA if module == medium or module.startswith(medium + ".")), TRANSPORT)


def _inside_transport() -> tuple[dict[tuple[str, str], list[Import]], dict[tuple[str, str], list[Import]]]:
    """The transport's imports of its own modules: (between its parts, between its modules)."""
    parts: dict[tuple[str, str], list[Import]] = defaultdict(list)
    modules: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for imp in IMPORTS:
        if part(imp.source) == TRANSPORT and part(imp.target) == TRANSPORT and imp.source != imp.target:
            modules[imp.source, imp.target].append(imp)
            if transport_part(imp.source) != transport_part(imp.target):
                parts[transport_part(imp.source), transport_part(imp.target)].append(imp)
    return parts, modules


TRANSPORT_EDGES, TRANSPORT_MODULE_EDGES = _inside_transport()


def _cycles(edges: dict[tuple[str, str], list[Import]]) -> list[list[str]]:
    """One shortest cycle through each part that lies on a cycle, each cycle once (as a list of parts, first again
    at the end)."""
    after: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        after[a].add(b)
    cycles: list[list[str]] = []
    seen: set[frozenset[str]] = set()
    for start in sorted(after):
        paths = {start: [start]}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for node in frontier:
                for b in sorted(after[node]):
                    if b == start:
                        found = [*paths[node], start]
                        break
                    if b not in paths:
                        paths[b] = [*paths[node], b]
                        nxt.append(b)
                if found:
                    break
            frontier = nxt
        if found and frozenset(found) not in seen:
            seen.add(frozenset(found))
            cycles.append(found)
    return cycles


def _show(imports: list[Import], most: int = 3) -> str:
    shown = "\n    ".join(str(i) for i in imports[:most])
    more = f"\n    ... and {len(imports) - most} more" if len(imports) > most else ""
    return f"    {shown}{more}"


def test_the_source_is_read() -> None:
    """The package's parts are all found, and so are the imports the layers rest on (a guard against a test that
    passes because it reads nothing)."""
    parts = {part(m) for m in MODULES}
    assert {"ems", "ems.datapath", "ems.backends", "ems.cluster", "ems.kernels", "ems.transport", STAGING} <= parts
    assert ("ems.datapath", "ems.backends") in EDGES and ("ems.backends", "ems.cluster") in EDGES
    # an import inside a function: the client opens the remote pool only when there are pool nodes
    assert any(i.source == "ems.client.api" and i.target == "ems.backends.remote_pool" for i in IMPORTS)


def test_every_kind_of_import_counts() -> None:
    """Imports under `TYPE_CHECKING`, inside functions, relative ones (resolved) and `from ems import <module>`."""
    source = """
from typing import TYPE_CHECKING
import numpy
from ems import errors, Ems
if TYPE_CHECKING:
    from ems.records import JobRecord
def f():
    import ems.cluster.etcd
from . import placement
from ..store import kv_store
"""
    path = ROOT / "ems" / "backends" / "example.py"
    found = sorted(((i.target, i.line) for i in imports_of("ems.backends.example", path, source)), key=lambda t: t[1])
    assert found == [
        ("ems.errors", 4),
        ("ems", 4),
        ("ems.records", 6),
        ("ems.cluster.etcd", 8),
        ("ems.backends", 9),
        ("ems.store.kv_store", 10),
    ]


@pytest.mark.parametrize(("importer", "imported"), sorted(NEVER))
def test_layers_are_one_way(importer: str, imported: str) -> None:
    offending = EDGES.get((importer, imported), [])
    assert not offending, f"{importer} must not import {imported} ({NEVER[importer, imported]}):\n{_show(offending, 20)}"


def test_staging_lies_below_the_data_path_and_the_backends() -> None:
    """The staging pool's module is in neither part, both use it, and it imports neither (nor anything that does)."""
    assert part(STAGING) == STAGING and STAGING in MODULES
    users = {a for (a, b) in EDGES if b == STAGING}
    assert {"ems.datapath", "ems.backends"} <= users, f"staging is used by {sorted(users)}"
    below: set[str] = set()
    todo = [STAGING]
    while todo:  # every part staging reaches through its imports
        node = todo.pop()
        for a, b in EDGES:
            if a == node and b not in below:
                below.add(b)
                todo.append(b)
    layers_above = {"ems.datapath", "ems.backends"}
    offending = [i for (a, b), imps in EDGES.items() if a in below | {STAGING} and b in layers_above for i in imps]
    assert not offending, f"staging reaches a part that uses it:\n{_show(offending, 20)}"


def test_no_cycle_between_parts() -> None:
    """No part imports, through any chain of parts, a part that imports it (type-only imports included)."""
    cycles = _cycles(EDGES)
    if cycles:
        lines = []
        for cycle in cycles:
            lines.append(" -> ".join(cycle))
            lines.extend(_show(EDGES[a, b]) for a, b in itertools.pairwise(cycle))
        pytest.fail("the parts of ems import each other in a circle:\n" + "\n".join(lines))


def test_the_transport_media_are_found() -> None:
    """Every medium's subpackage is read, with the imports the layering rests on (a guard, as above)."""
    assert {transport_part(m) for m in MODULES if part(m) == TRANSPORT} == {TRANSPORT, *MEDIA}
    assert {
        ("ems.transport.ucx", TRANSPORT),
        ("ems.transport.shm", TRANSPORT),
        ("ems.transport.tcp", TRANSPORT),
        ("ems.transport.ucx", "ems.transport.shm"),
        ("ems.transport.ucx", "ems.transport.tcp"),
    } <= set(TRANSPORT_EDGES)


@pytest.mark.parametrize(("importer", "imported"), sorted(TRANSPORT_NEVER))
def test_the_transport_media_are_one_way(importer: str, imported: str) -> None:
    offending = TRANSPORT_EDGES.get((importer, imported), [])
    reason = TRANSPORT_NEVER[importer, imported]
    assert not offending, f"{importer} must not import {imported} ({reason}):\n{_show(offending, 20)}"


def test_no_cycle_inside_the_transport() -> None:
    """No module of the transport imports, through any chain of its modules, one that imports it (type-only imports
    and imports inside functions included)."""
    for edges, what in ((TRANSPORT_EDGES, "parts"), (TRANSPORT_MODULE_EDGES, "modules")):
        cycles = _cycles(edges)
        if cycles:
            lines = []
            for cycle in cycles:
                lines.append(" -> ".join(cycle))
                lines.extend(_show(edges[a, b]) for a, b in itertools.pairwise(cycle))
            pytest.fail(f"the transport's {what} import each other in a circle:\n" + "\n".join(lines))


def test_no_module_is_over_the_line_limit() -> None:
    lines = {path: len(path.read_text(encoding="utf-8").splitlines()) for path in MODULES.values()}
    over = {str(path.relative_to(ROOT)): count for path, count in lines.items() if count > MAX_MODULE_LINES}
    assert len(lines) > 150 and not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_the_cycle_finder_finds_cycles() -> None:
    here = Path(__file__)
    fake = {("a", "b"): [Import("a", "b", here, 1)], ("b", "c"): [Import("b", "c", here, 2)]}
    assert _cycles(fake) == []
    fake["c", "a"] = [Import("c", "a", here, 3)]
    assert _cycles(fake) == [["a", "b", "c", "a"]]

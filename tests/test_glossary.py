"""The glossary's words in the code: one meaning per name (issue 43).

The glossary (the table "word | means | not to be confused with" on the concepts page of the docs) gives each word
of the data path one meaning. This test reads the package's source (`ast`, as tests/test_layers.py does) and checks
that the names that carry those words keep to them:

* **call**: an engine-side `save`, `load` or `exists` (`SlotCall`, `TokenCall`, `PoolCall`: the call as the pool sees
  it, `NodeShare`: one node's share of it); a class named for a call never lives in the transport, which knows only
  requests.
* **request**: one message exchange with one pool node (`transport/`: `PutRequest`, `RequestLimits`); the engine's own
  inference request (vLLM's `Request`, keyed by `req_id`) is the **engine request**, named only in the engine
  integrations. A class named for a request lives in one of those two places.
* **copier**: the one worker that runs a plan's moves (`ems.datapath.copier`): no other class is a copier.
* **hold**: a lease or pin on a stored key: what a store keeps (`ems.store.index.Holds`) and what an EXISTS asks for on
  the wire (`ems.transport.exists_holds`), nowhere else.
* **routing**: which nodes a key goes to: the rendezvous math (`ems.cluster.rendezvous`) and the node router that
  applies it to a call (`ems.backends.node_router`); no class is a "route".
* **job**: one call's data path (`ems.datapath.jobs`, recorded in `ems.records`).
* No two modules share a name that is one of these words (a second `routing.py` or `holds.py` is a second meaning).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"ems": ROOT / "ems", "ems.kernels": ROOT / "kernels", "ems.transport": ROOT / "transport"}
DOCS = ROOT / "docs"

# a class whose name matches -> the modules (prefixes) it may live in
CLASS_HOMES: dict[str, tuple[str, ...]] = {
    r"Request": ("ems.transport", "ems.integrations"),
    r"Copier$": ("ems.datapath.copier",),
    r"^Holds?$|^Hold[A-Z]": ("ems.store.index", "ems.transport.exists_holds"),
    r"Job(?!Context)": ("ems.datapath.jobs", "ems.records"),
    r"JobContext": ("ems.datapath.jobs",),
    r"Route(?!r)": (),
}
CLASS_NEVER_IN: dict[str, tuple[str, ...]] = {r"Call(s|Shape)?$": ("ems.transport",)}
GLOSSARY_MODULE_WORDS = {"routing", "holds", "copier", "calls", "jobs", "requests", "chunks", "values", "lookup", "lookups"}
GLOSSARY_WORDS = ("call", "job", "chunk", "request", "value", "copier", "hold", "routing")


def _modules() -> dict[str, Path]:
    found = {}
    for package, root in SOURCES.items():
        for path in root.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _classes() -> list[tuple[str, str, Path, int]]:
    out = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                out.append((node.name.lstrip("_"), module, path, node.lineno))
    return out


def test_classes_named_for_a_glossary_word_live_where_that_word_means_it():
    wrong = []
    for name, module, path, line in _classes():
        for pattern, homes in CLASS_HOMES.items():
            if re.search(pattern, name) and not any(module == h or module.startswith(h + ".") for h in homes):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: class {name} ({pattern!r} lives in {homes or 'no class'})")
        for pattern, never in CLASS_NEVER_IN.items():
            if re.search(pattern, name) and any(module == n or module.startswith(n + ".") for n in never):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: class {name} in {module} ({pattern!r} never in {never})")
    assert not wrong, "names off the glossary:\n" + "\n".join(wrong)


def test_no_two_modules_share_a_glossary_word_for_a_name():
    by_name = defaultdict(list)
    for module in _modules():
        by_name[module.rsplit(".", 1)[-1]].append(module)
    twice = {name: mods for name, mods in by_name.items() if name in GLOSSARY_MODULE_WORDS and len(mods) > 1}
    assert not twice, f"one word, two modules (two meanings): {twice}"


def test_the_glossary_defines_each_word_once():
    tables = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        if "| word | means |" in text:
            tables.append((page, text))
    assert len(tables) == 1, f"one glossary in the docs, found {[str(p.relative_to(ROOT)) for p, _ in tables]}"
    page, text = tables[0]
    rows = re.findall(r"^\| \*\*([a-z ]+)\*\* \|", text, re.MULTILINE)
    assert len(rows) == len(set(rows)), f"a word defined twice in {page}: {rows}"
    missing = [w for w in GLOSSARY_WORDS if w not in rows]
    assert not missing, f"{page.relative_to(ROOT)}'s glossary does not define {missing}"

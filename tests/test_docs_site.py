"""The docs site: its generated parts against the code and the results, every page's size, and the build itself.

* Every page (hand-written, the generated archive's, and each page as the build expands its markers) is at most
  `MAX_PAGE_CHARS` characters.
* The configuration reference lists every field of `Settings` and every key of the vLLM connector, with the
  connector's defaults as `ConnectorConfig.from_extra({})` resolves them; the generator refuses a field without an
  entry.
* The benchmarks page shows every figure of every results file, with its anchor and ratio, and each plot it names
  exists; the archive holds every section of perf/RESULTS.md exactly once.
* Every warning the package logs is on the warnings or troubleshooting page (its message up to 40 characters, with
  `…` for what is filled in), so a new warning comes with what it means and what to do.
* `mkdocs build --strict` passes (skipped, saying why, where MkDocs is not installed: `pip install -e '.[docs]'`).
"""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))
import gen_pages  # noqa: E402

MAX_PAGE_CHARS = 15_000


def _expanded(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    return gen_pages.on_page_markdown(text, None, None, None)


def test_no_page_is_over_the_size_limit():
    pages = {p.relative_to(ROOT).as_posix(): _expanded(p) for p in (ROOT / "docs").rglob("*.md")}
    pages.update({p.name: p.text for p in gen_pages.archive_pages()})
    pages["benchmarks/archive/index.md"] = gen_pages.archive_index(gen_pages.archive_pages())
    pages["README.md"] = (ROOT / "README.md").read_text(encoding="utf-8")
    over = {name: len(text) for name, text in pages.items() if len(text) > MAX_PAGE_CHARS}
    assert len(pages) > 40 and not over, f"pages over {MAX_PAGE_CHARS} characters: {over}"


def test_the_markers_are_expanded_where_they_stand():
    for path in (ROOT / "docs").rglob("*.md"):
        assert not any(m in _expanded(path) for m in gen_pages.MARKERS), path


def test_the_configuration_reference_lists_every_setting():
    rows = gen_pages.settings_rows()
    names = [r[0] for r in rows]
    assert names[: len(gen_pages.setting_names())] == gen_pages.setting_names()
    assert [n.strip("`()") for n in names[len(gen_pages.setting_names()) :]] == list(gen_pages.OTHER_READERS)
    for name, type_text, variable, default, meaning in rows:
        assert type_text and variable and default and meaning, name


def test_the_generator_refuses_a_setting_without_an_entry(monkeypatch):
    entries = dict(gen_pages.SETTINGS)
    del entries["pool_replicas"]
    monkeypatch.setattr(gen_pages, "SETTINGS", entries)
    with pytest.raises(ValueError, match="pool_replicas"):
        gen_pages.settings_rows()
    keys = dict(gen_pages.CONNECTOR_KEYS)
    del keys["lease_ms"]
    monkeypatch.setattr(gen_pages, "CONNECTOR_KEYS", keys)
    with pytest.raises(ValueError, match="lease_ms"):
        gen_pages.connector_rows()


def test_the_connector_table_lists_every_key_with_its_default(monkeypatch):
    from ems.integrations.connector_config import EMS_SETTINGS, KEYS, ConnectorConfig

    for name in ("EMS_POOL_NODES", "EMS_MAX_INFLIGHT", "EMS_LOCAL_POOL_DIR", "EMS_ACCESS_KEY", "EMS_POOL_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    rows = gen_pages.connector_rows()
    named = {k.strip() for row in rows for k in row[0].split(",")}
    assert named == set(KEYS), f"connector keys missing {set(KEYS) - named}, extra {named - set(KEYS)}"
    resolved = ConnectorConfig.from_extra({})
    checked = 0
    for key, _type, default, _meaning in rows:
        if key not in {f.name for f in dataclasses.fields(ConnectorConfig)} or key in EMS_SETTINGS:
            continue
        value = getattr(resolved, key)
        value = getattr(value, "value", value)
        if default.startswith("`") and default.endswith("`") and value is not None:
            quoted = default.strip("`")
            assert quoted == (str(value).lower() if isinstance(value, bool) else str(value)), (key, default, value)
            checked += 1
    assert checked >= 12


def test_the_benchmarks_page_shows_every_recorded_figure():
    results = gen_pages._perf_results()
    index = gen_pages.results_markdown()
    pages = gen_pages.result_pages()
    page = "\n".join(pages.values())
    runs = results.load_all()
    assert runs
    for run in runs:
        assert f"(results/{run.bench}.md)" in index and f"benchmarks/results/{run.bench}.md" in pages
        assert f"`{run.command}`" in page
        for figure in run.figures:
            assert f"| {figure.name} |" in page, figure.name
            if figure.anchor is not None:
                assert f"{figure.anchor}: " in page and f"{figure.ratio:.2f}x" in page, figure.name
    for site_path, path in gen_pages.plots().items():
        assert path.exists() and f"(../plots/{path.name})" in page, site_path


def test_the_archive_holds_every_section_of_the_results_log():
    text = (ROOT / "perf" / "RESULTS.md").read_text(encoding="utf-8")
    headings = [h[3:].strip() for h in re.findall(r"(?m)^## .*$", text)]
    pages = gen_pages.archive_pages()
    archived = [h for p in pages for h in p.sections]
    assert archived == headings
    assert sum(len(p.text) for p in pages) >= len(text) - len(text.split("\n## ", 1)[0])
    index = gen_pages.archive_index(pages)
    assert all(f"({Path(p.name).name})" in index for p in pages)


def test_the_site_builds_with_no_warnings(tmp_path):
    pytest.importorskip("mkdocs", reason="MkDocs is not installed: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="the Material theme is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed: pip install -e '.[docs]'")
    site = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={"NO_MKDOCS_2_WARNING": "1", **__import__("os").environ},
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "WARNING" not in out.stderr, out.stderr[-4000:]
    assert "EMS_POOL_REPLICAS" in (site / "reference" / "configuration" / "index.html").read_text()
    assert "producer_wait_ms" in (site / "reference" / "vllm-connector" / "index.html").read_text()
    assert "ContextCaching" in (site / "reference" / "api" / "index.html").read_text()
    assert (site / "benchmarks" / "archive" / "01" / "index.html").exists()
    assert "gen:results" not in (site / "benchmarks" / "index.html").read_text()


def _message_start(node: ast.expr) -> str | None:
    """The literal text a logged message starts with (a format string, a concatenation's left side, an f-string's
    leading parts), placeholders written as the docs write them: `…`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp):
        return _message_start(node.left)
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "%s" for v in node.values)
    return None


def _logged_warnings() -> list[tuple[str, str]]:
    found = []
    for top in ("ems", "kernels", "transport"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "warning":
                    start = _message_start(node.args[0]) if node.args else None
                    if start is None:
                        raise AssertionError(f"{path}: a warning whose message is not a literal: add a case here")
                    text = re.sub(r"%[-#0-9.]*[sdrfx]", "…", start)[:40].rstrip(" :;,(…")
                    found.append((path.relative_to(ROOT).as_posix(), text))
    return found


def test_every_warning_the_package_logs_is_explained():
    pages = (ROOT / "docs" / "warnings.md").read_text() + (ROOT / "docs" / "troubleshooting.md").read_text()
    logged = _logged_warnings()
    missing = sorted({f"{path}: {text!r}" for path, text in logged if text not in pages})
    assert len(logged) > 40 and not missing, f"warnings the docs do not explain (docs/warnings.md): {missing}"

"""The docs against the code, wherever they quote names: settings, environment variables, formats, links.

* Every field of `ems.settings.Settings` is a row of the configuration reference's Settings table (generated at build
  time by docs/gen_pages.py, which these tests call), and every row is a field or one of the variables read outside
  `Settings` (`OTHER_VARIABLES`: a pool node's, the vLLM connector's).
* Each row's environment variable is the one the code reads for it (set it, resolve or read, see the value).
* Every `EMS_*` environment variable the package reads is a row of that table, and every `EMS_*` name the docs mention
  is read somewhere (package, tests or benchmarks) or is an error code.
* The defaults the table quotes are the code's.
* The value format and wire protocol versions the docs quote are the code's, and docs/pool-nodes.md's request metric
  names every `op` label a node counts (docs/reference/metrics.md).
* Links to files in the repository resolve.
* Every module and folder the architecture pages name exists (paths, `ems.` dotted names, the diagram's paths), and
  every package folder of the source tree and every benchmark script is named there.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ems.config import POOL_SETTINGS, EmsConfig, parse_size
from ems.errors import EmsErrorCode
from ems.kernels.base import KernelBackend
from ems.settings import (
    Settings,
    access_key_from_environment,
    local_pool_dir_from_environment,
    pool_keys_from_environment,
    resolve_settings,
)
from ems.store.value_format import VERSION
from ems.transport import protocol
from ems.transport.ucx.config import Submission, UcxSettings

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))
import gen_pages  # noqa: E402  (docs/gen_pages.py: the generated parts of the docs site)

README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "reference" / "configuration.md"  # its tables: gen_pages.settings_table() and co
CONCEPTS = ROOT / "docs" / "concepts"
# the module map: the data path, the modules, the copy backends, and the benchmarks' list
ARCHITECTURE_PAGES = [
    CONCEPTS / "architecture.md",
    CONCEPTS / "modules.md",
    CONCEPTS / "integrations.md",
    CONCEPTS / "copy-backends.md",
    ROOT / "docs" / "benchmarks" / "reading.md",
]
METRICS = ROOT / "docs" / "reference" / "metrics.md"
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md"))]
PACKAGE = [ROOT / "ems", ROOT / "kernels", ROOT / "transport"]
ENV_NAME = re.compile(r"(?:EMS_[A-Z0-9_]*[A-Z0-9]|ENABLE_CC_PROFILING)")

# A value other than the default for each setting, as its environment variable is written, and what it resolves to.
# A new setting needs a line here: the test then checks that its variable really sets it.
ENV_VALUES: dict[str, tuple[str, object]] = {
    "pool_nodes": ("10.0.0.1:7700,10.0.0.2:7700", ("10.0.0.1:7700", "10.0.0.2:7700")),
    "pool_capacity": ("3MiB", 3 << 20),
    "pool_prefault": ("1MiB", 1 << 20),
    "pool_prefault_ahead": ("2MiB", 2 << 20),
    "read_cache_capacity": ("5MiB", 5 << 20),
    "staging_capacity": ("7MiB", 7 << 20),
    "max_inflight": ("3", 3),
    "kernel_backend": ("memcpy", KernelBackend.MEMCPY),
    "connect_timeout_ms": ("1234", 1234),
    "device": ("cpu", "cpu"),
    "pool_etcd": ("http://127.0.0.1:1", "http://127.0.0.1:1"),
    "pool_cluster": ("docs-test", "docs-test"),
    "pool_replicas": ("2", 2),
    "pool_hedge": ("off", False),
    "chunk_bytes": ("4MiB", 4 << 20),
    "profiling": ("1", True),
    "sdk_log_dir": ("/tmp/ems-docs-test", "/tmp/ems-docs-test"),
    "pool_shm": ("off", "off"),
    "host_copy": ("off", "off"),
    "cache_dir": ("/tmp/ems-docs-test-cache", "/tmp/ems-docs-test-cache"),
    "ucx.progress_mode": ("loop", "loop"),
    "ucx.python_future": ("0", False),
    "ucx.notifier": ("ucxx", "ucxx"),
    "ucx.client_submit": ("direct", Submission.DIRECT),
    "pool_backend": ("mooncake", "mooncake"),
    "mooncake_master": ("10.0.0.9:50051", "10.0.0.9:50051"),
    "mooncake_metadata": ("http://10.0.0.9:8080/metadata", "http://10.0.0.9:8080/metadata"),
    "mooncake_protocol": ("rdma", "rdma"),
    "mooncake_devices": ("mlx5_0", "mlx5_0"),
    "mooncake_hostname": ("10.0.0.8", "10.0.0.8"),
    "mooncake_buffer": ("32MiB", 32 << 20),
    "mooncake_segment": ("1GiB", 1 << 30),
}
# The variables read outside `Settings` (not by `Ems.init`), rows of the table too: each one's reader in ems.settings,
# and a value it is read as.
OTHER_VARIABLES: dict[str, tuple[Callable[[], object], str]] = {
    "EMS_POOL_KEYS": (pool_keys_from_environment, "team-a:" + "k" * 32),
    "EMS_ACCESS_KEY": (access_key_from_environment, "K" * 32),
    "EMS_LOCAL_POOL_DIR": (local_pool_dir_from_environment, "/tmp/ems-docs-test-local-pool"),
}
# The mooncake_* keywords resolve into Settings.mooncake, with pool_backend="mooncake" (which needs a master).
MOONCAKE_ENV = {"EMS_POOL_BACKEND": "mooncake", "EMS_MOONCAKE_MASTER": "127.0.0.1:50051"}
MOONCAKE_FIELDS = {
    "mooncake_master": "master",
    "mooncake_metadata": "metadata",
    "mooncake_protocol": "protocol",
    "mooncake_devices": "devices",
    "mooncake_hostname": "hostname",
    "mooncake_buffer": "buffer_bytes",
    "mooncake_segment": "segment_bytes",
}


def _table(text: str, heading: str) -> list[list[str]]:
    """The rows (cells, backticks removed) of the first table under `heading`."""
    lines = text[text.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = lines[start:end]
    cells = (re.split(r"(?<!\\)\|", row.strip().strip("|")) for row in rows[2:])  # `\|` is a pipe inside a cell
    body = [[cell.strip().replace("`", "") for cell in row] for row in cells]
    return body


def _variable(row: list[str]) -> str:
    """A row's environment variable (columns: setting, type, environment variable, default, meaning)."""
    return ENV_NAME.search(row[2]).group(0)  # type: ignore[union-attr]


def _settings_table() -> str:
    """The configuration reference's Settings table, as the build generates it."""
    return "## Settings\n\n" + gen_pages.settings_table() + "\n"


def _setting_table_rows() -> list[list[str]]:
    """The rows of the Settings table that are settings (not `OTHER_VARIABLES`)."""
    rows = _table(_settings_table(), "## Settings")
    return [row for row in rows if _variable(row) not in OTHER_VARIABLES]


def _settings_rows() -> dict[str, str]:
    """docs/configuration.md's Settings table: setting -> its environment variable."""
    return {row[0]: _variable(row) for row in _setting_table_rows()}


def _setting_names() -> set[str]:
    names: set[str] = set()
    for f in dataclasses.fields(Settings):
        if f.name == "ucx":
            names.update(f"ucx.{u.name}" for u in dataclasses.fields(UcxSettings))
        elif f.name == "mooncake":
            names.update(n for n in POOL_SETTINGS if n.startswith("mooncake_"))
        else:
            names.add(f.name)
    return names


def _resolved(settings: Settings, setting: str) -> object:
    """The value a README row names, in resolved `Settings`."""
    path = f"mooncake.{MOONCAKE_FIELDS[setting]}" if setting in MOONCAKE_FIELDS else setting
    value: object = settings
    for part in path.split("."):
        value = getattr(value, part)
    return getattr(value, "value", value)  # enums by their value


def _package_env_names() -> set[str]:
    """Every EMS_* / ENABLE_CC_PROFILING string constant in the package's code (docstrings and comments aside)."""
    codes = {c.name for c in EmsErrorCode}
    found: set[str] = set()
    for folder in PACKAGE:
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.fullmatch(node.value):
                    found.add(node.value)
    return found - codes


def test_every_setting_is_a_row_of_the_readme_table_and_back():
    rows = set(_settings_rows())
    code = _setting_names()
    assert code - rows == set(), f"settings missing from docs/configuration.md's table: {sorted(code - rows)}"
    assert rows - code == set(), f"table rows that are no setting: {sorted(rows - code)}"
    assert set(ENV_VALUES) == code, f"give tests/test_docs.py ENV_VALUES a value for {sorted(code ^ set(ENV_VALUES))}"
    assert set(MOONCAKE_FIELDS) == {n for n in code if n.startswith("mooncake_")}


@pytest.mark.parametrize("setting", sorted(ENV_VALUES))
def test_each_row_names_the_variable_the_code_reads(setting, monkeypatch):
    variable = _settings_rows()[setting]
    text, expected = ENV_VALUES[setting]
    if setting in MOONCAKE_FIELDS or setting == "pool_backend":
        for name, value in MOONCAKE_ENV.items():
            monkeypatch.setenv(name, value)
    monkeypatch.setenv(variable, text)
    resolved = _resolved(resolve_settings(EmsConfig()), setting)
    assert resolved == getattr(expected, "value", expected), f"{variable}={text} gave {setting}={resolved!r}"


def test_the_reference_page_holds_the_generated_tables():
    assert "<!-- gen:settings -->" in CONFIGURATION.read_text()
    assert "<!-- gen:connector -->" in (CONFIGURATION.parent / "vllm-connector.md").read_text()


def test_every_variable_the_package_reads_is_a_row_of_the_table():
    rows = {_variable(row) for row in _table(_settings_table(), "## Settings")}
    missing = sorted(_package_env_names() - rows)
    assert not missing, f"environment variables read by the package but no row of docs/configuration.md's table: {missing}"


def test_the_rows_beyond_the_settings_are_the_variables_read_elsewhere(monkeypatch):
    rows = {_variable(row) for row in _table(_settings_table(), "## Settings")}
    assert set(OTHER_VARIABLES) <= rows, f"rows missing from docs/configuration.md: {sorted(set(OTHER_VARIABLES) - rows)}"
    for variable, (read, value) in OTHER_VARIABLES.items():
        monkeypatch.setenv(variable, value)
        assert read() == value, f"{variable}={value} was read as {read()!r}"


def test_every_variable_the_docs_name_exists():
    codes = {c.name for c in EmsErrorCode}
    read_anywhere = set()
    for folder in [*PACKAGE, ROOT / "tests", ROOT / "perf"]:
        for path in folder.rglob("*.py"):
            read_anywhere.update(re.findall(r"[\"'](" + ENV_NAME.pattern + r")[\"']", path.read_text()))
    unknown = {
        (doc.name, match.group(1))
        for doc, text in [*((d, d.read_text()) for d in DOCS), (CONFIGURATION, _settings_table() + gen_pages.connector_table())]
        for match in re.finditer(r"(EMS_[A-Z0-9_]+|ENABLE_CC_PROFILING)(\*?)", text)
        if match.group(1) not in codes | read_anywhere and not match.group(2)  # "EMS_UCX_*": a family
    }
    assert not unknown, f"environment variables the docs name but nothing reads: {sorted(unknown)}"


def test_the_request_metric_row_names_every_op_label():
    """docs/reference/metrics.md's `ems_pool_requests_total{op,status}` row quotes every `op` a node counts requests
    under."""
    from ems.transport.shm import metric_name

    row = next(line for line in METRICS.read_text().splitlines() if line.startswith("| `ems_pool_requests_total{op"))
    handshake = {protocol.Op.HELLO, protocol.Op.CHALLENGE, protocol.Op.AUTH}  # answered before requests are counted
    labels = {metric_name(op) for op in protocol.Op if op not in handshake}
    missing = sorted(label for label in labels if f"`{label}`" not in row)
    assert len(labels) >= 5 and not missing, f"docs/reference/metrics.md's requests_total row lacks op labels {missing}"


def test_quoted_versions_are_the_codes():
    for doc in DOCS:
        text = doc.read_text()
        for quoted in re.findall(r"[Vv]alue format (?:\(?version |version )(\d+)|format version (\d+)", text):
            number = int(next(q for q in quoted if q))
            assert number == VERSION, f"{doc.name} quotes value format version {number}; the code writes {VERSION}"
        for quoted in re.findall(r"[Pp]rotocol \(?version (\d+)", text):
            assert int(quoted) == protocol.VERSION, (
                f"{doc.name} quotes wire protocol version {quoted}; the code speaks {protocol.VERSION}"
            )


def test_links_to_repository_files_resolve():
    """Every relative link of the README and the docs resolves to a file, or to a page the site's build generates."""
    generated = (
        {ROOT / "docs" / "benchmarks" / "archive" / "index.md"}
        | {ROOT / "docs" / p.name for p in gen_pages.archive_pages()}
        | {ROOT / "docs" / page for page in gen_pages.result_pages()}  # a recorded benchmark's page
    )
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+://|mailto:|#", target):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.exists() and path not in generated:
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, f"broken links: {broken}"


def test_the_table_quotes_the_defaults(monkeypatch):
    rows = _setting_table_rows()
    for row in rows:
        monkeypatch.delenv(_settings_rows()[row[0]], raising=False)
    resolved = resolve_settings(EmsConfig())
    for name, value in MOONCAKE_ENV.items():
        monkeypatch.setenv(name, value)
    with_mooncake = resolve_settings(EmsConfig())
    checked = 0
    for row in rows:
        if row[0] == "mooncake_master":
            continue  # no default: required with the backend
        default = _resolved(with_mooncake if row[0] in MOONCAKE_FIELDS else resolved, row[0])
        quoted = row[3]
        if re.fullmatch(r"\d+(?:[KMGT]iB)?", quoted):
            assert parse_size(row[0], quoted) == default, (
                f"the configuration reference: {row[0]} default {quoted}, the code: {default!r}"
            )
            checked += 1
        elif isinstance(default, str) and quoted.split()[0] in {"auto", "default", "ems", "tcp", "P2PHANDSHAKE", "127.0.0.1"}:
            assert quoted.split()[0] == default, (row[0], quoted, default)
            checked += 1
    assert checked >= 10


def _repository_path(name: str) -> Path | None:
    """The file or folder a repository path names (`ems/store/index.py`, `ems/pool/disk/`, or `transport/inprocess`
    for its module); None if there is none."""
    path = ROOT / name.rstrip("/")
    return next((c for c in (path, path.with_name(path.name + ".py")) if c.exists()), None)


def _dotted_name_exists(name: str) -> bool:
    """Whether a dotted name (`ems.pool`, `ems.backends.base.PoolBackend`) is a module, or a name its longest
    module prefix defines (a class, a function or an assignment at its top level)."""
    parts = name.split(".")[1:]
    if parts and parts[0] in ("kernels", "transport"):  # installed as ems.kernels, ems.transport
        base, parts = ROOT / parts[0], parts[1:]
    else:
        base = ROOT / "ems"
    for cut in range(len(parts), -1, -1):
        folder = base.joinpath(*parts[:cut])
        module = folder / "__init__.py" if folder.is_dir() else folder.with_suffix(".py")
        if module.exists():
            rest = parts[cut:]
            if not rest:
                return True
            defined = rf"^(?:class|def) {rest[0]}\b|^{rest[0]}\b[^=\n]*="
            return len(rest) == 1 and re.search(defined, module.read_text(), re.M) is not None
    return False


def _architecture_text() -> str:
    return "\n".join(page.read_text() for page in ARCHITECTURE_PAGES)


def test_every_module_the_architecture_page_names_exists():
    text = _architecture_text()
    diagram = "\n".join(re.findall(r"```\n(.*?)```", text, flags=re.S))
    paths = set(re.findall(r"`((?:ems|kernels|transport)/[\w./-]*)`", text))
    paths |= set(re.findall(r"\b((?:ems|kernels|transport)/[\w/]*\w/?)", diagram))
    dotted = set(re.findall(r"`(ems(?:\.\w+)+)`", text))
    missing = [p for p in sorted(paths) if _repository_path(p) is None] + [
        d for d in sorted(dotted) if not _dotted_name_exists(d)
    ]
    assert len(paths) > 20 and not missing, f"the architecture pages name what the code does not have: {missing}"


def test_every_package_folder_is_named_on_the_architecture_page():
    text = _architecture_text()
    folders = sorted(init.parent.relative_to(ROOT).as_posix() + "/" for top in PACKAGE for init in top.rglob("__init__.py"))
    unnamed = [folder for folder in folders if f"`{folder}`" not in text]
    assert len(folders) > 10 and not unnamed, f"package folders the architecture pages do not name: {unnamed}"


def test_every_benchmark_is_named_on_the_architecture_page():
    text = _architecture_text()
    scripts = sorted(p.name for p in (ROOT / "perf").glob("*.py") if p.name != "benchlib.py")
    unnamed = [name for name in scripts if f"`{name}`" not in text]
    assert len(scripts) > 10 and not unnamed, f"benchmarks the architecture pages do not name: {unnamed}"

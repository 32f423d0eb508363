"""One home for settings: `ems/settings.py` is the only module of the package that reads or writes the environment,
but for the few listed here, each with the reason it cannot go through `ems.settings`.

Found from the code (every `os.environ` / `os.getenv` / `os.putenv` use, as the AST has it), so a new reading
anywhere else fails here until it moves into `ems.settings` or is listed with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = [ROOT / "ems", ROOT / "kernels", ROOT / "transport"]
HOME = ROOT / "ems" / "settings.py"

# (file relative to the repository root) -> why it reads or writes the environment itself
ALLOWED = {
    # UCX reads its own UCX_* options from the environment when its library loads, so their defaults are written
    # there just before `import ucxx`; its EMS_UCX_* knobs are parsed by `UcxSettings.from_env`, which
    # `ems.settings` calls (the transport may not import `ems.settings`: tests/transport/test_layering.py).
    "transport/ucx/config.py": "UCX's own variables, and the transport's settings parser ems.settings calls",
    # A node listening on one address restricts UCX's data connections to that interface: UCX_NET_DEVICES, UCX's
    # own variable, set before UCX starts (an operator's value wins).
    "ems/pool/__main__.py": "UCX_NET_DEVICES, UCX's own variable",
    # CC names the C compiler by the build convention every toolchain follows, not a setting of this package.
    "kernels/host_build.py": "CC, the C compiler",
    # TRITON_INTERPRET is Triton's own switch; the backend only asks whether Triton will interpret.
    "kernels/triton_backend.py": "TRITON_INTERPRET, Triton's own variable",
    # The local pool node is started with the engine's environment minus the engine's EMS_POOL_KEYS (the node's
    # keys are its key file's): a copy of the environment for a child process, not a setting read.
    "ems/integrations/local_pool.py": "the child node's environment",
    # PYTHONHASHSEED is Python's own variable, which vLLM's prefix hashing reads: the connector warns when the engine's
    # blocks can never be shared (and records its seed's digest as a namespace part); not a setting of this package.
    "ems/integrations/vllm/engine_checks.py": "PYTHONHASHSEED, Python's own variable vLLM's hashing reads",
}


def _environment_uses(path: Path) -> list[int]:
    """Lines of `path` that touch os.environ, os.getenv or os.putenv."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in {"environ", "getenv", "putenv", "unsetenv"}:
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and any(alias.name in {"environ", "getenv", "putenv"} for alias in node.names)
        ):
            lines.append(node.lineno)
    return lines


def test_only_the_config_module_reads_the_environment() -> None:
    found = {
        str(path.relative_to(ROOT)): uses
        for folder in PACKAGE
        for path in sorted(folder.rglob("*.py"))
        if path != HOME and (uses := _environment_uses(path))
    }
    unexpected = {path: lines for path, lines in found.items() if path not in ALLOWED}
    assert not unexpected, f"environment read outside ems/settings.py (move it there, or list it with its reason): {unexpected}"


def test_every_allowed_reader_still_reads_it() -> None:
    """The list keeps no stale entry: each module it names still touches the environment."""
    stale = [path for path in ALLOWED if not _environment_uses(ROOT / path)]
    assert not stale, f"listed but no longer reading the environment: {stale}"


def test_the_config_module_reads_it() -> None:
    assert _environment_uses(HOME), "ems/settings.py should be where settings are read"

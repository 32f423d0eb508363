"""Optional features and the extra that installs each: one clear error when a feature is used without it.

Contract: `require(module, extra, feature)` returns when `module` is installed and raises `MissingExtra` (an
ImportError) otherwise, whose message names the feature and the command that installs it, e.g.
"ems-pool --metrics needs prometheus_client: install 'ems-kvcache[metrics]'". It looks the module up without
importing it (importing ucxx loads UCX, which must not happen before `ucx.config.init_ucx` set its environment).
Command-line tools turn the error into a message and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import importlib.util

DISTRIBUTION = "ems-kvcache"


class MissingExtra(ImportError):
    """An optional feature was used without the package that provides it."""


def install_hint(extra: str) -> str:
    return f"install '{DISTRIBUTION}[{extra}]'"


def require(module: str, extra: str, feature: str) -> None:
    """Raise `MissingExtra` naming `feature` and `extra` when `module` is not installed."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        found = False
    if not found:
        raise MissingExtra(f"{feature} needs {module}: {install_hint(extra)}")

"""A pool node or engine used without an optional feature's extra, or with a bad node setting: a message naming
the fix and a non-zero exit, never a traceback.

The package is hidden from the child process by a sitecustomize module that marks it absent in sys.modules (its
import then raises ImportError and its lookup finds nothing, as for a package that is not installed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ems import CcConfig, Ems, EmsConfig, EmsException
from ems.extras import MissingExtra, require


def _hiding(tmp_path, *modules: str) -> dict:
    (tmp_path / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def _pool(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ems.pool", *args], env=env, capture_output=True, text=True, timeout=60)


def test_metrics_without_prometheus_client(tmp_path):
    out = _pool(_hiding(tmp_path, "prometheus_client"), "--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0")
    assert out.returncode != 0
    assert "install 'ems-kvcache[metrics]'" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_status_without_prometheus_client(tmp_path):
    out = _pool(_hiding(tmp_path, "prometheus_client"), "status", "--nodes", "127.0.0.1:1")
    assert out.returncode != 0
    assert "install 'ems-kvcache[metrics]'" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_node_without_ucxx(tmp_path):
    out = _pool(_hiding(tmp_path, "ucxx"), "--listen", "127.0.0.1:0")
    assert out.returncode != 0
    assert "install 'ems-kvcache[ucx]'" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_pool_nodes_without_ucxx(monkeypatch, clean_ems):
    monkeypatch.setitem(sys.modules, "ucxx", None)  # `import ucxx` raises ImportError, as when it is absent
    with pytest.raises(EmsException, match=r"install 'ems-kvcache\[ucx\]'"):
        Ems.init(EmsConfig(cc_config=CcConfig(0, 0, "m"), pool_nodes=["127.0.0.1:1"]))


def test_require_names_the_feature_and_the_extra():
    require("json", "none", "anything")
    with pytest.raises(MissingExtra, match=r"the feature needs no_such_module: install 'ems-kvcache\[x\]'"):
        require("no_such_module", "x", "the feature")


def test_a_node_with_a_bad_ucx_setting_exits_with_a_message():
    """The node reads its EMS_UCX_* settings once, at start: a bad one is an option error (exit 2), not a traceback."""
    out = _pool({**os.environ, "EMS_UCX_PROGRESS_MODE": "bogus"}, "--listen", "127.0.0.1:0")
    assert out.returncode == 2 and "EMS_UCX_PROGRESS_MODE must be one of" in out.stderr and "Traceback" not in out.stderr

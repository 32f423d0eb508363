#!/usr/bin/env bash
# Run the kernel tests (tests/kernels) a second time under triton-ascend 3.2.0's interpreter.
#
# triton-ascend installs as the `triton` module and cannot share a venv with upstream triton, so it lives in its
# own venv. CI creates it once with (from the repository root):
#   python -m venv V && V/bin/pip install torch==2.13.0 triton-ascend==3.2.0 'numpy<2.4' pybind11 pytest hypothesis xxhash tqdm && V/bin/pip install --no-deps -e .
# (its interpreter needs numpy<2.4 and pybind11). This script assumes that venv already exists.
#
# Usage: tests/kernels/run_ascend_interpreter.sh [PYTHON] [extra pytest args...]
#   PYTHON defaults to $EMS_ASCEND_PYTHON, else /tmp/venv-ascend/bin/python.
set -euo pipefail

PY="${EMS_ASCEND_PYTHON:-/tmp/venv-ascend/bin/python}"
if [[ $# -gt 0 && "$1" != -* ]]; then
    PY="$1"
    shift
fi
if [[ ! -x "$PY" ]]; then
    echo "error: no python at '$PY' (pass the triton-ascend venv's python, or set EMS_ASCEND_PYTHON)" >&2
    exit 2
fi
"$PY" - <<'PYEOF'
import importlib.metadata as md
try:
    print("triton-ascend", md.version("triton-ascend"))
except md.PackageNotFoundError:
    raise SystemExit("error: this python has no triton-ascend installed")
PYEOF

cd "$(dirname "$0")/../.."
export TRITON_INTERPRET=1
# numpy deprecation warnings come from triton-ascend's interpreter, not from ems
exec "$PY" -m pytest tests/kernels -q -p no:cacheprovider -W ignore::DeprecationWarning "$@"

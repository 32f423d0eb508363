"""The compiled host copy's build: `host_copy.c` compiled with the host's C compiler into a shared library, once per
source and compiler (`ems.kernels.host_copy` loads it).

Contract: `build_library()` is the path of the library for this source and compiler, compiled now unless the cache
(`EMS_CACHE_DIR`, default `$XDG_CACHE_HOME/ems`, else `~/.cache/ems`) already has it; written under a temporary name
and renamed into place, so concurrent processes (an engine and its node) never load half a file. Raises `OSError` or
`subprocess.SubprocessError` where it cannot be built.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sysconfig
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("host_copy.c")
_FLAGS = ["-O2", "-fPIC", "-shared"]
_BUILD_TIMEOUT_S = 120.0


def _compiler() -> list[str]:
    configured = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(str(configured))


def build_library() -> Path:
    """The library for this source and compiler, compiled now unless the cache already has it."""
    compiler = _compiler()
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + repr((compiler, _FLAGS)).encode()).hexdigest()[:16]
    from ems.settings import host_copy_settings  # the one home of the package's settings (torch-free)

    directory = Path(host_copy_settings().cache_dir)
    target = directory / f"host_copy-{digest}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=target.name + ".", dir=directory)
    os.close(fd)
    try:
        subprocess.run(
            [*compiler, *_FLAGS, "-o", partial, str(SOURCE)],
            check=True,
            capture_output=True,
            timeout=_BUILD_TIMEOUT_S,
        )
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target

"""tests/integrations/sglang: SGLang's own loader and host pools against real pool nodes (tests/pool's fixtures).
The modules that need SGLang skip, saying so, where it is not installed (CI installs it in a venv of its own)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "pool"))
sys.path.insert(0, str(HERE))

from pool_testlib import pool_nodes  # noqa: E402, F401

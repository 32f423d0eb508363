"""`EmsConnector` whose per-step record (`EmsConnector.step_records()`, ems/integrations/vllm/steps.py) a benchmark
can read from an OpenAI server, where the connector lives in vLLM's engine-core process (perf/bench_serving.py).

Contract: with `EMS_BENCH_STEPS_DIR` set in the server's environment, each half of the connector (scheduler and
worker) polls `<dir>/request` twice a second (a file holding a number); when the number is new, it writes its
records, oldest first, as `<dir>/<half>.json` (`{"seq": number, "records": [...]}`, atomically). Without the
variable it is `EmsConnector` itself. Nothing runs on the engine's step: polling is one stat a half-second on a
daemon thread, and a dump runs only when the benchmark asks (between its measured runs). The server names it with
`"kv_connector": "RecordingEmsConnector", "kv_connector_module_path": "serving_steps"` and perf/ on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from ems.integrations.vllm import EmsConnector

POLL_S = 0.5


class RecordingEmsConnector(EmsConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        directory = os.environ.get("EMS_BENCH_STEPS_DIR")
        if directory:
            half = "scheduler" if self.connector_scheduler is not None else "worker"
            threading.Thread(target=self._serve_dumps, args=(directory, half), name="ems-bench-steps", daemon=True).start()

    def _serve_dumps(self, directory: str, half: str) -> None:
        request, done = os.path.join(directory, "request"), -1
        while True:
            time.sleep(POLL_S)
            try:
                with open(request) as f:
                    seq = int(f.read().strip() or -1)
            except (OSError, ValueError):
                continue
            if seq == done:
                continue
            path = os.path.join(directory, f"{half}.json")
            with open(path + ".tmp", "w") as f:
                json.dump({"seq": seq, "records": self.step_records()}, f)
            os.replace(path + ".tmp", path)
            done = seq

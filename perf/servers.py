"""OpenAI servers of vLLM for the benchmarks in perf/ (`bench_vllm.py --pd`, `bench_serving.py`): start one the way
a user starts it (`python -m vllm.entrypoints.openai.api_server`, the README's `--kv-transfer-config`), wait for it,
ask it, read its Prometheus counters, and the CPU seconds of a process tree.

Contract:
* `free_port()`: a TCP port free on 127.0.0.1 now.
* `api_server_argv(model, port, max_len, num_blocks, transfer, dtype, extra)`: the server's command line (block size
  32, eager, seed 0, prefix caching on, `--num-gpu-blocks-override num_blocks`, `--gpu-memory-utilization 0.15`;
  `--skip-tokenizer-init` unless `tokenizer` is True; `--kv-transfer-config` when `transfer` is not None).
* `server_env(**extra)`: the environment every server gets: `VLLM_CPU_OMP_THREADS_BIND=nobind` (servers share the
  cores), `OMP_WAIT_POLICY=PASSIVE` unless the environment sets it (an engine's OpenMP threads spinning after its
  forward slow another engine's next step), `TOKENIZERS_PARALLELISM=false`.
* `start_server(argv, log_path, env)`: the server in its own session, its output in `log_path`.
* `wait_healthy(url, proc, timeout_s)`: returns once `url/health` answers 200; raises RuntimeError when the process
  exits first or the time runs out.
* `counter(url, name)`: a server's Prometheus counter `name` (summed over its label sets; 0 when absent).
* `post(url, body)`: one `/v1/completions` request: (its JSON, its wall seconds).
* `wait_quiet(pids)` (`vllm_engine`'s, where the engines taking turns use it too), `tree_cpu_seconds(pid)` and
  `threads_cpu_seconds(pid, tree=True)` (tests/proc_cpu.py: user + system CPU seconds of `pid`'s tree so far, in all
  and by thread name).
* `start_competitor(threads, cpus=None)`: the benchmarks' CPU competitor, a process of `threads` Python threads
  spinning (what an engine's busy Python threads cost the cores and, in their process, the interpreter), in its own
  session (ended, as servers are, by `vllm_engine.stop_processes`); `cpus` pins it (`taskset -c`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))  # proc_cpu

from proc_cpu import threads_cpu_seconds, tree_cpu_seconds  # noqa: F401 (this module's contract)
from vllm_engine import wait_quiet  # noqa: F401 (this module's contract)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def api_server_argv(
    model: str,
    port: int,
    max_len: int,
    num_blocks: int,
    transfer: dict | None = None,
    dtype: str = "auto",
    tokenizer: bool = False,
    extra: Sequence[str] = (),
) -> list[str]:
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
        "--host", "127.0.0.1", "--block-size", "32", "--max-model-len", str(max_len), "--dtype", dtype,
        "--num-gpu-blocks-override", str(num_blocks), "--gpu-memory-utilization", "0.15",
        "--enforce-eager", "--seed", "0", "--enable-prefix-caching", "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if not tokenizer:
        argv.append("--skip-tokenizer-init")
    if transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer)]
    return argv + list(extra)


def server_env(**extra: str) -> dict[str, str]:
    return {
        "OMP_WAIT_POLICY": "PASSIVE",
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "TOKENIZERS_PARALLELISM": "false",
        **extra,
    }


def start_server(argv: list[str], log_path: str, env: dict[str, str]) -> subprocess.Popen:
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited {proc.returncode}: see its log")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy after {timeout_s:.0f} s")


def counter(url: str, name: str) -> float:
    """The Prometheus counter `name` (e.g. `vllm:ems_load_blocks_total`) of the server at `url`, summed over its
    label sets."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split("{", 1)[0].split(" ", 1)[0] == name)


def post(url: str, body: dict) -> tuple[dict, float]:
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        out = json.loads(response.read())
    return out, time.perf_counter() - start


SPIN = (
    "import sys, threading\n"
    "def spin():\n"
    "    x = 0\n"
    "    while True:\n"
    "        x += 1\n"
    "for _ in range(int(sys.argv[1]) - 1):\n"
    "    threading.Thread(target=spin, daemon=True).start()\n"
    "spin()\n"
)


def start_competitor(threads: int, cpus: str | None = None) -> subprocess.Popen:
    """The competitor process; `cpus` (a `taskset -c` list, e.g. "1"): pinned there from its start."""
    pin = ["taskset", "-c", cpus] if cpus else []
    return subprocess.Popen([*pin, sys.executable, "-c", SPIN, str(threads)], start_new_session=True)

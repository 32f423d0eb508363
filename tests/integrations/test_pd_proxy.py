"""`ems.integrations.vllm.pd_proxy` between two HTTP upstreams that record what they get (stand-ins for the prefill
and decode servers; the real vLLM servers are in vllm_connector/test_pd_servers.py): the prefill server gets one
token and no stream, the decode server the unchanged request plus the prefill's `kv_transfer_params`; a failing
prefill server still serves the request (decoded without them); the decode server's errors and streams pass
through; other paths are refused."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from ems.integrations.vllm.pd_proxy import PdProxy


class Upstream(ThreadingHTTPServer):
    """Answers every POST with `reply(body)` -> (status, JSON or a list of stream chunks), keeping the bodies."""

    def __init__(self, reply: Any) -> None:
        self.bodies: list[dict] = []
        self.reply = reply
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                upstream.bodies.append(body)
                status, out = upstream.reply(body)
                self.send_response(status)
                if isinstance(out, list):  # a stream
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for chunk in out:
                        self.wfile.write(chunk.encode())
                        self.wfile.flush()
                    return
                data = json.dumps(out).encode()
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


PARAMS = {"ems_blocks": 5, "ems_model_id": "m"}


@pytest.fixture
def servers() -> Iterator[tuple[Upstream, Upstream, PdProxy]]:
    prefill = Upstream(lambda body: (200, {"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}))
    decode = Upstream(lambda body: (200, {"choices": [{"text": "decoded"}], "got": body.get("kv_transfer_params")}))
    proxy = PdProxy(("127.0.0.1", 0), prefill.url, decode.url)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    yield prefill, decode, proxy
    for server in (proxy, prefill, decode):
        server.shutdown()
        server.server_close()


def post(proxy: PdProxy, path: str, body: Any) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{proxy.server_address[1]}{path}", data)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_prefill_gets_one_token_and_decode_gets_its_kv_transfer_params(servers):
    prefill, decode, proxy = servers
    request = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 9, "stream": False, "min_tokens": 4}
    status, body = post(proxy, "/v1/completions", request)
    assert status == 200 and json.loads(body) == {"choices": [{"text": "decoded"}], "got": PARAMS}
    assert prefill.bodies == [{"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}]
    assert decode.bodies == [{**request, "kv_transfer_params": PARAMS}]


def test_a_failing_prefill_server_still_serves_the_request(servers):
    prefill, decode, proxy = servers
    prefill.reply = lambda body: (500, {"error": "boom"})
    status, body = post(proxy, "/v1/chat/completions", {"model": "m", "messages": [], "max_tokens": 3})
    assert status == 200 and json.loads(body)["got"] is None
    assert "kv_transfer_params" not in decode.bodies[0]


def test_decode_errors_and_streams_pass_through(servers):
    _, decode, proxy = servers
    decode.reply = lambda body: (400, {"error": "bad prompt"})
    assert post(proxy, "/v1/completions", {"prompt": [1]}) == (400, json.dumps({"error": "bad prompt"}).encode())
    chunks = ['data: {"choices": [{"text": "a"}]}\n\n', 'data: {"choices": [{"text": "b"}]}\n\n', "data: [DONE]\n\n"]
    decode.reply = lambda body: (200, chunks)
    assert post(proxy, "/v1/completions", {"prompt": [1], "stream": True}) == (200, "".join(chunks).encode())
    assert decode.bodies[-1]["stream"] is True


def test_other_paths_and_bodies_are_refused(servers):
    _, decode, proxy = servers
    assert post(proxy, "/v1/embeddings", {"input": "x"})[0] == 404
    assert post(proxy, "/v1/completions", b"not json")[0] == 400
    assert post(proxy, "/v1/completions", [1, 2])[0] == 400
    assert decode.bodies == []

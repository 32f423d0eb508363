"""A small proxy for disaggregated prefill/decode through the EMS pool: one OpenAI endpoint in front of a prefill
server (`kv_role` `kv_producer`) and a decode server (`kv_role` `kv_consumer`), both vLLM OpenAI servers with
`EmsConnector` on the same pool.

    python -m ems.integrations.vllm.pd_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
        [--host 127.0.0.1] [--port 8000]

Contract (standard library only; no vLLM imports):
* `POST /v1/completions` and `POST /v1/chat/completions`: the request goes to the prefill server with
  `max_tokens` 1 (and `stream` off); its response's `kv_transfer_params` (`EmsConnector`'s
  `{"ems_blocks": N, "ems_model_id": ...}`: the prompt blocks in the pool or on their way there) go with the
  unchanged request to the decode server, whose response (streamed or not) is the client's. The proxy never waits
  for the pool itself: the prefill server answers once its saves are in the pool (`producer_response`
  "after_save"), and past that wait's bound the decode server's connector waits for blocks still being saved
  (`save_wait_ms`).
* A prefill server that fails or answers without `kv_transfer_params` is not fatal: the request goes to the decode
  server without them (it then takes what the pool holds, and computes the rest). An error of the decode server is
  the client's (its status and body, passed through).
* `GET` of any path (`/v1/models`, `/health`) is the decode server's answer.
"""

from __future__ import annotations

import argparse
import json
import logging
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger("ems.integrations.vllm.pd_proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
TIMEOUT_S = 600.0
CHUNK_BYTES = 1 << 14


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill server gets: one token, not streamed."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def post_json(url: str, body: dict[str, Any], timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        parsed = json.loads(response.read())
    if not isinstance(parsed, dict):
        raise ValueError(f"{url} answered {type(parsed).__name__}, not a JSON object")
    return parsed


class PdProxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], prefill: str, decode: str) -> None:
        super().__init__(address, _Handler)
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")


class _Handler(BaseHTTPRequestHandler):
    server: PdProxy

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug(format, *args)

    def do_GET(self) -> None:
        self._relay(urllib.request.Request(self.server.decode + self.path))

    def do_POST(self) -> None:
        if self.path not in ROUTES:
            self._reply(404, {"error": f"the proxy serves {list(ROUTES)}, not {self.path}"})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        except ValueError as exc:
            self._reply(400, {"error": f"the request body is not JSON: {exc}"})
            return
        if not isinstance(body, dict):
            self._reply(400, {"error": "the request body must be a JSON object"})
            return
        try:
            prefilled = post_json(self.server.prefill + self.path, prefill_request(body))
            params = prefilled.get("kv_transfer_params")
        except (OSError, ValueError) as exc:  # (urllib's errors are OSErrors) the decode server computes it all
            logger.warning("the prefill server failed (%s): the decode server computes the prompt", exc)
            params = None
        decode_body = dict(body)
        if isinstance(params, dict):
            decode_body["kv_transfer_params"] = params
        data = json.dumps(decode_body).encode()
        self._relay(urllib.request.Request(self.server.decode + self.path, data, {"Content-Type": "application/json"}))

    def _relay(self, request: urllib.request.Request) -> None:
        """The upstream's answer, status, type and body (streamed as it comes), to the client."""
        try:
            response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
        except urllib.error.HTTPError as exc:  # the upstream's own error: passed through
            response = exc
        except OSError as exc:
            self._reply(502, {"error": f"the decode server did not answer: {exc}"})
            return
        with response:
            self.send_response(response.status)
            self.send_header("Content-Type", response.headers.get("Content-Type", "application/json"))
            self.send_header("Connection", "close")
            self.end_headers()
            while chunk := response.read1(CHUNK_BYTES):
                self.wfile.write(chunk)
                self.wfile.flush()
        self.close_connection = True

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", required=True, help="the prefill (kv_producer) server's base URL")
    parser.add_argument("--decode", required=True, help="the decode (kv_consumer) server's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    server = PdProxy((args.host, args.port), args.prefill, args.decode)
    print(f"pd_proxy listening on {args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

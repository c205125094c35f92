"""A stand-in for llama.cpp's ``llama-server`` and for ``vllm serve`` in ``bench peer``'s tests:
takes their flags (``-m MODEL`` or ``serve MODEL``), answers ``GET /health`` and ``/v1/models``,
streams ``/v1/completions`` (one chunk per token, 10 ms apart, then usage and ``[DONE]``), answers
a non-streamed ``/v1/completions`` with vLLM's ``token_ids`` and ``POST /completion`` with
llama.cpp's ``tokens``: the prompt's ids counting up from the last one (so a test knows the greedy
tokens to expect). Writes its argv to ``$FAKE_LLAMA_ARGV`` when set."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def greedy_tokens(prompt: list[int], n: int) -> list[int]:
    return [prompt[-1] + 1 + i for i in range(n)]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake.gguf", "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        if self.path == "/completion":
            self._json(200, {"content": "x", "tokens": greedy_tokens(body["prompt"], body["n_predict"])})
            return
        if not body.get("stream", True):  # vLLM's greedy check: /v1/completions with return_token_ids
            tokens = greedy_tokens(body["prompt"], body["max_tokens"]) if body.get("return_token_ids") else None
            self._json(200, {"choices": [{"index": 0, "text": "x", "token_ids": tokens}]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(n):
            time.sleep(0.01)
            self._chunk({"choices": [{"index": 0, "text": f"t{i}"}]})
        self._chunk({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})
        self._raw(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, obj: dict) -> None:
        self._raw(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _raw(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def main() -> int:
    if os.environ.get("FAKE_LLAMA_ARGV"):
        with open(os.environ["FAKE_LLAMA_ARGV"], "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\n")
    parser = argparse.ArgumentParser()
    if sys.argv[1:2] == ["serve"]:  # vllm serve MODEL ...
        parser.add_argument("serve")
        parser.add_argument("model")
    else:
        parser.add_argument("-m", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sys.exit(main())

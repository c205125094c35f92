"""``gridserve bench fuzz``: generated hostile requests through the real Envoy edge, every answer checked.

For each of ``/v1/completions``, ``/v1/chat/completions``, ``/tokenize`` and ``/detokenize`` the
fuzzer sends bodies of every shape — near-valid requests whose fields are drawn from valid values,
extremes (2^63, 1e308, NaN, infinities), wrong types, huge strings and lists, unknown fields and
nested garbage (hypothesis strategies); raw bodies (invalid UTF-8, truncated or deeply nested JSON,
non-objects); and the cases schemathesis derives from the server's own ``/openapi.json`` (positive
and negative) — and native gRPC ``Generate`` requests drawn over every field of the proto.

Image cases (issue 38), to ``/v1/chat/completions`` and ``/tokenize``: chat requests whose parts
carry images — ``data:`` URLs of a decompression-bomb PNG, extreme aspect ratios, too many images,
malformed base64, non-images — and ``http`` URLs at 127.0.0.1, ``[::1]``, 169.254.169.254, private
addresses, other schemes, and at a local server (``MediaServer``) that trickles its body and
redirects to 127.0.0.1 and to the metadata address. Each fixed case is sent once, then generated
mixes of them. A hostile image is a 400 naming a ``messages`` part on any deployment; on a
text-only model every image is (it takes no image); ``/secret`` on the local server, reachable only
through a redirect a gateway must refuse, is never asked for (``media_problems``).

A request passes when the answer comes within ``TIMEOUT_S`` (no hang) with a 2xx or 4xx status
(never 5xx), a 4xx body in OpenAI's error shape, a 2xx body that parses (each SSE event too, and an
in-band error is 4xx); a gRPC call ends OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED (an image case as
above too). Afterwards
health is SERVING and the engine holds no running or waiting request and no KV block. The counts
(requests per route, statuses seen) are printed. ``hypothesis`` and ``schemathesis`` come with the
``test`` extra; they are imported only when the fuzzer runs.
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.client
import io
import json
import logging
import math
import os
import random
import socket
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional

import grpc

logger = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
GENERATE = "grpc Generate"
TIMEOUT_S = 30.0  # an answer later than this is a hang
# The stack under test: small limits, so hostile values hit them and generations stay short.
ENGINE_ARGS = ["--kv-cache-memory-bytes", str(32 << 20), "--max-model-len", "48", "--max-num-seqs", "16"]
GATEWAY_ARGS = ["--max-n", "4", "--max-best-of", "4", "--max-prompts-per-request", "8", "--max-stop-strings", "8",
                "--max-logit-bias", "16", "--max-content-chars", "8192", "--max-messages", "16",
                "--max-structured-output-chars", "4096", "--request-timeout", "120"]
MAX_BODY_BYTES = 1 << 20
GRPC_OK = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
ERROR_KEYS = {"message", "type", "param", "code"}


def edge_limits():
    from gridserve.edge import EdgeLimits

    return EdgeLimits(max_request_body_bytes=MAX_BODY_BYTES)


# ---- checking one answer ------------------------------------------------------------------------
def http_problem(status: int, content_type: str, payload: bytes) -> Optional[str]:
    """What is wrong with one REST answer, or None."""
    if not (200 <= status < 300 or 400 <= status < 500):
        return f"HTTP {status}: {payload[:300]!r}"
    if status < 300 and content_type.startswith("text/event-stream"):
        return _sse_problem(payload)
    try:
        body = json.loads(payload)
    except ValueError:
        return f"HTTP {status} with a body that is not JSON: {payload[:300]!r}"
    if status >= 400:
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict) or set(error) != ERROR_KEYS or error["code"] != status:
            return f"HTTP {status} not in OpenAI's error shape: {payload[:300]!r}"
    elif not isinstance(body, dict):
        return f"HTTP {status} body is not an object: {payload[:300]!r}"
    return None


def _sse_problem(payload: bytes) -> Optional[str]:
    events = [e for e in payload.decode("utf-8", "replace").split("\n\n") if e.strip()]
    if not events or events[-1] != "data: [DONE]":
        return f"stream did not end with [DONE]: {payload[-300:]!r}"
    for event in events[:-1]:
        if not event.startswith("data: "):
            return f"not an SSE data event: {event[:200]!r}"
        try:
            body = json.loads(event[len("data: "):])
        except ValueError:
            return f"SSE event is not JSON: {event[:200]!r}"
        error = body.get("error") if isinstance(body, dict) else None
        if error is not None and not (isinstance(error, dict) and 400 <= int(error.get("code") or 0) < 500):
            return f"in-band error that is not a 4xx: {event[:300]!r}"
    return None


class Fuzzer:
    """Sends requests to one edge and keeps the counts and the failures."""

    def __init__(self, edge_address: str, model: str, timeout_s: float = TIMEOUT_S) -> None:
        self.edge_address = edge_address
        self.model = model
        self.timeout_s = timeout_s
        self.counts: Counter[tuple[str, str]] = Counter()
        self.failures: list[str] = []
        self.labels: Counter[str] = Counter()  # requests sent per kind ("fields", "raw", "image bomb-8000x8000", ...)
        self._channel = grpc.insecure_channel(edge_address)

    def close(self) -> None:
        self._channel.close()

    def post(self, route: str, data: bytes, label: str,
             check: Optional[Callable[[int, bytes], Optional[str]]] = None) -> None:
        """One REST request, its answer checked (and by ``check(status, payload)`` when given)."""
        self.labels[label] += 1
        host, port = self.edge_address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=self.timeout_s)
        try:
            try:
                conn.request("POST", route, data, {"Content-Type": "application/json"})
            except (BrokenPipeError, ConnectionResetError):
                pass  # the edge answered (413) before the whole body was sent; its answer is there to read
            response = conn.getresponse()
            status, content_type, payload = response.status, response.getheader("content-type", ""), response.read()
        except (TimeoutError, OSError, http.client.HTTPException) as exc:
            self.counts[(route, type(exc).__name__)] += 1
            self._fail(route, label, f"no answer ({type(exc).__name__}: {exc})", data)
            return
        finally:
            conn.close()
        self.counts[(route, str(status))] += 1
        problem = http_problem(status, content_type, payload) or (check(status, payload) if check else None)
        if problem:
            self._fail(route, label, problem, data)

    def generate(self, request: Any, label: str) -> None:
        from gridserve.api.gateway.v1 import gateway_pb2_grpc

        self.labels[label] += 1
        stub = gateway_pb2_grpc.GatewayStub(self._channel)
        try:
            for _ in stub.Generate(request, timeout=self.timeout_s):
                pass
            code = grpc.StatusCode.OK
            details = ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
        self.counts[(GENERATE, code.name)] += 1
        if code not in GRPC_OK:
            self._fail(GENERATE, label, f"{code.name}: {details}", str(request).encode()[:2000])

    def _fail(self, route: str, label: str, problem: str, data: bytes) -> None:
        self.failures.append(f"{route} [{label}]: {problem}\n    request: {data[:500]!r}")
        logger.error("%s [%s]: %s", route, label, problem)

    def table(self) -> str:
        """Requests per route and the statuses seen."""
        routes = [*ROUTES, GENERATE]
        lines = [f"{'route':<22} {'requests':>8}  statuses"]
        for route in routes:
            seen = {status: n for (r, status), n in self.counts.items() if r == route}
            total = sum(seen.values())
            statuses = ", ".join(f"{s}: {n}" for s, n in sorted(seen.items()))
            lines.append(f"{route:<22} {total:>8}  {statuses}")
        lines.append(f"{'total':<22} {sum(self.counts.values()):>8}  failures: {len(self.failures)}")
        return "\n".join(lines)


# ---- what to send -------------------------------------------------------------------------------
def _strategies(model: str) -> dict[str, Any]:
    """Hypothesis strategies of JSON bodies for each route: half of them plausible (every field a
    valid-looking value, so many reach the engine), half hostile (any field may be garbage)."""
    from hypothesis import strategies as st

    extremes_int = st.sampled_from([-2**63 - 1, -2**31 - 1, -2**31, -1, 2**31 - 1, 2**31, 2**32, 2**53 + 1,
                                    2**63 - 1, 2**63, 2**64, 10**30])
    extremes_float = st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0])
    huge_text = st.builds(lambda n, c: c * n, st.sampled_from([5_000, 100_000, 3_000_000]),
                          st.sampled_from(["a", "\u00e9", "\U0001f600", "\x00", " "]))
    short_text = st.text(max_size=24)
    scalar = st.one_of(st.none(), st.booleans(), st.integers(-10, 10), extremes_int, st.floats(), extremes_float,
                       st.text(max_size=16))
    garbage = st.recursive(scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=12)
    big_list = st.builds(lambda n, x: [x] * n, st.sampled_from([1_000, 30_000]), st.sampled_from([1, "s", [1], None]))
    small = st.integers(0, 4)
    token = st.integers(0, 4095)
    unit = st.floats(0, 1)

    def routes(hostile: bool) -> dict[str, Any]:
        def f(*plausible, extreme=None):  # one field: plausible values, and when hostile anything else too
            if not hostile:
                return st.one_of(*plausible)
            return st.one_of(*plausible, *([extreme] if extreme is not None else []), garbage, big_list, huge_text)

        tokens = st.lists(f(token, extreme=st.one_of(st.integers(-5, 5000), extremes_int)), max_size=12)
        text = f(short_text)
        sampling = {
            "model": f(st.just(model), extreme=st.text(max_size=8)),
            "max_tokens": f(small, extreme=extremes_int), "min_tokens": f(st.integers(0, 2), extreme=extremes_int),
            "n": f(st.integers(1, 3), extreme=extremes_int), "best_of": f(st.integers(3, 4), extreme=extremes_int),
            "temperature": f(st.floats(0, 2), extreme=extremes_float), "top_p": f(st.floats(0.01, 1), extreme=extremes_float),
            "top_k": f(st.integers(-1, 50), extreme=extremes_int), "min_p": f(unit, extreme=extremes_float),
            "seed": f(st.integers(0, 2**64 - 1), extreme=extremes_int),
            "presence_penalty": f(st.floats(-2, 2), extreme=extremes_float),
            "frequency_penalty": f(st.floats(-2, 2), extreme=extremes_float),
            "repetition_penalty": f(st.floats(0.5, 2), extreme=extremes_float),
            "stop": f(st.text(min_size=1, max_size=8), st.lists(st.text(min_size=1, max_size=8), max_size=4)),
            "stop_token_ids": tokens, "ignore_eos": f(st.booleans()),
            "logit_bias": f(st.dictionaries(token.map(str), st.floats(-100, 100), max_size=8),
                            extreme=st.dictionaries(st.integers(-2, 10**6).map(str), extremes_float, max_size=20)),
            "stream": f(st.booleans()), "stream_options": f(st.fixed_dictionaries({"include_usage": st.booleans()})),
            "skip_special_tokens": f(st.booleans()), "include_stop_str_in_output": f(st.booleans()),
            "structured_outputs": f(st.fixed_dictionaries({"regex": st.sampled_from(["[a-z]{1,4}", "(yes|no)", "x+"])}),
                                    st.fixed_dictionaries({"choice": st.lists(st.text(min_size=1, max_size=6),
                                                                              min_size=1, max_size=4)}),
                                    extreme=st.one_of(st.fixed_dictionaries({"regex": st.text(max_size=12)}),
                                                      st.fixed_dictionaries({"json": garbage}),
                                                      st.fixed_dictionaries({"grammar": st.text(max_size=24)}))),
            "response_format": f(st.just({"type": "json_object"}), st.just({"type": "text"}),
                                 extreme=st.fixed_dictionaries({"type": st.just("json_schema"),
                                                                "json_schema": st.fixed_dictionaries(
                                                                    {"name": st.just("x"), "schema": garbage})})),
            "user": f(st.text(max_size=8)),
        }
        unknown = st.dictionaries(st.text(min_size=1, max_size=10), garbage, max_size=3) if hostile else st.just({})

        def body(required: dict, optional: dict):
            return st.builds(lambda b, extra: {**extra, **b}, st.fixed_dictionaries(required, optional=optional), unknown)

        prompt = f(short_text.filter(bool), st.lists(short_text, min_size=1, max_size=3), st.lists(token, min_size=1, max_size=8),
                   st.lists(st.lists(token, min_size=1, max_size=4), min_size=1, max_size=3))
        part = f(st.fixed_dictionaries({"type": st.just("text"), "text": text}))
        message = st.fixed_dictionaries({"role": f(st.sampled_from(["user", "system", "assistant"]),
                                                   extreme=st.sampled_from(["tool", "developer", "x", ""])),
                                         "content": f(short_text, st.lists(part, max_size=3))})
        messages = f(st.lists(message, min_size=1, max_size=4))
        chat_extra = {"max_completion_tokens": f(small, extreme=extremes_int), "logprobs": f(st.booleans()),
                      "top_logprobs": f(small, extreme=extremes_int), "add_generation_prompt": f(st.booleans()),
                      **({"chat_template": f(st.text(max_size=30)), "tools": garbage} if hostile else {})}
        completion_extra = {"logprobs": f(small, extreme=extremes_int), "echo": f(st.booleans())}
        return {
            "/v1/completions": body({"prompt": prompt}, {**sampling, **completion_extra}),
            "/v1/chat/completions": body({"messages": messages}, {**sampling, **chat_extra}),
            "/tokenize": body({"prompt": prompt} if not hostile else {},
                              {"model": sampling["model"], "add_special_tokens": f(st.booleans()),
                               "return_token_strs": f(st.booleans()),
                               **({"messages": messages, "prompt": prompt, "chat_template": f(st.text(max_size=30))}
                                  if hostile else {})}),
            "/detokenize": body({"tokens": f(st.lists(token, max_size=60))}, {"model": sampling["model"]}),
        }

    plausible, hostile = routes(False), routes(True)
    return {route: st.one_of(plausible[route], hostile[route]) for route in ROUTES}


def _raw_bodies():
    """Bodies that are not JSON objects: invalid UTF-8, broken or deeply nested JSON, other values."""
    from hypothesis import strategies as st

    fixed = [b"", b"null", b"[]", b"42", b'"x"', b"{", b'{"prompt": "a",', b'{"prompt": "\xff\xfe"}', b"\xff\xfe\xfd",
             b'{"prompt": "a", "max_tokens": 1e400}', b'{"prompt": "a", "n": -0}', b'{"tokens": [1e400]}',
             b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
             b'{"prompt": "a", "prompt": 3}', b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
             json.dumps({"prompt": "a", "max_tokens": 2}).encode() + b"\x00trailing"]
    return st.one_of(st.sampled_from(fixed), st.binary(max_size=64),
                     st.text(max_size=64).map(lambda s: s.encode("utf-8", "surrogatepass")))


def _grpc_requests():
    """``GenerateRequest``s over every field of the proto, each within its type's range."""
    from hypothesis import strategies as st

    from gridserve.api.common.v1 import common_pb2
    from gridserve.api.gateway.v1 import gateway_pb2

    i32 = st.one_of(st.integers(-5, 5000), st.sampled_from([-2**31, 2**31 - 1]))
    u32 = st.one_of(st.integers(0, 4), st.sampled_from([5, 47, 48, 1000, 2**31, 2**32 - 1]))
    i64 = st.one_of(st.integers(-5, 5), st.sampled_from([-2**63, 2**63 - 1]))
    dbl = st.one_of(st.floats(-3, 3), st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308]))
    text = st.one_of(st.text(max_size=16), st.sampled_from(["x" * 100_000]))
    strings = st.lists(st.text(max_size=8), max_size=12)
    ids = st.builds(lambda v: common_pb2.TokenIdList(ids=v), st.lists(i32, max_size=12))
    so = st.one_of(st.builds(lambda s: common_pb2.StructuredOutputsParams(regex=s), st.text(max_size=12)),
                   st.builds(lambda s: common_pb2.StructuredOutputsParams(json=s), st.text(max_size=24)),
                   st.builds(lambda s: common_pb2.StructuredOutputsParams(grammar=s), st.text(max_size=24)),
                   st.just(common_pb2.StructuredOutputsParams(json_object=True)))
    params = st.fixed_dictionaries({}, optional={
        "n": u32, "temperature": dbl, "top_p": dbl, "top_k": i32, "min_p": dbl, "seed": i64,
        "max_tokens": u32, "min_tokens": u32, "stop": strings, "stop_token_ids": st.lists(i32, max_size=8),
        "ignore_eos": st.booleans(), "logprobs": u32, "skip_special_tokens": st.booleans(),
        "include_stop_str_in_output": st.booleans(), "presence_penalty": dbl, "frequency_penalty": dbl,
        "repetition_penalty": dbl, "bad_words": strings, "prompt_logprobs": u32, "detokenize": st.booleans(),
        "spaces_between_special_tokens": st.booleans(), "logit_bias": st.dictionaries(i32, dbl, max_size=20),
        "allowed_token_ids": ids, "truncate_prompt_tokens": u32, "structured_outputs": so,
        "bad_words_token_ids": st.lists(ids, max_size=3),
    }).map(lambda kw: common_pb2.SamplingParams(**kw))

    def request(prompt: Any, sampling: Any, request_id: str, rank: Optional[int]) -> Any:
        kwargs: dict[str, Any] = {"sampling_params": sampling, "request_id": request_id}
        if isinstance(prompt, str):
            kwargs["text"] = prompt
        elif prompt is not None:
            kwargs["token_ids"] = gateway_pb2.TokenIds(ids=prompt)
        if rank is not None:
            kwargs["data_parallel_rank"] = rank
        return gateway_pb2.GenerateRequest(**kwargs)

    prompt = st.one_of(st.none(), text, st.lists(i32, max_size=60))
    hostile = st.builds(request, prompt, params, st.one_of(st.just(""), st.text(max_size=8)),
                        st.one_of(st.none(), st.integers(0, 2**32 - 1)))
    token = st.integers(0, 4095)
    plausible_params = st.fixed_dictionaries({"max_tokens": st.integers(1, 4)}, optional={
        "n": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
        "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1), "seed": st.integers(-2**63, 2**63 - 1),
        "min_tokens": st.integers(0, 1), "stop": st.lists(st.text(min_size=1, max_size=6), max_size=3),
        "stop_token_ids": st.lists(token, max_size=3), "ignore_eos": st.booleans(), "logprobs": st.integers(0, 5),
        "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.5, 2), "logit_bias": st.dictionaries(token, st.floats(-100, 100), max_size=5),
        "prompt_logprobs": st.integers(0, 5), "skip_special_tokens": st.booleans(),
    }).map(lambda kw: common_pb2.SamplingParams(**kw))
    plausible = st.builds(request, st.one_of(st.text(min_size=1, max_size=20), st.lists(token, min_size=1, max_size=20)),
                          plausible_params, st.just(""), st.none())
    return st.one_of(plausible, hostile)


# ---- image cases (issue 38) ---------------------------------------------------------------------
IMAGE_ROUTES = ("/v1/chat/completions", "/tokenize")
SLOW_BODY_S = 4.0  # how long MediaServer's /slow.png trickles: longer than a fetch deadline


def png(width: int = 12, height: int = 8, mode: str = "RGB") -> bytes:
    """A small PNG (any size: flat colour, so even 1 x 5000 is a few hundred bytes)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new(mode, (width, height), 128 if mode == "L" else (200, 40, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


@functools.lru_cache(maxsize=4)
def bomb_png(width: int = 8000, height: int = 8000, rows: bool = True) -> bytes:
    """A valid grayscale PNG of ``width`` x ``height`` zeros, deflated to almost nothing (8000 x 8000:
    64 MP in ~64 kB); ``rows=False``: the header only, its pixel data cut off."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    data = zlib.compress(b"\0" * ((width + 1) * height), 9) if rows else zlib.compress(b"\0" * 64)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", data) + chunk(b"IEND", b""))


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


class MediaServer:
    """A local image server on loopback for the image cases, reached by ``name`` (``localhost``:
    a gateway started with ``--allowed-media-domains localhost`` and the loopback test hook
    fetches from it; any other gateway must refuse it before connecting).

    ``/cat.png`` a small PNG; ``/slow.png`` a body trickled a byte every 0.1 s for ``slow_body_s``;
    ``/to-loopback`` a 302 to ``http://127.0.0.1:<port>/secret``, ``/to-metadata`` a 302 to
    169.254.169.254. ``hits`` lists the paths asked for; ``/secret`` is reachable only through the
    redirect, so a hit there is a fetch a gateway let through (``media_problems``)."""

    def __init__(self, name: str = "localhost", slow_body_s: float = SLOW_BODY_S) -> None:
        self.name = name
        self.slow_body_s = slow_body_s
        self.hits: list[str] = []
        handler = self._handler()
        self._servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler)]
        self.port = self._servers[0].server_address[1]
        for address in _loopback_addresses(name, self.port):  # ::1 too where the name resolves to it
            if address != "127.0.0.1":
                try:
                    self._servers.append(_V6Server((address, self.port), handler))
                except OSError:
                    pass
        for server in self._servers:
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://{self.name}:{self.port}{path}"

    def close(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def __enter__(self) -> MediaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        media = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                media.hits.append(self.path)
                port = self.server.server_address[1]
                redirects = {"/to-loopback": f"http://127.0.0.1:{port}/secret",
                             "/to-metadata": "http://169.254.169.254/latest/meta-data/"}
                if self.path in redirects:
                    self.send_response(302)
                    self.send_header("Location", redirects[self.path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif self.path == "/slow.png":
                    self.send_response(200)
                    self.end_headers()
                    for _ in range(int(media.slow_body_s / 0.1)):  # no single read waits long; the fetch's deadline ends it
                        try:
                            self.wfile.write(b"x")
                            self.wfile.flush()
                        except OSError:
                            return
                        time.sleep(0.1)
                elif self.path in ("/cat.png", "/secret"):
                    body = png()
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                else:
                    self.send_error(404)

            def log_message(self, *args: object) -> None:
                pass

        return Handler


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _loopback_addresses(name: str, port: int) -> list[str]:
    try:
        return list(dict.fromkeys(str(i[4][0]) for i in socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)))
    except OSError:
        return []


def media_problems(media: MediaServer, fetches_from_it: bool) -> list[str]:
    """What the local server's log says went wrong: ``/secret`` asked for (a redirect to 127.0.0.1
    followed), or, for a gateway that may not fetch from it, any request at all."""
    if not fetches_from_it and media.hits:
        return [f"the gateway fetched from loopback: {media.hits[:5]}"]
    if "/secret" in media.hits:
        return ["a redirect to 127.0.0.1 was followed (/secret fetched)"]
    return []


def image_cases(media: Optional[MediaServer]) -> list[tuple[str, list[str], bool]]:
    """``(kind, image URLs of one request, must be refused)``: the fixed image cases. A case not
    refused may still be a 400 (prompt too long, a text-only model, a gateway that fetches no URL)."""
    small = data_url(png())
    cases: list[tuple[str, list[str], bool]] = [
        ("valid", [small], False),
        ("valid-two", [small, data_url(png(20, 20, "L"))], False),
        ("bomb-8000x8000", [data_url(bomb_png())], True),
        ("bomb-header-50000x50000", [data_url(bomb_png(50_000, 50_000, rows=False))], True),
        ("aspect-1x5000", [data_url(png(1, 5000))], True),
        ("aspect-5000x1", [data_url(png(5000, 1))], True),
        ("aspect-2x400", [data_url(png(2, 400))], True),
        ("count-9", [small] * 9, True),
        ("count-100", [small] * 100, True),
        ("base64-invalid", ["data:image/png;base64,!!!not base64!!!"], True),
        ("base64-truncated", [small[:-7]], True),
        ("base64-not-base64-header", ["data:image/png," + base64.b64encode(png()).decode()], True),
        ("base64-empty", ["data:image/png;base64,"], True),
        ("not-an-image", [data_url(b"GIF89a" + b"\0" * 40)], True),
        ("svg", [data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml")], True),
        ("truncated-png", [data_url(png(64, 64)[:60])], True),
        ("url-metadata", ["http://169.254.169.254/latest/meta-data/iam/security-credentials/"], True),
        ("url-private", ["http://10.0.0.1/a.png"], True),
        ("url-file", ["file:///etc/passwd"], True),
        ("url-ftp", ["ftp://127.0.0.1/a.png"], True),
        ("url-gopher", ["gopher://127.0.0.1:6379/_INFO"], True),
        ("url-no-host", ["http:///a.png"], True),
    ]
    if media is not None:
        port = media.port
        cases += [
            ("url-127.0.0.1", [f"http://127.0.0.1:{port}/cat.png"], True),
            ("url-[::1]", [f"http://[::1]:{port}/cat.png"], True),
            ("url-[::ffff:127.0.0.1]", [f"http://[::ffff:127.0.0.1]:{port}/cat.png"], True),
            ("url-0.0.0.0", [f"http://0.0.0.0:{port}/cat.png"], True),
            ("url-slow", [media.url("/slow.png")], True),
            ("url-redirect-to-127.0.0.1", [media.url("/to-loopback")], True),
            ("url-redirect-to-metadata", [media.url("/to-metadata")], True),
            ("url-local-server", [media.url("/cat.png")], False),  # 200 only where it may fetch from it
        ]
    return cases


def image_problem(takes_images: bool, must_refuse: bool) -> Callable[[int, bytes], Optional[str]]:
    """The check of one image case's answer (beyond ``http_problem``'s): a 400 naming a
    ``messages`` part where the image must be refused, and on a text-only model always."""
    def check(status: int, payload: bytes) -> Optional[str]:
        if takes_images and not must_refuse:
            return None
        if status != 400:
            return f"HTTP {status} for an image that must be refused: {payload[:300]!r}"
        param = (json.loads(payload).get("error") or {}).get("param") or ""
        if not param.startswith("messages"):
            return f"400 not naming the image part (param {param!r}): {payload[:300]!r}"
        return None
    return check


def _image_requests(media: Optional[MediaServer], model: str):
    """Generated image requests: ``(route, body, kind, must be refused)``, mixes of the fixed cases
    (one or two of them in a request, anywhere among text parts, in one or two messages)."""
    from hypothesis import strategies as st

    cases = image_cases(media)
    text = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=12)})

    def request(route, chosen, texts, split, extra):
        parts = [{"type": "image_url", "image_url": {"url": url}} for _, urls, _ in chosen for url in urls]
        parts = parts[:split] + texts + parts[split:]
        messages = [{"role": "user", "content": parts or [{"type": "text", "text": "?"}]}]
        if len(chosen) > 1:
            messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, *parts[:1]]},
                        {"role": "assistant", "content": "b"}, {"role": "user", "content": parts[1:] or "c"}]
        body: dict[str, Any] = {"messages": messages, **extra}
        if route == "/tokenize":
            body = {k: v for k, v in body.items() if k in ("messages", "model")}
        kind = "+".join(k for k, _, _ in chosen)
        return route, body, kind, any(refused for _, _, refused in chosen)

    extra = st.fixed_dictionaries({"max_tokens": st.integers(1, 3)}, optional={
        "model": st.just(model), "temperature": st.floats(0, 1), "stream": st.booleans(), "n": st.integers(1, 2)})
    return st.builds(request, st.sampled_from(IMAGE_ROUTES), st.lists(st.sampled_from(cases), min_size=1, max_size=2),
                     st.lists(text, max_size=2), st.integers(0, 3), extra)


def fuzz_images(fuzzer: Fuzzer, examples: int, seed: int = 0, media: Optional[MediaServer] = None,
                takes_images: bool = False) -> None:
    """Each fixed image case once to chat (``/tokenize`` too, without the slow ones), then about
    ``examples`` generated mixes. ``takes_images``: the deployment's model has a vision encoder."""
    chat = {"max_tokens": 2, "temperature": 0.0}
    for kind, urls, refused in image_cases(media):
        parts = [*({"type": "image_url", "image_url": {"url": url}} for url in urls), {"type": "text", "text": "?"}]
        messages = [{"role": "user", "content": parts}]
        check = image_problem(takes_images, refused)
        fuzzer.post("/v1/chat/completions", _encode({"messages": messages, **chat}), f"image {kind}", check)
        if kind != "url-slow":
            fuzzer.post("/tokenize", _encode({"messages": messages}), f"image {kind}", check)
    _drive(_image_requests(media, fuzzer.model), examples, seed,
           lambda r: fuzzer.post(r[0], _encode(r[1]), f"image {r[2]}", image_problem(takes_images, r[3])))


def model_takes_images(model: str) -> bool:
    """Whether the model folder's config has a vision encoder (the gateway then loads images)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(config.get("vision_config"))


def _schemathesis_bodies(openapi: dict[str, Any], route: str, negative: bool):
    """Bodies schemathesis derives from ``/openapi.json`` for ``route`` (valid or, negative, not)."""
    import schemathesis
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_dict(openapi)
    operation = schema[route]["POST"]
    mode = GenerationMode.NEGATIVE if negative else GenerationMode.POSITIVE
    return operation.as_strategy(generation_mode=mode).map(lambda case: case.body)


def _encode(body: Any) -> bytes:
    if isinstance(body, bytes):
        return body
    try:
        return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError):
        return repr(body).encode("utf-8", "surrogatepass")


def _drive(strategy: Any, examples: int, seed: int, fn: Callable[[Any], None]) -> None:
    """Run ``fn`` on ``examples`` values of ``strategy`` (no shrinking: ``fn`` records failures)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    if examples <= 0:
        return

    @with_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(strategy)
    def run(value: Any) -> None:
        fn(value)

    run()


def fuzz(fuzzer: Fuzzer, openapi: dict[str, Any], examples: int, seed: int = 0,
         media: Optional[MediaServer] = None, vision: bool = False) -> None:
    """About ``examples`` requests in all: per REST route, strategy bodies, raw bodies and
    schemathesis' (positive and negative); then gRPC ``Generate``; then the image cases (the fixed
    ones and ``examples // 15`` generated; ``media``: the local image server, ``vision``: the model
    takes images)."""
    per_route = max(1, examples // (len(ROUTES) + 1))
    strategies = _strategies(fuzzer.model)
    for route in ROUTES:
        share = {"fields": per_route * 5 // 10, "raw": per_route // 10,
                 "openapi-positive": per_route // 10, "openapi-negative": per_route - per_route * 8 // 10}
        _drive(strategies[route], share["fields"], seed, lambda b, r=route: fuzzer.post(r, _encode(b), "fields"))
        _drive(_raw_bodies(), share["raw"], seed, lambda b, r=route: fuzzer.post(r, b, "raw"))
        for label in ("openapi-positive", "openapi-negative"):
            strategy = _schemathesis_bodies(openapi, route, negative=label.endswith("negative"))
            _drive(strategy, share[label], seed, lambda b, r=route, lab=label: fuzzer.post(r, _encode(b), lab))
    _drive(_grpc_requests(), per_route, seed, lambda req: fuzzer.generate(req, "proto fields"))
    fuzz_images(fuzzer, examples // 15, seed, media, vision)


# ---- the stack and its state afterwards ---------------------------------------------------------
def settled(edge_address: str, engine_address: str, gateway_address: str, timeout_s: float = 30.0) -> list[str]:
    """What is wrong once the fuzzing stopped (empty when all is well): health SERVING everywhere,
    the edge's ``/health`` 200, the engine at zero running / waiting requests and zero KV blocks."""
    from gridserve.api.engine.v1 import engine_pb2, engine_pb2_grpc
    from gridserve.shared.readiness import LIVENESS_SERVICE
    from gridserve.shared.rpc.client import health_status

    deadline = time.monotonic() + timeout_s
    while True:
        problems = []
        for role, address in (("engine", engine_address), ("gateway", gateway_address)):
            with grpc.insecure_channel(address) as channel:
                for service in ("", LIVENESS_SERVICE):
                    status = health_status(channel, service)
                    if status != "SERVING":
                        problems.append(f"{role} health {service or 'readiness'}: {status}")
                if role == "engine":
                    try:
                        load = engine_pb2_grpc.EngineCoreStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
                        if load.num_running or load.num_waiting or load.kv_cache_usage:
                            problems.append(f"engine not idle: {load.num_running} running, {load.num_waiting} "
                                            f"waiting, KV usage {load.kv_cache_usage}")
                    except grpc.RpcError as exc:
                        problems.append(f"engine GetLoad: {exc.code().name}")
        host, port = edge_address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("GET", "/health")
            if (status := conn.getresponse().status) != 200:
                problems.append(f"edge /health: HTTP {status}")
        except OSError as exc:
            problems.append(f"edge /health: {exc}")
        finally:
            conn.close()
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(0.2)


def openapi_of(edge_address: str) -> dict[str, Any]:
    host, port = edge_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/openapi.json")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: the recipe's llama tiny)")
    parser.add_argument("--examples", type=int, default=2000, help="requests in all (REST routes and gRPC)")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random, printed)")
    parser.add_argument("--log-dir", default=None, help="keep the roles' logs here")
    parser.add_argument("--fetch-local-images", action="store_true",
                        help="let the gateway fetch image URLs from the fuzzer's local image server (test hooks "
                             "GRIDSERVE_TEST_HOOKS / GRIDSERVE_TEST_MEDIA_LOOPBACK, --allowed-media-domains "
                             "localhost, a 1 s fetch deadline), so slow and redirecting URLs are fetched; a "
                             "vision model (--model) then takes its images")


def run(args: argparse.Namespace) -> int:
    import tempfile

    from gridserve.launcher import Launcher, free_port

    model = args.model
    if model is None:
        from gridserve.demo.recipe import ensure_checkpoint

        model = str(ensure_checkpoint("llama", "tiny"))
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gridserve-fuzz-"))
    gateway_args = list(GATEWAY_ARGS)
    fetches = bool(getattr(args, "fetch_local_images", False))
    if fetches:  # test hooks: the gateway (a child process) reads them from the environment
        os.environ["GRIDSERVE_TEST_HOOKS"] = os.environ["GRIDSERVE_TEST_MEDIA_LOOPBACK"] = "1"
        gateway_args += ["--allowed-media-domains", "localhost", "--media-fetch-timeout-s", "1"]
    vision = model_takes_images(model)
    launcher = Launcher(model, ENGINE_ARGS, log_dir=log_dir, edge_port=free_port(), gateway_args=gateway_args,
                        edge_limits=edge_limits(), grace_s=5.0)
    print(f"fuzz: {args.examples} requests, seed {seed}, {'a vision' if vision else 'a text-only'} model, "
          f"logs in {log_dir}", flush=True)
    media = MediaServer()
    try:
        launcher.start()
        fuzzer = Fuzzer(launcher.edge_address, model)
        start = time.monotonic()
        try:
            fuzz(fuzzer, openapi_of(launcher.edge_address), args.examples, seed, media, vision)
        finally:
            fuzzer.close()
        engine = next(p.address for p in launcher.processes if p.role == "engine")
        problems = settled(launcher.edge_address, engine, launcher.gateway_addresses[0])
        problems += media_problems(media, fetches_from_it=fetches)
    finally:
        launcher.stop()
        media.close()
    print(fuzzer.table())
    print(f"{time.monotonic() - start:.0f} s; afterwards: {'; '.join(problems) or 'SERVING, engine idle, no KV block in use'}")
    for failure in fuzzer.failures[:20]:
        print("FAIL", failure)
    return 1 if fuzzer.failures or problems else 0

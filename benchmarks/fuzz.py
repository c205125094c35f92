"""``gridserve bench fuzz``: generated hostile requests through the real Envoy edge, every answer checked.

For each of ``/v1/completions``, ``/v1/chat/completions``, ``/tokenize`` and ``/detokenize`` the
fuzzer sends bodies of every shape — near-valid requests whose fields are drawn from valid values,
extremes (2^63, 1e308, NaN, infinities), wrong types, huge strings and lists, unknown fields and
nested garbage (hypothesis strategies); raw bodies (invalid UTF-8, truncated or deeply nested JSON,
non-objects); and the cases schemathesis derives from the server's own ``/openapi.json`` (positive
and negative) — and native gRPC ``Generate`` requests drawn over every field of the proto.

A request passes when the answer comes within ``TIMEOUT_S`` (no hang) with a 2xx or 4xx status
(never 5xx), a 4xx body in OpenAI's error shape, a 2xx body that parses (each SSE event too, and an
in-band error is 4xx); a gRPC call ends OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED. Afterwards
health is SERVING and the engine holds no running or waiting request and no KV block. The counts
(requests per route, statuses seen) are printed. ``hypothesis`` and ``schemathesis`` come with the
``test`` extra; they are imported only when the fuzzer runs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable
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
        self._channel = grpc.insecure_channel(edge_address)

    def close(self) -> None:
        self._channel.close()

    def post(self, route: str, data: bytes, label: str) -> None:
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
        problem = http_problem(status, content_type, payload)
        if problem:
            self._fail(route, label, problem, data)

    def generate(self, request: Any, label: str) -> None:
        from gridserve.api.gateway.v1 import gateway_pb2_grpc

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


def fuzz(fuzzer: Fuzzer, openapi: dict[str, Any], examples: int, seed: int = 0) -> None:
    """About ``examples`` requests in all: per REST route, strategy bodies, raw bodies and
    schemathesis' (positive and negative); then gRPC ``Generate``."""
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


def run(args: argparse.Namespace) -> int:
    import tempfile

    from gridserve.launcher import Launcher, free_port

    model = args.model
    if model is None:
        from gridserve.demo.recipe import ensure_checkpoint

        model = str(ensure_checkpoint("llama", "tiny"))
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gridserve-fuzz-"))
    launcher = Launcher(model, ENGINE_ARGS, log_dir=log_dir, edge_port=free_port(), gateway_args=GATEWAY_ARGS,
                        edge_limits=edge_limits(), grace_s=5.0)
    print(f"fuzz: {args.examples} requests, seed {seed}, logs in {log_dir}", flush=True)
    try:
        launcher.start()
        fuzzer = Fuzzer(launcher.edge_address, model)
        start = time.monotonic()
        try:
            fuzz(fuzzer, openapi_of(launcher.edge_address), args.examples, seed)
        finally:
            fuzzer.close()
        engine = next(p.address for p in launcher.processes if p.role == "engine")
        problems = settled(launcher.edge_address, engine, launcher.gateway_addresses[0])
    finally:
        launcher.stop()
    print(fuzzer.table())
    print(f"{time.monotonic() - start:.0f} s; afterwards: {'; '.join(problems) or 'SERVING, engine idle, no KV block in use'}")
    for failure in fuzzer.failures[:20]:
        print("FAIL", failure)
    return 1 if fuzzer.failures or problems else 0

"""Observability of a running deployment: Prometheus metrics (engine, gateway, through the edge)
with exact counts after a known workload, one trace per request across gateway -> engine ->
worker, and JSON request log lines with the id the client sees.

One deployment for the module: worker, engine, gateway and Envoy, every role with a metrics port,
tracing to an in-test OTLP receiver and JSON logs. The KV cache holds 4 blocks of 16 tokens
(max_model_len 64), so two concurrent 60-token requests cannot both fit: exactly one is preempted.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gridserve.launcher import free_port
from gridserve.shared.config import GridserveConfig

from .otlp_receiver import otlp_receiver
from .services import deployment, gateway_stub, greedy, stream_tokens, token_prompt

pytestmark = pytest.mark.slow

BLOCK = 16
MAX_MODEL_LEN = 64
P1 = list(range(100, 140))  # 40 tokens
P2 = P1[:32] + list(range(500, 508))  # shares P1's first two full blocks: a 32-token prefix hit
A = list(range(1000, 1016))  # 16 tokens + 44 generated = 60: 4 blocks each, 8 > 4 -> one preemption
B = list(range(2000, 2016))
SHORT, LONG = 4, 44


@pytest.fixture(scope="module")
def observed(llama_tiny, tmp_path_factory):
    kv_per_token = GridserveConfig.from_kwargs(model=str(llama_tiny)).finalize().kv_bytes_per_token_per_rank()
    kv_bytes = 5 * BLOCK * kv_per_token  # 4 usable blocks + the null block
    engine_args = ["--kv-cache-memory-bytes", str(kv_bytes), "--max-model-len", str(MAX_MODEL_LEN),
                   "--block-size", str(BLOCK), "--max-num-seqs", "8"]
    saved = {k: os.environ.get(k) for k in ("OTEL_BSP_SCHEDULE_DELAY",)}
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # export spans within 0.1 s
    log_dir = tmp_path_factory.mktemp("logs")
    try:
        with otlp_receiver() as receiver:
            with deployment(llama_tiny, log_dir, edge_port=free_port(), engine_args=engine_args,
                            observability_args=["--log-format", "json",
                                                "--otlp-traces-endpoint", receiver.endpoint]) as launcher:
                yield launcher, receiver, log_dir
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _role(launcher, role: str):
    return next(p for p in launcher.processes if p.role == role)


def _scrape(address: str) -> dict[str, list]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


def _value(samples: dict, name: str, **labels) -> float:
    matching = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert matching, f"{name}{labels} not exported; have {sorted(samples)}"
    return sum(matching)


def _generate(launcher, ids: list[int], max_tokens: int) -> list[int]:
    import grpc

    with grpc.insecure_channel(launcher.gateway_addresses[0]) as channel:
        tokens, _, _ = stream_tokens(gateway_stub(channel), token_prompt(ids, greedy(max_tokens)))
    return tokens


ENGINE_COUNTERS = {
    "vllm:prompt_tokens_total": len(P1) + len(P2) + len(A) + len(B),
    "vllm:generation_tokens_total": 2 * SHORT + 2 * LONG,
    "vllm:num_preemptions_total": 1,
    # Only first admissions count (a resumed request's lookup is counted apart, as in vLLM).
    "vllm:prefix_cache_queries_total": len(P1) + len(P2) + len(A) + len(B),
    "vllm:prefix_cache_hits_total": 2 * BLOCK,
}
ENGINE_HISTOGRAM_COUNTS = {
    name: 4 for name in ("vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                         "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count",
                         "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count")
}
GATEWAY_COUNTS = {
    "vllm:time_to_first_token_seconds_count": 4,
    "vllm:e2e_request_latency_seconds_count": 4,
    "vllm:inter_token_latency_seconds_count": 2 * (SHORT - 1) + 2 * (LONG - 1),
}


def test_metrics_count_a_known_workload_with_a_preemption_and_a_prefix_hit(observed):
    launcher, _, _ = observed
    assert len(_generate(launcher, P1, SHORT)) == SHORT
    assert len(_generate(launcher, P2, SHORT)) == SHORT
    results = {}
    threads = [threading.Thread(target=lambda k=k, ids=ids: results.__setitem__(k, _generate(launcher, ids, LONG)))
               for k, ids in (("A", A), ("B", B))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [len(results[k]) for k in ("A", "B")] == [LONG, LONG]

    engine = _scrape(_role(launcher, "engine").metrics_address)
    gateway = _scrape(_role(launcher, "gateway").metrics_address)
    edge = _scrape(launcher.edge_address)
    for name, expected in ENGINE_COUNTERS.items():
        assert _value(engine, name, engine="0") == expected, name
        assert _value(gateway, name, engine="0") == expected, name  # merged into the gateway's
        assert _value(edge, name, engine="0") == expected, name  # and served by the edge
    for name, expected in ENGINE_HISTOGRAM_COUNTS.items():
        assert _value(engine, name) == expected, name
        assert _value(edge, name) == expected, name
    assert _value(engine, "vllm:request_prompt_tokens_sum") == ENGINE_COUNTERS["vllm:prompt_tokens_total"]
    assert _value(engine, "vllm:request_generation_tokens_sum") == ENGINE_COUNTERS["vllm:generation_tokens_total"]
    assert _value(engine, "vllm:iteration_tokens_total_count") > 0
    for name, expected in GATEWAY_COUNTS.items():
        assert _value(gateway, name) == expected, name
        assert _value(edge, name) == expected, name
    assert _value(gateway, "vllm:request_success_total", finished_reason="length") == 4
    # Idle: nothing running or waiting, nothing in flight; the cache config is described.
    for samples in (engine, edge):
        assert _value(samples, "vllm:num_requests_running") == 0
        assert _value(samples, "vllm:num_requests_waiting") == 0
        assert _value(samples, "vllm:cache_config_info", block_size=str(BLOCK)) == 1
    assert _value(gateway, "gridserve:gateway_requests_in_flight", engine="0") == 0
    assert _value(engine, "gridserve:engine_step_seconds_count") > 0
    assert _value(engine, "gridserve:collective_rpc_seconds_count") > 0
    worker = _scrape(_role(launcher, "worker").metrics_address)
    assert _value(worker, "gridserve:worker_execute_model_seconds_count", rank="0") > 0
    assert "metrics" in launcher.table() and f"http://{launcher.edge_address}/metrics" in launcher.table()


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def _rest_completion(launcher, body: dict, headers: dict) -> dict:
    req = urllib.request.Request(f"http://{launcher.edge_address}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_rest_request_with_traceparent_is_one_trace_across_gateway_engine_and_worker(observed):
    launcher, receiver, _ = observed
    out = _rest_completion(launcher, {"prompt": [7, 8, 9, 10], "max_tokens": 3, "min_tokens": 3},
                           {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
    request_id = out["id"].removeprefix("cmpl-")

    def complete(spans) -> bool:
        names = {s.name for s in spans if s.trace_id == TRACE_ID}
        return {"gateway_request", "llm_request", "worker_prefill", "decode", "generate_and_detokenize"} <= names

    spans = [s for s in receiver.wait_for(complete) if s.trace_id == TRACE_ID]
    by_name = {s.name: s for s in spans}
    assert {s.service for s in spans} == {"gridserve-gateway", "gridserve-engine", "gridserve-worker"}, spans
    gateway, engine, worker = by_name["gateway_request"], by_name["llm_request"], by_name["worker_prefill"]
    assert gateway.parent_span_id == CLIENT_SPAN
    assert engine.parent_span_id == gateway.span_id
    assert worker.parent_span_id == engine.span_id
    for child in ("validate_and_tokenize", "generate_and_detokenize"):
        assert by_name[child].parent_span_id == gateway.span_id
    for phase in ("queue", "prefill", "decode"):
        assert by_name[phase].parent_span_id == engine.span_id and by_name[phase].service == "gridserve-engine"
    assert by_name["queue"].end_ns <= by_name["prefill"].start_ns + 1 <= by_name["decode"].start_ns + 1
    # One tree: every span's parent is in the trace, except the root's (the client's span).
    ids = {s.span_id for s in spans}
    assert all(s.parent_span_id in ids for s in spans if s is not gateway)
    # The same request id everywhere.
    for span in (gateway, engine, worker):
        assert span.attributes["gen_ai.request.id"] == request_id
    assert engine.attributes["gen_ai.usage.completion_tokens"] == 3
    # The worker's step spans are their own traces, linked to the requests in the batch.
    steps = [s for s in receiver.spans if s.name == "execute_model" and (TRACE_ID, engine.span_id) in s.links]
    assert steps and all(s.trace_id != TRACE_ID for s in steps)


def _json_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def test_json_logs_have_one_finished_line_per_request_with_the_clients_id(observed):
    launcher, _, log_dir = observed
    out = _rest_completion(launcher, {"prompt": [11, 12, 13], "max_tokens": 2, "min_tokens": 2}, {})
    request_id = out["id"].removeprefix("cmpl-")
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        engine = [r for r in _json_lines(log_dir / "engine-0.log") if r.get("request_id") == request_id]
        gateway = [r for r in _json_lines(log_dir / "gateway-0.log") if r.get("request_id") == request_id]
        if engine and gateway:
            break
        time.sleep(0.1)
    assert len(engine) == 1 and len(gateway) == 1, (engine, gateway)
    assert engine[0]["role"] == "engine" and engine[0]["engine_request_id"] == request_id
    assert engine[0]["prompt_tokens"] == 3 and engine[0]["generation_tokens"] == 2
    assert engine[0]["finish_reason"] == "length" and "finished" in engine[0]["message"]
    assert gateway[0]["role"] == "gateway" and gateway[0]["generation_tokens"] == 2
    assert gateway[0]["e2e_s"] >= gateway[0]["ttft_s"] > 0
    assert all(r["level"] in ("DEBUG", "INFO", "WARNING", "ERROR") for r in _json_lines(log_dir / "worker-0.log"))

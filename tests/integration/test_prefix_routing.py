"""Cache-aware routing with real processes: 2 engines (each with its worker), the DP coordinator and
a gateway started with ``--routing-policy prefix``. A long prompt sent again goes back to the engine
that served it the first time, and is served from that engine's prefix cache; ``GetStatus`` (the
REST ``/v1/status``) shows each engine's hit rate.

Which engine served a request, and how many prompt tokens it found cached, come from each engine's
Prometheus ``/metrics`` (``vllm:request_prompt_tokens_count``, ``vllm:prefix_cache_hits_total``).
"""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gridserve.api.gateway.v1 import gateway_pb2

from .services import deployment, gateway_stub, greedy, token_prompt

pytestmark = pytest.mark.slow

BLOCK = 16  # the engines' default --block-size
PROMPT_LEN = 10 * BLOCK  # ten full blocks


@pytest.fixture(scope="module")
def dp(llama_tiny, tmp_path_factory):
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs"), data_parallel_size=2,
                    gateway_args=["--routing-policy", "prefix"]) as launcher:
        yield launcher


def _counter(engine, name: str) -> float:
    with urllib.request.urlopen(f"http://{engine.metrics_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name)


def _served_by(engines, send) -> tuple[int, float]:
    """Run ``send()``; the index of the engine that served it and the prompt tokens it found cached."""
    finished = [_counter(e, "vllm:request_prompt_tokens_count") for e in engines]
    hits = [_counter(e, "vllm:prefix_cache_hits_total") for e in engines]
    send()
    deadline = time.monotonic() + 10  # an engine records a finished request just after sending its output
    while True:
        served = [_counter(e, "vllm:request_prompt_tokens_count") - f for e, f in zip(engines, finished)]
        if sum(served) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert sorted(served) == [0, 1], served
    index = served.index(1)
    return index, _counter(engines[index], "vllm:prefix_cache_hits_total") - hits[index]


def test_a_repeated_long_prompt_goes_back_to_the_engine_that_cached_it(dp):
    engines = [p for p in dp.processes if p.role == "engine"]
    gateway = dp.gateway_addresses[0]
    # Five (an odd number): load routing's rotating ties alone would send each repeat to the other engine.
    prompts = [[10 + (97 * i + 31 * j) % 3000 for j in range(PROMPT_LEN)] for i in range(5)]
    with grpc.insecure_channel(gateway) as channel:
        stub = gateway_stub(channel)

        def send(prompt):
            return lambda: list(stub.Generate(token_prompt(prompt, greedy(2)), timeout=120))

        first = [_served_by(engines, send(p)) for p in prompts]
        assert {index for index, _ in first} == {0, 1}  # nothing cached yet: spread by load
        assert all(hits == 0 for _, hits in first)
        time.sleep(1.0)  # the engines' digests reach the gateway (well within: on every change)
        for prompt, (engine, _) in zip(prompts, first):
            again, hits = _served_by(engines, send(prompt))
            assert again == engine
            assert hits >= PROMPT_LEN - BLOCK  # every full block but the one holding the last token
        status = stub.GetStatus(gateway_pb2.GetStatusRequest(), timeout=10)
    rates = [e.prefix_cache_hit_rate for e in status.engines]
    assert all(0.0 < rate < 1.0 for rate in rates), rates
    assert all(e.prefix_cache_hits <= e.prefix_cache_queries for e in status.engines)

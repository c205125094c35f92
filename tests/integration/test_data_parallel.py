"""Data parallelism with real processes: 2 engines (each with its worker), 2 gateways, the DP
coordinator and the Envoy edge. Requests spread over both engines by load, outputs equal the
offline ``LLM``'s, a loaded engine is avoided, and a killed engine leaves the others serving.

Per-engine request counts come from each engine's Prometheus ``/metrics``
(``vllm:request_prompt_tokens_count``: one sample per finished request).
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gridserve import LLM, SamplingParams
from gridserve.launcher import free_port

from .services import KV_BYTES, deployment, gateway_stub, greedy, token_prompt

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
LONG = 505  # + the 5-token prompt: llama-tiny's 512 positions, less a few


@pytest.fixture(scope="module")
def dp(llama_tiny, tmp_path_factory):
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs"), edge_port=free_port(), api_server_count=2,
                    data_parallel_size=2) as launcher:
        yield launcher


def _engines(launcher):
    return [p for p in launcher.processes if p.role == "engine"]


def _finished(engine) -> int:
    with urllib.request.urlopen(f"http://{engine.metrics_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:request_prompt_tokens":
            return int(sum(s.value for s in family.samples if s.name.endswith("_count")))
    return 0


def _running(engine) -> int:
    with urllib.request.urlopen(f"http://{engine.metrics_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:num_requests_running":
            return int(sum(s.value for s in family.samples))
    return 0


def _prompt(i: int) -> list[int]:
    return [5 + i % 97, 17, 300 + i % 13, 42, 901]


def _generate(address: str, prompt: list[int], max_tokens: int = MAX_TOKENS, channel=None, **fields) -> list[int]:
    if channel is None:
        with grpc.insecure_channel(address) as own:
            return _generate(address, prompt, max_tokens, own, **fields)
    request = token_prompt(prompt, greedy(max_tokens))
    for name, value in fields.items():
        setattr(request, name, value)
    return [t for r in gateway_stub(channel).Generate(request, timeout=120) for t in r.token_ids]


def test_process_table_counts_a_plus_dp_plus_n_plus_coordinator(dp):
    table = dp.table()
    roles = [p.role for p in dp.processes]
    assert roles.count("engine") == 2 and roles.count("worker") == 2 and roles.count("coordinator") == 1
    assert roles.count("gateway") == 2
    assert "processes: A + DP + N (+1 coordinator when DP > 1) = 2 + 2 + 2 + 1 = 7" in table, table
    for engine in _engines(dp):  # a dense model: no MoE waves, no dummy steps
        with urllib.request.urlopen(f"http://{engine.metrics_address}/metrics", timeout=10) as resp:
            assert "gridserve:wave_dummy_steps" not in resp.read().decode()


def test_requests_spread_over_both_engines_with_dp1_outputs(dp, llama_tiny):
    engines = _engines(dp)
    before = [_finished(e) for e in engines]
    prompts = [_prompt(i) for i in range(100)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        outputs = list(pool.map(lambda p: _generate(dp.edge_address, p), prompts))
    served = [_finished(e) - b for e, b in zip(engines, before)]
    assert sum(served) == 100
    assert min(served) >= 30, served
    llm = LLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        refs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert outputs == [r.outputs[0].token_ids for r in refs]


def test_new_short_requests_avoid_the_loaded_engine(dp):
    engines = _engines(dp)
    gateway = dp.gateway_addresses[0]
    # The long requests fill llama-tiny's 512 positions; the short ones share one channel and take
    # one token each, so that they all run while the long ones do (the tiny model got fast enough
    # with the C++ layer ops to finish 400 tokens while 10 short requests opened 10 channels).
    with ThreadPoolExecutor(max_workers=8) as pool, grpc.insecure_channel(gateway) as channel:
        # Pin 6 long requests on engine 0 (an explicit data_parallel_rank wins over the load).
        long = [pool.submit(_generate, gateway, _prompt(500 + i), LONG, data_parallel_rank=0) for i in range(6)]
        deadline = time.monotonic() + 60
        while _running(engines[0]) < 6:
            assert time.monotonic() < deadline and not any(f.done() for f in long)
            time.sleep(0.05)
        time.sleep(0.5)  # the coordinator's snapshot reaches the gateways
        before = [_finished(e) for e in engines]
        for i in range(10):
            _generate(gateway, _prompt(700 + i), 1, channel)
        served = [_finished(e) - b for e, b in zip(engines, before)]
        assert served == [0, 10], served
        assert all(not f.done() for f in long)  # still loaded while the short ones ran
        for f in long:
            assert len(f.result(timeout=180)) == LONG


def test_killing_an_engine_keeps_the_others_serving(dp):
    engines = _engines(dp)
    victim = engines[1]
    gateway = dp.gateway_addresses[0]
    survivor_before = _finished(engines[0])
    with ThreadPoolExecutor(max_workers=4) as pool:
        moved = [pool.submit(_generate, gateway, _prompt(900 + i), 480, data_parallel_rank=1) for i in range(2)]
        deadline = time.monotonic() + 60
        while _running(victim) < 2:
            assert time.monotonic() < deadline and not any(f.done() for f in moved)
            time.sleep(0.05)
        os.kill(victim.pid, signal.SIGKILL)
        # Its in-flight requests continue on the surviving engine (failover) and complete.
        for future in moved:
            assert len(future.result(timeout=120)) == 480
    assert _finished(engines[0]) - survivor_before == 2
    # New requests (through the edge, to either gateway) all succeed on the surviving engine.
    for i in range(10):
        assert len(_generate(dp.edge_address, _prompt(950 + i), 3)) == 3
    with pytest.raises(grpc.RpcError) as err:
        _generate(gateway, _prompt(1), 2, data_parallel_rank=1)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_offline_llm_with_two_engines_equals_one(llama_tiny):
    prompts = [{"prompt_token_ids": _prompt(i)} for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    single = LLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES)
    try:
        expected = [r.outputs[0].token_ids for r in single.generate(prompts, params, use_tqdm=False)]
    finally:
        single.shutdown()
    llm = LLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES, data_parallel_size=2)
    try:
        assert len(llm.engines) == 2
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [r.outputs[0].token_ids for r in outputs] == expected
        served = [e.core.stats().num_prompt_tokens for e in llm.engines]
        assert all(n > 0 for n in served), served  # both engines ran prompts
    finally:
        llm.shutdown()

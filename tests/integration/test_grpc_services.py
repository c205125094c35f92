"""gateway -> engine -> worker as separate processes on loopback (one deployment for the module)."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gridserve import LLM, SamplingParams
from gridserve.api.common.v1 import common_pb2
from gridserve.api.engine.v1 import engine_pb2
from gridserve.api.gateway.v1 import gateway_pb2

from .services import (
    KV_BYTES,
    address,
    deployment,
    engine_stub,
    gateway_stub,
    greedy,
    stream_tokens,
    token_prompt,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpc_client.py"


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 4096) for _ in range(rng.randint(3, 40))] for _ in range(count)]


@pytest.fixture(scope="module")
def services(llama_tiny, tmp_path_factory):
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs")) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def reference(llama_tiny):
    """The in-process LLM on the same checkpoint."""
    llm = LLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def gateway(services):
    with grpc.insecure_channel(address(services, "gateway")) as channel:
        yield gateway_stub(channel)


@pytest.fixture(scope="module")
def engine(services):
    with grpc.insecure_channel(address(services, "engine")) as channel:
        yield engine_stub(channel)


def _reference_ids(llm: LLM, prompts: list[list[int]], n: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_every_role_reports_serving(services):
    for proc in services.processes:
        with grpc.insecure_channel(proc.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            status = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING, proc.role


def test_greedy_outputs_through_the_services_match_in_process_llm(gateway, reference):
    prompts = _prompts(8)
    expected = _reference_ids(reference, prompts)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: stream_tokens(gateway, token_prompt(p, greedy(MAX_TOKENS)))[0], prompts))
    assert got == expected


def test_text_prompt_streams_the_same_text_as_llm(gateway, reference):
    prompt = "def fibonacci(n):\n    return"
    out = reference.generate(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    request = gateway_pb2.GenerateRequest(text=prompt, sampling_params=common_pb2.SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS))
    ids, text, reason = stream_tokens(gateway, request)
    assert ids == out.outputs[0].token_ids and text == out.outputs[0].text
    assert common_pb2.FinishReason.Name(reason) == f"FINISH_REASON_{out.outputs[0].finish_reason.upper()}"


def test_seeded_sampling_with_logprobs_matches_llm(gateway, reference):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=42, max_tokens=MAX_TOKENS, logprobs=2)
    prompt = _prompts(1, seed=3)[0]
    out = reference.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    response = gateway.Complete(gateway_pb2.CompleteRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt),
        sampling_params=common_pb2.SamplingParams(temperature=0.8, top_p=0.9, seed=42,
                                                  max_tokens=MAX_TOKENS, logprobs=2)), timeout=60)
    completion = response.completions[0]
    assert list(completion.token_ids) == out.token_ids
    assert completion.cumulative_logprob == pytest.approx(out.cumulative_logprob, abs=1e-5)
    first = {c.token_id: c.logprob for c in completion.logprobs[0].candidates}
    assert first == pytest.approx({t: lp.logprob for t, lp in out.logprobs[0].items()}, abs=1e-6)


def test_n_completions_through_the_gateway_match_llm(gateway, reference):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = _prompts(1, seed=4)[0]
    expected = reference.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs
    response = gateway.Complete(gateway_pb2.CompleteRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt),
        sampling_params=common_pb2.SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS,
                                                  ignore_eos=True)), timeout=60)
    got = sorted(response.completions, key=lambda c: c.index)
    assert [c.index for c in got] == [0, 1, 2]
    assert [list(c.token_ids) for c in got] == [c.token_ids for c in expected]


def test_stop_string_ends_the_stream_without_the_stop_text(gateway):
    request = gateway_pb2.GenerateRequest(text="x = 1", sampling_params=greedy(MAX_TOKENS))
    _, full, _ = stream_tokens(gateway, request)
    stop = full[3:6]
    assert stop
    request.sampling_params.CopyFrom(common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop]))
    _, text, reason = stream_tokens(gateway, request)
    assert text == full[: full.index(stop)]
    assert reason == common_pb2.FINISH_REASON_STOP


def test_invalid_sampling_value_is_invalid_argument_naming_the_field(gateway):
    request = gateway_pb2.CompleteRequest(text="hi", sampling_params=common_pb2.SamplingParams(top_p=2.0))
    with pytest.raises(grpc.RpcError) as info:
        gateway.Complete(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.top_p" in info.value.details()


def test_tokenize_detokenize_chat_and_models(gateway, reference):
    tokenizer = reference.get_tokenizer()
    ids = list(gateway.Tokenize(gateway_pb2.TokenizeRequest(text="hello world"), timeout=10).token_ids)
    assert ids == tokenizer.encode("hello world")
    text = gateway.Detokenize(gateway_pb2.DetokenizeRequest(token_ids=ids), timeout=10).text
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "Write a loop."}]
    expected = reference.chat(messages, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    chat = gateway.Chat(gateway_pb2.ChatRequest(
        messages=[gateway_pb2.ChatMessage(**m) for m in messages],
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=8)), timeout=60)
    assert chat.message.content == expected.outputs[0].text
    assert chat.usage.prompt_tokens == len(expected.prompt_token_ids)
    models = gateway.ListModels(gateway_pb2.ListModelsRequest(), timeout=10).models
    assert [m.max_model_len for m in models] == [reference.config.max_model_len]


def test_cancelled_stream_frees_its_kv_blocks(gateway, engine):
    call = gateway.Generate(token_prompt(_prompts(1, seed=9)[0], greedy(400, ignore_eos=True)), timeout=60)
    next(call), next(call)
    assert engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=5).num_running == 1
    call.cancel()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        load = engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
        if load.num_running == 0 and load.kv_free_blocks == load.kv_total_blocks:
            break
        time.sleep(0.05)
    assert load.num_running == 0 and load.num_waiting == 0
    assert load.kv_free_blocks == load.kv_total_blocks > 0


def test_hundred_concurrent_streams_all_complete_correctly(gateway, reference):
    distinct = _prompts(10, seed=5)
    expected = _reference_ids(reference, distinct, 8)
    prompts = [distinct[i % 10] for i in range(100)]
    with ThreadPoolExecutor(100) as pool:
        results = list(pool.map(lambda p: stream_tokens(gateway, token_prompt(p, greedy(8)), timeout=120), prompts))
    assert all(reason == common_pb2.FINISH_REASON_LENGTH for _, _, reason in results)
    assert [ids for ids, _, _ in results] == [expected[i % 10] for i in range(100)]


@pytest.mark.parametrize("level", [1, 2])
def test_generation_after_sleep_and_wake_up_is_identical(gateway, engine, level):
    request = token_prompt(_prompts(1, seed=11)[0], greedy(MAX_TOKENS))
    before = stream_tokens(gateway, request)[0]
    engine.Sleep(engine_pb2.SleepRequest(level=level), timeout=60)
    assert engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=5).sleeping
    with pytest.raises(grpc.RpcError) as info:
        stream_tokens(gateway, request)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    engine.WakeUp(engine_pb2.WakeUpRequest(), timeout=120)
    assert stream_tokens(gateway, request)[0] == before


def test_example_client_streams_a_completion(services):
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), address(services, "gateway"), "def f(x):", "--max-tokens", "6"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert result.stdout.startswith("def f(x):")
    assert "[FINISH_REASON_LENGTH, 6 tokens]" in result.stdout


def test_reflection_lists_the_services(services):
    expected = {"gateway": "gridserve.gateway.v1.Gateway", "engine": "gridserve.engine.v1.EngineCore",
                "worker": "gridserve.worker.v1.Worker"}
    for proc in services.processes:
        with grpc.insecure_channel(proc.address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            response = next(stub.ServerReflectionInfo(iter([request]), timeout=5))
        names = {s.name for s in response.list_services_response.service}
        assert {expected[proc.role], "grpc.health.v1.Health"} <= names, proc.role

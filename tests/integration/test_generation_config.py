"""The checkpoint's ``generation_config.json`` sets the sampling defaults, end to end: offline ``LLM``
without sampling parameters, and a served model's OpenAI routes and typed gRPC API (gateway ->
engine -> worker processes), observed through the tokens: the file says temperature 0, so a request
that leaves temperature out is greedy (the same tokens as an explicit greedy request), and its
``max_new_tokens`` bounds a request that gives no length; ``--generation-config vllm`` ignores it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest
from google.api import httpbody_pb2

from gridserve import LLM, SamplingParams
from gridserve.api.common.v1 import common_pb2
from gridserve.api.gateway.v1 import gateway_pb2

from .services import ENGINE_ARGS, KV_BYTES, address, deployment, gateway_stub

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 6
PROMPTS = [[5, 17, 99, 230, 41], [7, 7, 300, 12], [1, 450, 33, 98, 120, 64, 2000], [600, 601, 602]]


@pytest.fixture(scope="module")
def greedy_checkpoint(llama_tiny, tmp_path_factory) -> Path:
    """The tiny llama whose creator recommends greedy decoding and at most 6 new tokens."""
    folder = tmp_path_factory.mktemp("greedy-llama")
    for path in llama_tiny.iterdir():
        if path.is_file():
            shutil.copy(path, folder / path.name)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def greedy_reference(greedy_checkpoint):
    """The LLM and the explicitly greedy outputs (6 tokens, or fewer at EOS) of every prompt."""
    llm = LLM(model=str(greedy_checkpoint), kv_cache_memory_bytes=KV_BYTES)
    try:
        yield llm, _outputs(llm, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS))
    finally:
        llm.shutdown()


def _outputs(llm: LLM, params: SamplingParams | None) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _token_ids(llm: LLM, params: SamplingParams | None) -> list[list[int]]:
    return [o.token_ids for o in _outputs(llm, params)]


def test_llm_without_sampling_params_uses_the_models_generation_config(greedy_reference):
    llm, greedy = greedy_reference
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    expected = [o.token_ids for o in greedy]
    assert _token_ids(llm, None) == expected
    assert _token_ids(llm, None) == expected  # greedy: the same again


def test_llm_with_generation_config_vllm_samples_with_the_neutral_defaults(greedy_checkpoint, greedy_reference):
    greedy = [o.token_ids for o in greedy_reference[1]]
    llm = LLM(model=str(greedy_checkpoint), kv_cache_memory_bytes=KV_BYTES, generation_config="vllm")
    try:
        assert llm.get_default_sampling_params() == SamplingParams()
        sampled = _token_ids(llm, None)
        seeded = [_token_ids(llm, SamplingParams(seed=s, max_tokens=MAX_NEW_TOKENS))[0] for s in range(4)]
    finally:
        llm.shutdown()
    assert any(len(ids) > MAX_NEW_TOKENS for ids in sampled)  # SamplingParams' 16 tokens, not the file's 6
    assert any(ids != greedy[0] for ids in seeded)  # temperature 1: seeded samples leave the greedy path


@pytest.fixture(scope="module")
def served(greedy_checkpoint, tmp_path_factory):
    with deployment(greedy_checkpoint, tmp_path_factory.mktemp("logs"), engine_args=ENGINE_ARGS) as launcher:
        with grpc.insecure_channel(address(launcher, "gateway")) as channel:
            yield gateway_stub(channel)


def _openai(stub, method: str, body: dict) -> dict:
    request = httpbody_pb2.HttpBody(content_type="application/json", data=json.dumps(body).encode())
    return json.loads(b"".join(part.data for part in getattr(stub, method)(request, timeout=60)))


def test_served_requests_that_leave_temperature_out_are_greedy(served, greedy_reference):
    for prompt, expected in zip(PROMPTS, greedy_reference[1]):
        body = _openai(served, "OpenAICompletions", {"prompt": prompt, "max_tokens": MAX_NEW_TOKENS})
        assert body["choices"][0]["text"] == expected.text
        typed = served.Complete(gateway_pb2.CompleteRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt), sampling_params=common_pb2.SamplingParams()), timeout=60)
        assert list(typed.completions[0].token_ids) == expected.token_ids  # temperature, max_tokens: the file's


def test_a_served_chat_without_max_tokens_stops_at_the_files_max_new_tokens(served):
    body = _openai(served, "OpenAIChatCompletions", {"messages": [{"role": "user", "content": "def f():"}],
                                                      "ignore_eos": True})
    assert body["usage"]["completion_tokens"] == MAX_NEW_TOKENS
    assert body["choices"][0]["finish_reason"] == "length"
    explicit = _openai(served, "OpenAIChatCompletions", {"messages": [{"role": "user", "content": "def f():"}],
                                                          "ignore_eos": True, "max_tokens": MAX_NEW_TOKENS + 3})
    assert explicit["usage"]["completion_tokens"] == MAX_NEW_TOKENS + 3

"""OpenAI JSON -> prompts / SamplingParams and errors (services/gateway/openai_api.py), no server."""

from __future__ import annotations

import json

import pytest

from gridserve.services.gateway.openai_api import (
    DONE,
    ApiError,
    chat_messages,
    chat_request,
    completion_request,
    parse_body,
    sse,
    to_api_error,
)
from gridserve.shared.errors import EngineDeadError, InvalidArgumentError


@pytest.mark.parametrize("prompt, expected", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [{"prompt_token_ids": [1, 2, 3]}]),
    ([[1, 2], [3]], [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]),
])
def test_prompt_forms(prompt, expected):
    prompts, _ = completion_request({"prompt": prompt})
    assert prompts == expected


@pytest.mark.parametrize("prompt", [None, 3, [], [1, "a"], [[1], []], {"x": 1}])
def test_bad_prompt_names_the_field(prompt):
    with pytest.raises(ApiError) as err:
        completion_request({"prompt": prompt})
    assert err.value.status == 400 and err.value.param == "prompt"


def test_completion_fields_map_onto_sampling_params_and_unknown_ones_are_ignored():
    _, params = completion_request({
        "prompt": "x", "n": 2, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "seed": 3, "presence_penalty": 0.2, "frequency_penalty": 0.3, "repetition_penalty": 1.1,
        "logit_bias": {"17": -100}, "logprobs": 2, "stop": "\n", "user": "u", "no_such_field": 1,
    })
    assert (params.n, params.max_tokens, params.temperature, params.top_p, params.top_k) == (2, 7, 0.5, 0.9, 5)
    assert (params.min_p, params.seed, params.logprobs, params.stop) == (0.1, 3, 2, ["\n"])
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.2, 0.3, 1.1)
    assert params.logit_bias == {17: -100.0}
    _, params = completion_request({"prompt": "x", "stop": ["a", "b"], "top_k": -1})
    assert params.stop == ["a", "b"] and params.top_k == 0 and params.max_tokens == 16


def test_chat_fields():
    params = chat_request({"max_tokens": 5, "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 3})
    assert params.max_tokens == 9 and params.logprobs == 3
    assert chat_request({}).logprobs is None and chat_request({}).max_tokens is None
    params = chat_request({"response_format": {"type": "json_object"}})
    assert params.structured_outputs.json_object
    schema = {"type": "object"}
    params = chat_request({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}})
    assert params.structured_outputs.json == schema
    messages = chat_messages({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format"),
])
def test_wrong_types_are_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as err:
        completion_request(body)
    assert err.value.status == 400 and err.value.param == param
    error = json.loads(err.value.body())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param


def test_error_mapping_and_body_parsing():
    err = to_api_error(InvalidArgumentError("sampling_params.temperature", "must be >= 0"))
    assert (err.status, err.param) == (400, "temperature") and "temperature" in err.message
    assert to_api_error(EngineDeadError("down")).status == 503
    with pytest.raises(ApiError):
        parse_body(b"{not json")
    with pytest.raises(ApiError):
        parse_body(b"[1]")
    with pytest.raises(ApiError):
        chat_messages({"messages": []})
    assert parse_body(b"") == {}


def test_sse_framing():
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert DONE == b"data: [DONE]\n\n"


class _FakeTokenizer:
    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != 1)


class _FakeService:
    """Just enough of GatewayService: a stream that fails after its first chunk."""

    model_name = "m"
    max_model_len = 64

    def __init__(self):
        from types import SimpleNamespace

        self.tokenizer = _FakeTokenizer()
        self.input_processor = SimpleNamespace(vocab_size=128)
        self.closed = 0

    def chat_prompt(self, messages, template, add_generation_prompt):
        return {"prompt_token_ids": self.tokenizer.encode(messages[-1]["content"])}

    def generate(self, prompt, params, request_id, on_done, traceparent="", data_parallel_rank=None):
        from gridserve.services.gateway.service import SampleDelta, StreamChunk

        try:
            yield StreamChunk("r", [SampleDelta(0, "a", [97])], 3)
            raise EngineDeadError("engine 127.0.0.1:1: UNAVAILABLE")
        finally:
            self.closed += 1

    async def generate_async(self, prompt, params, request_id="", traceparent="", data_parallel_rank=None):
        for chunk in self.generate(prompt, params, request_id, None, traceparent, data_parallel_rank):
            yield chunk


def _events(response) -> list:
    return [chunk.decode().removeprefix("data: ").strip() for chunk in response.chunks]


def test_error_after_the_stream_started_is_sent_in_band_then_done():
    from gridserve.services.gateway.openai_api import OpenAIApi

    service = _FakeService()
    api = OpenAIApi(service, "m")
    response = api.completions(json.dumps({"prompt": "hi", "stream": True}).encode(), lambda fn: None)
    assert response.status == 200
    events = _events(response)
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    error = json.loads(events[1])["error"]
    assert error["code"] == 503 and "UNAVAILABLE" in error["message"]
    assert events[2:] == ["[DONE]"] and service.closed == 1

    response = api.chat_completions(json.dumps({"messages": [{"role": "user", "content": "x"}],
                                                "stream": True}).encode(), lambda fn: None)
    events = _events(response)
    assert json.loads(events[-2])["error"]["type"] == "ServiceUnavailableError" and events[-1] == "[DONE]"


def test_streamed_echo_of_a_token_id_prompt_is_its_text():
    from gridserve.services.gateway.openai_api import OpenAIApi

    api = OpenAIApi(_FakeService(), "m")
    body = {"prompt": [ord("h"), ord("i")], "stream": True, "echo": True}
    events = _events(api.completions(json.dumps(body).encode(), lambda fn: None))
    assert json.loads(events[0])["choices"][0]["text"] == "hia"


def test_tokenize_and_detokenize_routes():
    from gridserve.services.gateway.openai_api import OpenAIApi

    api = OpenAIApi(_FakeService(), "m")
    response = api.tokenize(b'{"prompt": "hi", "return_token_strs": true}')
    assert response.status == 200
    assert json.loads(b"".join(response.chunks)) == {"count": 3, "max_model_len": 64, "tokens": [1, 104, 105],
                                                      "token_strs": ["", "h", "i"]}
    body = json.loads(b"".join(api.tokenize(b'{"prompt": "hi", "add_special_tokens": false}').chunks))
    assert body["tokens"] == [104, 105]
    assert json.loads(b"".join(api.detokenize(b'{"tokens": [104, 105]}').chunks)) == {"prompt": "hi"}
    for route, data, param in [(api.tokenize, b"{}", "prompt"), (api.detokenize, b'{"tokens": [500]}', "tokens"),
                               (api.detokenize, b'{"tokens": "x"}', "tokens")]:
        response = route(data)
        assert response.status == 400
        assert json.loads(b"".join(response.chunks))["error"]["param"] == param
    assert api.tokenize(b'{"prompt": "x", "model": "other"}').status == 404


async def _aevents(response) -> list:
    return [chunk.decode().removeprefix("data: ").strip() async for chunk in response.chunks]


def _norm(events: list) -> list:
    """Events without their ``created`` second (two runs may straddle one)."""
    return [e if e == "[DONE]" else {k: v for k, v in json.loads(e).items() if k != "created"} for e in events]


def test_asyncio_streams_send_the_same_events_and_in_band_errors():
    """The gateway serves streams on its asyncio loop (``*_async``): same events as the blocking
    path, the error in band then [DONE], the request stream closed."""
    import asyncio

    from gridserve.services.gateway.openai_api import OpenAIApi

    async def go():
        service = _FakeService()
        api = OpenAIApi(service, "m")
        for body in ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}},
                     {"prompt": [ord("h"), ord("i")], "stream": True, "echo": True}):
            data = json.dumps(body).encode()
            sync_events = _events(api.completions(data, lambda fn: None))
            response = await api.completions_async(data, lambda fn: None)
            assert response.status == 200
            assert _norm(await _aevents(response)) == _norm(sync_events)
        assert json.loads(sync_events[0])["choices"][0]["text"] == "hia"
        assert json.loads(sync_events[1])["error"]["code"] == 503 and sync_events[-1] == "[DONE]"
        assert service.closed == 4
        data = json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": True}).encode()
        events = _norm(await _aevents(await api.chat_completions_async(data, lambda fn: None)))
        assert events == _norm(_events(api.chat_completions(data, lambda fn: None)))
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert events[-2]["error"]["type"] == "ServiceUnavailableError" and events[-1] == "[DONE]"
        # A bad request is answered before any event, as on the blocking path.
        response = await api.completions_async(json.dumps({"prompt": "x", "stream": True, "n": 0}).encode(),
                                               lambda fn: None)
        assert response.status == 400 and json.loads(b"".join(response.chunks))["error"]["param"] == "n"

    asyncio.run(go())

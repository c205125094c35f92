"""The declared OpenAI protocol (services/gateway/protocol.py): bodies to SamplingParams, types,
ranges and caps as data, errors naming the field (unknown fields: test_openai_fields.py)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from gridserve.services.gateway.api_errors import from_validation_error
from gridserve.services.gateway.limits import RequestLimits
from gridserve.services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)

DEFAULT = RequestLimits()


def _completion(body: dict, limits: RequestLimits = DEFAULT) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps(body), context={"limits": limits})


def _refusal(model, body, limits: RequestLimits = DEFAULT):
    with pytest.raises(ValidationError) as err:
        model.model_validate_json(json.dumps(body), context={"limits": limits})
    return from_validation_error(err.value)


@pytest.mark.parametrize("prompt, expected", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_forms(prompt, expected):
    assert _completion({"prompt": prompt}).prompts() == expected


@pytest.mark.parametrize("prompt", [None, 3, [], [1, "a"], [[1], []], {"x": 1}, [True]])
def test_bad_prompt_names_the_field(prompt):
    error = _refusal(CompletionRequest, {"prompt": prompt})
    assert error.status == 400 and error.param == "prompt"


def test_completion_fields_map_onto_sampling_params():
    request = _completion({
        "prompt": "x", "n": 2, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "seed": 3, "presence_penalty": 0.2, "frequency_penalty": 0.3, "repetition_penalty": 1.1,
        "logit_bias": {"17": -100}, "logprobs": 2, "stop": "\n", "user": "u",
    })
    params = request.to_sampling_params(request.max_tokens, request.logprobs)
    assert (params.n, params.max_tokens, params.temperature, params.top_p, params.top_k) == (2, 7, 0.5, 0.9, 5)
    assert (params.min_p, params.seed, params.logprobs, params.stop) == (0.1, 3, 2, ["\n"])
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.2, 0.3, 1.1)
    assert params.logit_bias == {17: -100.0}
    request = _completion({"prompt": "x", "stop": ["a", "b"], "top_k": -1})
    params = request.to_sampling_params(request.max_tokens, None)
    assert params.stop == ["a", "b"] and params.top_k == 0 and params.max_tokens == 16


def test_chat_fields():
    def params(body):
        return ChatCompletionRequest.model_validate_json(json.dumps({"messages": [{"role": "user"}], **body}))\
            .to_params()

    chosen = params({"max_tokens": 5, "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 3})
    assert chosen.max_tokens == 9 and chosen.logprobs == 3
    assert params({}).logprobs is None and params({}).max_tokens is None
    assert params({"response_format": {"type": "json_object"}}).structured_outputs.json_object
    schema = {"type": "object"}
    so = params({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert so.structured_outputs.json == schema
    assert params({"structured_outputs": {"regex": "[a-z]+"}}).structured_outputs.regex == "[a-z]+"
    request = ChatCompletionRequest.model_validate_json(json.dumps(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                   {"type": "image_url", "image_url": {"url": "x"}}]}],
         "tools": [{"type": "function", "function": {"name": "f"}}]}))
    # An image part is kept for the route (which loads it, or refuses it for a text-only model).
    assert request.template_messages() == [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]}]
    assert request.template_tools() == [{"type": "function", "function": {"name": "f"}}]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "n": "2"}, "n"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format"),
])
def test_wrong_types_are_400_naming_the_field(body, param):
    error = _refusal(CompletionRequest, body)
    assert error.status == 400 and error.param == param
    body = json.loads(error.body())["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["param"] == param
    assert body["message"].startswith(param)


@pytest.mark.parametrize("content, path", [
    ([{"type": "image_url"}], "messages[0].content[0]: an image_url part needs"),
    ([{"type": "image_url", "image_url": {"url": ""}}], "messages[0].content[0].image_url.url: "),
    ([{"type": "text", "text": "a"}, {"type": "text", "text": None}], "messages[0].content[1]: a text part"),
    ([{"type": "text"}], "messages[0].content[0]: a text part needs text"),
    ([{"type": "audio"}], "messages[0].content[0].type: "),
    (5, "messages[0].content: Input should be a valid string or Input should be a valid "),
])
def test_a_bad_content_part_is_named_by_its_path_not_by_the_union_member(content, path):
    # `content` is a string or a list of parts: pydantic fails it once per member ("str",
    # "list[...]"); the error names the part that is wrong, never a member's type name.
    error = _refusal(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": content}]})
    assert error.status == 400 and error.param == "messages"
    assert error.message.startswith(path), error.message
    assert ".str" not in error.message and "list[" not in error.message


def test_a_body_that_is_not_an_object_or_not_json_is_400_without_a_field():
    for data in (b"{not json", b"[1]", b"\xff\xfe"):
        with pytest.raises(ValidationError) as err:
            CompletionRequest.model_validate_json(data)
        error = from_validation_error(err.value)
        assert error.status == 400 and error.param is None


def test_tokenize_takes_a_prompt_or_messages():
    assert TokenizeRequest.model_validate_json(b'{"prompt": "x"}').prompt == "x"
    request = TokenizeRequest.model_validate_json(b'{"messages": [{"role": "user", "content": "x"}]}')
    assert request.messages[0].text() == "x"

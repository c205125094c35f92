"""No request field is dropped silently: every field of completions, chat and responses is honoured
(its effect checked) or refused with a 400 naming it — one case per row of
docs/serving/openai-fields.md, and the page, the request models and ``/openapi.json`` list the same
fields."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Union

import pytest

from gridserve.services.gateway.chat_options import ChatOptions
from gridserve.services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
)
from gridserve.services.gateway.responses_api import ResponsesAPI
from gridserve.services.gateway.responses_protocol import ResponsesRequest
from gridserve.services.gateway.responses_store import ResponseStore
from tests.unit.gateway.scripted_engine import (
    FIM_TOKENS,
    THINK_TOKENS,
    routes,
    run,
    tokenizer_folder,
)

DOC = Path(__file__).resolve().parents[3] / "docs" / "serving" / "openai-fields.md"
REFUSED = "400"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
Check = Union[str, Callable[[Any], Any]]


def params(r):
    return r.engine.params[-1]


# (endpoint: "both" | "completions" | "chat", field, request fragment, REFUSED or a check of the result)
CASES: list[tuple[str, str, dict, Check]] = [
    ("both", "model", {"model": "m"}, lambda r: r.status == 200),
    ("completions", "prompt", {"prompt": [5, 6]}, lambda r: r.engine.prompts[-1] == [5, 6]),
    ("chat", "messages", {}, lambda r: "say hi" in r.prompt),
    ("both", "max_tokens", {"max_tokens": 3}, lambda r: params(r).max_tokens == 3),
    ("chat", "max_completion_tokens", {"max_tokens": 9, "max_completion_tokens": 3}, lambda r: params(r).max_tokens == 3),
    ("both", "n", {"n": 2}, lambda r: len(r.body["choices"]) == 2),
    ("both", "best_of", {"n": 2, "best_of": 2}, lambda r: len(r.body["choices"]) == 2),
    ("both", "best_of", {"best_of": 3}, REFUSED),
    ("both", "temperature", {"temperature": 0.5}, lambda r: params(r).temperature == 0.5),
    ("both", "top_p", {"top_p": 0.5}, lambda r: params(r).top_p == 0.5),
    ("both", "top_k", {"top_k": 5}, lambda r: params(r).top_k == 5),
    ("both", "min_p", {"min_p": 0.1}, lambda r: params(r).min_p == 0.1),
    ("both", "seed", {"seed": 7}, lambda r: params(r).seed == 7),
    ("both", "presence_penalty", {"presence_penalty": 0.5}, lambda r: params(r).presence_penalty == 0.5),
    ("both", "frequency_penalty", {"frequency_penalty": 0.5}, lambda r: params(r).frequency_penalty == 0.5),
    ("both", "repetition_penalty", {"repetition_penalty": 1.2}, lambda r: params(r).repetition_penalty == 1.2),
    ("both", "logit_bias", {"logit_bias": {"5": 2.0}}, lambda r: params(r).logit_bias == {5: 2.0}),
    ("both", "stop", {"stop": ["lo"]}, lambda r: r.text == "hel" and params(r).stop == ["lo"]),
    ("both", "stop_token_ids", {"stop_token_ids": [7]}, lambda r: params(r).stop_token_ids == [7]),
    ("both", "ignore_eos", {"ignore_eos": True}, lambda r: params(r).ignore_eos),
    ("both", "min_tokens", {"min_tokens": 2}, lambda r: params(r).min_tokens == 2),
    ("both", "bad_words", {"bad_words": ["foo"]}, lambda r: params(r).bad_words_token_ids),
    ("both", "allowed_token_ids", {"allowed_token_ids": [5, 6]}, lambda r: params(r).allowed_token_ids == [5, 6]),
    ("both", "include_stop_str_in_output", {"stop": ["lo"], "include_stop_str_in_output": True},
     lambda r: r.text == "hello"),
    ("both", "skip_special_tokens", {"skip_special_tokens": False}, lambda r: params(r).skip_special_tokens is False),
    ("both", "spaces_between_special_tokens", {"spaces_between_special_tokens": False},
     lambda r: params(r).spaces_between_special_tokens is False),
    ("both", "truncate_prompt_tokens", {"truncate_prompt_tokens": 2}, lambda r: len(r.engine.prompts[-1]) == 2),
    ("completions", "logprobs", {"logprobs": 1}, lambda r: r.body["choices"][0]["logprobs"]["token_logprobs"]),
    ("chat", "logprobs", {"logprobs": True}, lambda r: r.body["choices"][0]["logprobs"]["content"]),
    ("chat", "top_logprobs", {"logprobs": True, "top_logprobs": 2}, lambda r: params(r).logprobs == 2),
    ("completions", "prompt_logprobs", {"prompt_logprobs": 1}, lambda r: r.body["choices"][0]["prompt_logprobs"][1]),
    ("chat", "prompt_logprobs", {"prompt_logprobs": 1}, lambda r: r.body["prompt_logprobs"][0] is None),
    ("both", "prompt_logprobs", {"prompt_logprobs": 1, "stream": True}, REFUSED),
    ("completions", "echo", {"prompt": "say", "echo": True}, lambda r: r.text == "sayhello"),
    ("completions", "echo", {"prompt": "say", "echo": True, "logprobs": 0},
     lambda r: r.body["choices"][0]["logprobs"]["token_logprobs"][0] is None),
    ("completions", "suffix", {"suffix": "end"}, REFUSED),  # this tokenizer has no FIM tokens
    ("both", "stream", {"stream": True}, lambda r: r.text == "hello"),
    ("both", "stream_options", {"stream_options": {"include_usage": True}}, REFUSED),  # without stream
    ("both", "stream_options.include_usage", {"stream": True, "stream_options": {"include_usage": True}},
     lambda r: r.events[-1]["usage"]["completion_tokens"] > 0),
    ("both", "stream_options.continuous_usage_stats",
     {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     lambda r: all(e["usage"]["completion_tokens"] > 0 for e in r.events[1:])),
    ("both", "stream_options.include_obfuscation", {"stream": True, "stream_options": {"include_obfuscation": True}},
     REFUSED),
    ("both", "response_format", {"response_format": {"type": "json_object"}},
     lambda r: params(r).structured_outputs.json_object),
    ("both", "structured_outputs", {"structured_outputs": {"regex": "[a-z]+"}},
     lambda r: params(r).structured_outputs.regex == "[a-z]+"),
    ("both", "user", {"user": "alice"}, lambda r: r.status == 200),
    ("both", "data_parallel_rank", {"data_parallel_rank": 0}, lambda r: r.status == 200),
    ("both", "data_parallel_rank", {"data_parallel_rank": 1}, REFUSED),
    ("both", "priority", {"priority": 0}, lambda r: r.status == 200),
    ("both", "priority", {"priority": -1}, REFUSED),  # no --allow-client-priority (test_priority_field.py)
    ("both", "cache_salt", {"cache_salt": "tenant-a"}, lambda r: r.status == 200),  # test_cache_salt.py: the engine
    ("both", "cache_salt", {"cache_salt": ""}, REFUSED),
    # beam search: one-token steps with 2 x n logprobs (tests/unit/gateway/test_beam_search.py: the results)
    ("both", "use_beam_search", {"use_beam_search": True, "n": 2, "max_tokens": 2},
     lambda r: params(r).max_tokens == 1 and params(r).logprobs == 4),
    ("both", "use_beam_search", {"use_beam_search": "yes"}, REFUSED),
    ("both", "stream", {"use_beam_search": True, "stream": True}, REFUSED),
    ("both", "n", {"use_beam_search": True, "n": 11}, REFUSED),  # 2 x 11 logprobs > --max-logprobs 20
    ("both", "temperature", {"use_beam_search": True, "temperature": 0.7}, REFUSED),
    ("both", "length_penalty", {"use_beam_search": True, "length_penalty": 2.0, "max_tokens": 2},
     lambda r: params(r).max_tokens == 1),
    ("both", "length_penalty", {"length_penalty": 2.0}, REFUSED),  # without use_beam_search
    ("both", "early_stopping", {"use_beam_search": True, "early_stopping": "never", "max_tokens": 2},
     lambda r: params(r).max_tokens == 1),
    ("both", "early_stopping", {"early_stopping": True}, REFUSED),
    ("chat", "chat_template", {"chat_template": "{{ messages[0].content }}"}, REFUSED),  # no trust flag
    ("chat", "add_generation_prompt", {"add_generation_prompt": False},
     lambda r: not r.prompt.endswith("assistant\n")),
    ("chat", "chat_template_kwargs", {"chat_template_kwargs": {"enable_thinking": False}},
     lambda r: r.prompt.endswith("</think>\n\n")),
    ("chat", "tools", {"tools": TOOLS, "tool_choice": "none"}, lambda r: '"name": "f"' in r.prompt),
    ("chat", "tool_choice", {"tools": TOOLS, "tool_choice": "required"}, lambda r: params(r).structured_outputs.json),
    ("chat", "parallel_tool_calls", {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
     lambda r: params(r).structured_outputs.json["maxItems"] == 1),
    ("chat", "reasoning_effort", {"reasoning_effort": "low"}, lambda r: r.prompt.endswith("(effort low)")),
    ("chat", "store", {"store": False}, lambda r: r.status == 200),
    ("chat", "store", {"store": True}, REFUSED),
    ("chat", "metadata", {"metadata": {"team": "a"}}, lambda r: r.status == 200),
    ("chat", "metadata", {"metadata": {str(i): "x" for i in range(17)}}, REFUSED),
    ("chat", "service_tier", {"service_tier": "default"}, lambda r: r.status == 200),
    ("chat", "service_tier", {"service_tier": "flex"}, REFUSED),
    ("chat", "modalities", {"modalities": ["text"]}, lambda r: r.status == 200),
    ("chat", "modalities", {"modalities": ["text", "audio"]}, REFUSED),
    ("chat", "prompt_cache_key", {"prompt_cache_key": "k"}, lambda r: r.status == 200),
    ("chat", "safety_identifier", {"safety_identifier": "h"}, lambda r: r.status == 200),
    ("chat", "verbosity", {"verbosity": "low"}, REFUSED),
    ("chat", "audio", {"audio": {"voice": "alloy", "format": "wav"}}, REFUSED),
    ("chat", "prediction", {"prediction": {"type": "content", "content": "x"}}, REFUSED),
    ("chat", "web_search_options", {"web_search_options": {}}, REFUSED),
    ("chat", "functions", {"functions": [{"name": "f"}]}, REFUSED),
    ("chat", "function_call", {"function_call": "auto"}, REFUSED),
]
ENDPOINTS = {"both": ("completions", "chat_completions"), "completions": ("completions",),
             "chat": ("chat_completions",)}
RUNS = [(route, field, fragment, check) for endpoint, field, fragment, check in CASES for route in ENDPOINTS[endpoint]]


@pytest.fixture(scope="module")
def folder(llama_tiny, tmp_path_factory):
    return tokenizer_folder(llama_tiny, tmp_path_factory.mktemp("tok"), added=tuple(THINK_TOKENS))


def _call(folder: Path, route: str, request: dict) -> SimpleNamespace:
    base = {"prompt": "say"} if route == "completions" else {"messages": [{"role": "user", "content": "say hi"}]}

    async def go():
        chat, engine = routes(folder, "hello", ChatOptions())
        response = await getattr(chat, route)(json.dumps({**base, **request}).encode())
        if response.content_type == "text/event-stream":
            data = [c.decode().removeprefix("data: ").strip() async for c in response.chunks]
            return response, engine, [json.loads(d) for d in data if d != "[DONE]"]
        return response, engine, None

    response, engine, events = run(go())
    result = SimpleNamespace(status=response.status, headers=response.headers, engine=engine, events=events,
                             body=None if events is not None else json.loads(b"".join(response.chunks)))
    result.prompt = engine.tokenizer.decode(engine.prompts[-1]) if engine.prompts else ""
    result.text = _text(result)
    return result


def _text(result: SimpleNamespace) -> str:
    def piece(choice: dict) -> str:
        if "text" in choice:
            return choice["text"]
        return (choice.get("message") or choice.get("delta") or {}).get("content") or ""

    if result.events is not None:
        return "".join(piece(c) for e in result.events for c in e["choices"] if c["index"] == 0)
    return piece(result.body["choices"][0]) if result.status == 200 else ""


@pytest.mark.parametrize("route, field, fragment, check", RUNS, ids=[f"{r}-{f}-{i}" for i, (r, f, _, _) in
                                                                        enumerate(RUNS)])
def test_every_field_is_honoured_or_refused_naming_it(folder, route, field, fragment, check):
    result = _call(folder, route, fragment)
    if check == REFUSED:
        assert result.status == 400, result.body
        error = result.body["error"]
        assert error["param"].split(".")[0] == field.split(".")[0], error
        assert error["message"].startswith(field.split(".")[0]), error
    else:
        assert result.status == 200, result.body
        assert check(result), (result.body, result.events)


@pytest.mark.parametrize("route", ["completions", "chat_completions"])
@pytest.mark.parametrize("field", ["no_such_field", "guided_json", "guided_regex"])
def test_an_unknown_top_level_field_is_refused_as_openai_does(folder, route, field):
    result = _call(folder, route, {field: 1})
    assert result.status == 400 and result.body["error"]["param"] == field
    assert "unrecognized request argument supplied" in result.body["error"]["message"]


def test_an_unknown_key_inside_a_message_is_ignored_and_named_in_a_header(folder):
    messages = [{"role": "user", "content": [{"type": "text", "text": "say hi", "cache_control": {}}],
                 "provider_specific_fields": {"x": 1}}]
    result = _call(folder, "chat_completions", {"messages": messages})
    assert result.status == 200 and "say hi" in result.prompt
    assert result.headers["x-gridserve-ignored-fields"] == \
        "messages[0].provider_specific_fields, messages[0].content[0].cache_control"


def test_suffix_fills_in_the_middle_with_the_tokenizers_fim_tokens(llama_tiny, tmp_path):
    folder = tokenizer_folder(llama_tiny, tmp_path, special=tuple(FIM_TOKENS))
    result = _call(folder, "completions", {"prompt": "def f(", "suffix": "):\n    pass"})
    assert result.status == 200
    assert result.prompt == "<|fim_prefix|>def f(<|fim_suffix|>):\n    pass<|fim_middle|>"


def _doc_fields() -> dict[str, str]:
    """field -> endpoint, from the page's main table."""
    table = DOC.read_text().split("## Completions and chat", 1)[1].split("### Message fields", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w.]+)` \| (\w+) \|", table, re.M)}


def test_the_docs_table_the_models_and_the_tests_list_the_same_fields():
    doc = _doc_fields()
    declared = {**{f: "completions" for f in CompletionRequest.model_fields},
                **{f: "chat" for f in ChatCompletionRequest.model_fields}}
    both = set(CompletionRequest.model_fields) & set(ChatCompletionRequest.model_fields)
    declared.update({f: "both" for f in both})
    declared.update({f"stream_options.{f}": "both" for f in StreamOptions.model_fields})
    assert doc == declared
    tested = {(route, field) for route, field, _, _ in RUNS}
    assert {(route, field) for field, endpoint in doc.items() for route in ENDPOINTS[endpoint]} <= tested


def test_openapi_lists_every_field_and_the_tool_call_shapes(folder):
    async def go():
        chat, _ = routes(folder)
        return json.loads(b"".join((await chat.openapi()).chunks))

    schemas = go_schemas = run(go())["components"]["schemas"]
    assert set(CompletionRequest.model_fields) <= set(schemas["CompletionRequest"]["properties"])
    assert set(ChatCompletionRequest.model_fields) <= set(schemas["ChatCompletionRequest"]["properties"])
    assert {"ToolCallOut", "DeltaToolCall", "PromptLogprob", "NamedToolChoice"} <= set(go_schemas)
    assert {"reasoning_content", "tool_calls"} <= set(schemas["ChatResponseMessage"]["properties"])


# ---- POST /v1/responses ----------------------------------------------------------------------
RTOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]


def ok(r) -> bool:
    return r.status == 200


# (field, request fragment, REFUSED or a check of the result); the gateway keeps responses.
RESPONSES_CASES: list[tuple[str, dict, Check]] = [
    ("model", {"model": "m"}, ok),
    ("input", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "say hi"}]}]},
     lambda r: "user\nsay hi" in r.prompt),
    ("input", {"input": [{"type": "item_reference", "id": "x"}]}, REFUSED),
    ("instructions", {"instructions": "be brief"}, lambda r: r.prompt.startswith("<|im_start|>system\nbe brief")),
    ("previous_response_id", {"previous_response_id": "resp_unknown"},
     lambda r: r.status == 404 and r.body["error"]["param"] == "previous_response_id"),
    ("max_output_tokens", {"max_output_tokens": 3}, lambda r: params(r).max_tokens == 3),
    ("temperature", {"temperature": 0.5}, lambda r: params(r).temperature == 0.5),
    ("top_p", {"top_p": 0.5}, lambda r: params(r).top_p == 0.5),
    ("tools", {"tools": RTOOLS, "tool_choice": "none"}, lambda r: '"name": "f"' in r.prompt),
    ("tools", {"tools": [{"type": "web_search"}]}, REFUSED),
    ("tool_choice", {"tools": RTOOLS, "tool_choice": "required"}, lambda r: params(r).structured_outputs.json),
    ("tool_choice", {"tools": RTOOLS, "tool_choice": {"type": "function", "name": "g"}}, REFUSED),
    ("parallel_tool_calls", {"tools": RTOOLS, "tool_choice": "required", "parallel_tool_calls": False},
     lambda r: params(r).structured_outputs.json["maxItems"] == 1),
    ("text", {"text": {"format": {"type": "json_object"}}}, lambda r: params(r).structured_outputs.json_object),
    ("text", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}},
     lambda r: params(r).structured_outputs.json == {"type": "object"}),
    ("text", {"text": {"verbosity": "low"}}, REFUSED),
    ("reasoning", {"reasoning": {"effort": "low"}}, lambda r: r.prompt.endswith("(effort low)")),
    ("reasoning", {"reasoning": {"summary": "auto"}}, REFUSED),
    ("store", {"store": False}, lambda r: r.body["store"] is False),
    ("store", {"store": True}, lambda r: r.body["store"] is True),
    ("stream", {"stream": True}, lambda r: r.text == "hello" and r.events[-1]["type"] == "response.completed"),
    ("stream_options", {"stream_options": {"include_obfuscation": False}}, REFUSED),  # without stream
    ("stream_options", {"stream": True, "stream_options": {"include_obfuscation": False}}, lambda r: r.text == "hello"),
    ("stream_options", {"stream": True, "stream_options": {"include_obfuscation": True}}, REFUSED),
    ("metadata", {"metadata": {"team": "a"}}, lambda r: r.body["metadata"] == {"team": "a"}),
    ("metadata", {"metadata": {str(i): "x" for i in range(17)}}, REFUSED),
    ("user", {"user": "alice"}, ok),
    ("safety_identifier", {"safety_identifier": "h"}, ok),
    ("prompt_cache_key", {"prompt_cache_key": "k"}, ok),
    ("service_tier", {"service_tier": "default"}, ok),
    ("service_tier", {"service_tier": "flex"}, REFUSED),
    ("truncation", {"truncation": "disabled"}, ok),
    ("truncation", {"truncation": "auto"}, REFUSED),
    ("include", {"include": []}, ok),
    ("include", {"include": ["message.output_text.logprobs"]}, REFUSED),
    ("top_logprobs", {"top_logprobs": 2}, REFUSED),
    ("background", {"background": True}, REFUSED),
    ("max_tool_calls", {"max_tool_calls": 1}, REFUSED),
    ("conversation", {"conversation": "conv_1"}, REFUSED),
    ("prompt", {"prompt": {"id": "pmpt_1"}}, REFUSED),
    ("prompt_cache_retention", {"prompt_cache_retention": "24h"}, REFUSED),
    ("top_k", {"top_k": 5}, lambda r: params(r).top_k == 5),
    ("logit_bias", {"logit_bias": {"5": 2.0}}, lambda r: params(r).logit_bias == {5: 2.0}),
    ("skip_special_tokens", {"skip_special_tokens": False}, lambda r: params(r).skip_special_tokens is False),
    ("priority", {"priority": 0}, ok),
    ("priority", {"priority": 2}, REFUSED),  # no --allow-client-priority (test_priority_field.py)
    ("cache_salt", {"cache_salt": "tenant-a"}, ok),
    ("cache_salt", {"cache_salt": "x" * 257}, REFUSED),
]


def _respond(folder: Path, request: dict) -> SimpleNamespace:
    async def go():
        chat, engine = routes(folder, "hello", ChatOptions())
        api = ResponsesAPI(chat, ResponseStore(16, 1 << 20, 60.0))
        response = await api.create(json.dumps({"model": "m", "input": "say hi", **request}).encode())
        if response.content_type == "text/event-stream":
            chunks = [c.decode() async for c in response.chunks]
            return response, engine, [json.loads(c.split("data: ", 1)[1]) for c in chunks]
        return response, engine, None

    response, engine, events = run(go())
    result = SimpleNamespace(status=response.status, engine=engine, events=events,
                             body=None if events is not None else json.loads(b"".join(response.chunks)))
    result.prompt = engine.tokenizer.decode(engine.prompts[-1]) if engine.prompts else ""
    result.text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") if events else ""
    return result


@pytest.mark.parametrize("field, fragment, check", RESPONSES_CASES,
                         ids=[f"responses-{f}-{i}" for i, (f, _, _) in enumerate(RESPONSES_CASES)])
def test_every_responses_field_is_honoured_or_refused_naming_it(folder, field, fragment, check):
    result = _respond(folder, fragment)
    if check == REFUSED:
        assert result.status == 400, result.body
        error = result.body["error"]
        assert error["param"].split(".")[0].split("[")[0] == field, error
        assert error["message"].startswith(field), error
    else:
        assert check(result), (result.status, result.body, result.events)


def test_an_unknown_top_level_responses_field_is_refused_as_openai_does(folder):
    for field in ("no_such_field", "request_id", "guided_json", "chat_template_kwargs"):
        result = _respond(folder, {field: 1})
        assert result.status == 400 and result.body["error"]["param"] == field
        assert "unrecognized request argument supplied" in result.body["error"]["message"]


def _doc_responses_fields() -> dict[str, str]:
    """field -> status, from the page's Responses table."""
    table = DOC.read_text().split("\n## Responses\n", 1)[1].split("### Input items", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w.]+)` \| (\w+) \|", table, re.M)}


def test_the_docs_responses_table_the_model_and_the_tests_list_the_same_fields():
    doc = _doc_responses_fields()
    assert set(doc) == set(ResponsesRequest.model_fields)
    honoured = {field for field, _, check in RESPONSES_CASES if check != REFUSED}
    refused = {field for field, _, check in RESPONSES_CASES if check == REFUSED}
    assert {f for f, status in doc.items() if status == "honoured"} <= honoured
    assert {f for f, status in doc.items() if status == "refused"} <= refused


def test_openapi_lists_the_responses_routes(folder):
    async def go():
        chat, _ = routes(folder)
        return json.loads(b"".join((await chat.openapi()).chunks))

    document = run(go())
    assert "post" in document["paths"]["/v1/responses"] and "get" in document["paths"]["/v1/responses/{response_id}"]
    schemas = document["components"]["schemas"]
    assert set(ResponsesRequest.model_fields) <= set(schemas["ResponsesRequest"]["properties"])
    assert {"FunctionCallItem", "ReasoningItem", "OutputMessage", "ResponseStreamEvent"} <= set(schemas)

"""Tool calling through the chat route, on a real tokenizer and template with a scripted engine:
``tool_choice`` none / auto / required / named (vLLM's semantics), unary and streamed, the forced
calls' grammar (it must accept the reply the engine plays), finish reasons, the refusals naming
their field, and a tool result flowing back through the template. The typed gRPC ``Chat`` too."""

from __future__ import annotations

import json

import pytest

from gridserve.api.gateway.v1 import gateway_pb2
from gridserve.services.gateway.chat_options import ChatOptions
from gridserve.services.gateway.chat_output import ChatPlan
from gridserve.services.gateway.convert import chat_fields_from_pb, chat_to_pb, tool_choice_from_pb
from gridserve.services.gateway.tool_choice import plan_tools, required_schema
from gridserve.shared.errors import ConfigError
from gridserve.shared.outputs import CompletionOutput, RequestOutput
from tests.unit.gateway.scripted_engine import (
    THINK_TOKENS,
    body,
    events,
    grammar_accepts,
    routes,
    run,
    tokenizer_folder,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
ASK = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS}
HERMES_REPLY = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
AUTO = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")


@pytest.fixture(scope="module")
def folder(llama_tiny, tmp_path_factory):
    return tokenizer_folder(llama_tiny, tmp_path_factory.mktemp("tok"), added=tuple(THINK_TOKENS))


def _post(route, request: dict):
    return run(route(json.dumps(request).encode()))


def _streamed(events_: list[dict]) -> tuple[str, dict[int, list[str]], list[str]]:
    """Content, {index: [id, name, arguments]} and finish reasons of a streamed chat."""
    content, calls, reasons = "", {}, []
    for event in events_:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    calls[call["index"]] = [call["id"], call["function"]["name"], ""]
                calls[call["index"]][2] += call["function"].get("arguments", "")
            if choice["finish_reason"]:
                reasons.append(choice["finish_reason"])
    return content, calls, reasons


def test_auto_finds_the_calls_the_model_writes(folder):
    async def go():
        chat, _ = routes(folder, HERMES_REPLY, AUTO)
        unary = body(await chat.chat_completions(json.dumps(ASK).encode()))
        stream = await events(await chat.chat_completions(json.dumps({**ASK, "stream": True}).encode()))
        return unary, stream

    unary, stream = run(go())
    choice = unary["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    content, calls, reasons = _streamed(stream)
    assert content == "Checking." and reasons == ["tool_calls"]
    assert [c[1:] for c in calls.values()] == [["get_weather", '{"city": "Paris"}']]


def test_required_forces_a_calls_array_that_parses_into_tool_calls(folder):
    reply = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'

    async def go():
        chat, engine = routes(folder, reply)
        unary = body(await chat.chat_completions(json.dumps({**ASK, "tool_choice": "required"}).encode()))
        stream = await events(await chat.chat_completions(
            json.dumps({**ASK, "tool_choice": "required", "stream": True}).encode()))
        return unary, stream, engine

    unary, stream, engine = run(go())
    message = unary["choices"][0]["message"]
    assert unary["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert engine.params[0].structured_outputs.json == required_schema(TOOLS, parallel=True)
    assert grammar_accepts(engine.tokenizer, engine.params[0], reply)
    assert not grammar_accepts(engine.tokenizer, engine.params[0], '[{"name": "get_wether", "parameters": {}}]')
    assert not grammar_accepts(engine.tokenizer, engine.params[0], "[]")
    _, calls, reasons = _streamed(stream)
    assert [c[1:] for c in calls.values()] == [["get_weather", '{"city": "Paris"}'], ["get_time", "{}"]]


def test_required_without_parallel_calls_allows_exactly_one():
    schema = required_schema(TOOLS, parallel=False)
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    names = [item["properties"]["name"] for item in schema["items"]["anyOf"]]
    assert names == [{"const": "get_weather"}, {"const": "get_time"}]


def test_a_named_function_forces_its_arguments(folder):
    named = {**ASK, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}

    async def go():
        chat, engine = routes(folder, '{"city": "Paris"}')
        unary = body(await chat.chat_completions(json.dumps(named).encode()))
        stream = await events(await chat.chat_completions(json.dumps({**named, "stream": True}).encode()))
        return unary, stream, engine

    unary, stream, engine = run(go())
    choice = unary["choices"][0]
    assert choice["finish_reason"] == "stop"  # as OpenAI answers a forced function
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert engine.params[0].structured_outputs.json == WEATHER
    assert not grammar_accepts(engine.tokenizer, engine.params[0], '{"town": "Paris"}')
    assert [c[1:] for c in _streamed(stream)[1].values()] == [["get_weather", '{"city": "Paris"}']]


def test_none_leaves_the_reply_as_content_and_the_tools_in_the_prompt_unless_excluded(folder):
    async def go():
        shown, shown_engine = routes(folder, HERMES_REPLY, AUTO)
        unary = body(await shown.chat_completions(json.dumps({**ASK, "tool_choice": "none"}).encode()))
        hidden, hidden_engine = routes(folder, "x", ChatOptions(exclude_tools_when_tool_choice_none=True))
        await hidden.chat_completions(json.dumps({**ASK, "tool_choice": "none"}).encode())
        return unary, shown_engine, hidden_engine

    unary, shown, hidden = run(go())
    assert unary["choices"][0]["message"] == {"role": "assistant", "content": HERMES_REPLY}
    assert unary["choices"][0]["finish_reason"] == "stop"
    assert "get_weather" in shown.tokenizer.decode(shown.prompts[0])
    assert "get_weather" not in hidden.tokenizer.decode(hidden.prompts[0])


@pytest.mark.parametrize("request_fields, param, words", [
    ({}, "tool_choice", "--enable-auto-tool-choice"),  # tools without tool_choice mean "auto"
    ({"tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "no tool named"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}]},
     "tools", "tools[0].function.parameters"),
    ({"tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools", ""),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "extra": 1}}]}, "tools", "extra"),
    ({"functions": [{"name": "f"}]}, "functions", "tools"),
])
def test_a_tool_request_it_cannot_serve_is_a_400_naming_the_field(folder, request_fields, param, words):
    async def go():
        chat, _ = routes(folder, "x")
        return await chat.chat_completions(json.dumps({**ASK, **request_fields}).encode())

    response = run(go())
    error = body(response)["error"]
    assert response.status == 400 and error["param"].split(".")[0].split("[")[0] == param, error
    assert words in error["message"] and error["message"].startswith(param)


def test_tool_choice_without_tools_is_refused(folder):
    async def go():
        chat, _ = routes(folder, "x")
        return await chat.chat_completions(json.dumps({"messages": ASK["messages"], "tool_choice": "required"}).encode())

    response = run(go())
    assert response.status == 400 and body(response)["error"]["param"] == "tool_choice"


def test_parallel_tool_calls_false_keeps_the_first_call(folder):
    reply = HERMES_REPLY + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'

    async def go():
        chat, _ = routes(folder, reply, AUTO)
        unary = body(await chat.chat_completions(json.dumps({**ASK, "parallel_tool_calls": False}).encode()))
        stream = await events(await chat.chat_completions(
            json.dumps({**ASK, "parallel_tool_calls": False, "stream": True}).encode()))
        return unary, stream

    unary, stream = run(go())
    assert [c["function"]["name"] for c in unary["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    assert list(_streamed(stream)[1]) == [0]


def test_a_tool_result_flows_back_through_the_template_with_parsed_arguments(folder):
    turns = [*ASK["messages"],
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]

    async def go():
        chat, engine = routes(folder, "It is 18 C and sunny.", AUTO)
        answer = body(await chat.chat_completions(json.dumps({**ASK, "messages": turns}).encode()))
        return answer, engine.tokenizer.decode(engine.prompts[0])

    answer, prompt = run(go())
    assert answer["choices"][0]["message"]["content"] == "It is 18 C and sunny."
    assert answer["choices"][0]["finish_reason"] == "stop"
    # The arguments reach the template as an object (rendered by tojson), not as an escaped string.
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt


def test_bad_parser_flags_fail_at_start():
    with pytest.raises(ConfigError, match="tool-call-parser"):
        ChatOptions(enable_auto_tool_choice=True)
    with pytest.raises(ConfigError, match="tool-call-parser"):
        ChatOptions(tool_call_parser="nonesuch")
    with pytest.raises(ConfigError, match="reasoning-parser"):
        ChatOptions(reasoning_parser="nonesuch")
    assert AUTO.to_argv() == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def test_the_typed_chat_rpc_carries_tools_calls_and_their_results():
    request = gateway_pb2.ChatRequest(
        messages=[gateway_pb2.ChatMessage(role="user", content="weather?"),
                  gateway_pb2.ChatMessage(role="assistant", tool_calls=[
                      gateway_pb2.ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}')]),
                  gateway_pb2.ChatMessage(role="tool", content="18 C", tool_call_id="c1")],
        tools=[gateway_pb2.Tool(name="get_weather", parameters_json=json.dumps(WEATHER))],
        tool_choice="get_weather", chat_template_kwargs_json='{"enable_thinking": false}')
    fields = chat_fields_from_pb(request)
    assert fields["tools"][0]["function"]["parameters"] == WEATHER
    assert fields["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert fields["messages"][2]["tool_call_id"] == "c1" and fields["chat_template_kwargs"] == {"enable_thinking": False}
    assert tool_choice_from_pb(request) == {"type": "function", "function": {"name": "get_weather"}}
    plan = ChatPlan(plan_tools(fields["tools"], "required", None, ChatOptions()))
    out = RequestOutput("r", None, [1], [CompletionOutput(0, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
                                                         [2], None, None, "stop")], True)
    reply = chat_to_pb("r", out, plan)
    assert [(c.name, c.arguments) for c in reply.message.tool_calls] == [("get_weather", '{"city": "Oslo"}')]
    assert reply.finish_reason == 5  # FINISH_REASON_TOOL_CALLS

"""Tool calls and reasoning end to end: the official ``openai`` client through the Envoy edge, a real
deployment of the tiny random Llama with a Qwen-style chat template that renders tools.

The gateways run ``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3``.
A random model writes nothing on its own accord, so the calls are forced: ``required`` and a named
function by the gateway's own schema, ``auto`` by a request grammar that makes the model write a
Hermes ``<tool_call>`` block (whose arguments must then validate against the tool's schema), and
the reasoning by a grammar forcing ``<think>...</think>answer``. Tool requests turn Qwen3's
thinking off (``chat_template_kwargs``), as a client of such a model would.
"""

from __future__ import annotations

import json
import urllib.request

import jsonschema
import pytest

from gridserve.launcher import free_port
from tests.unit.gateway.scripted_engine import copy_checkpoint

from .services import deployment

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
GATEWAY_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]


@pytest.fixture(scope="module")
def model(llama_tiny, tmp_path_factory):
    return copy_checkpoint(llama_tiny, tmp_path_factory.mktemp("qwen-style"))


@pytest.fixture(scope="module")
def edge(model, tmp_path_factory):
    with deployment(model, tmp_path_factory.mktemp("logs"), edge_port=free_port(), gateway_args=GATEWAY_ARGS) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def client(edge):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://{edge.edge_address}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def name(model):
    return str(model)


def _valid(call) -> dict:
    """The call's arguments, validated against its tool's schema."""
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def _streamed_calls(stream) -> tuple[dict[int, list[str]], list[str]]:
    calls: dict[int, list[str]] = {}
    reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in calls and call.type == "function"
                    calls[call.index] = [call.id, call.function.name, ""]
                calls[call.index][2] += call.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return calls, reasons


def test_required_returns_calls_that_validate_unary_and_streamed(client, name):
    out = client.chat.completions.create(model=name, messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=120, temperature=0, extra_body=NO_THINKING)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _valid(choice.message.tool_calls[0])
    stream = client.chat.completions.create(model=name, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=120, temperature=0, stream=True,
                                            extra_body=NO_THINKING)
    calls, reasons = _streamed_calls(stream)
    assert reasons == ["tool_calls"]
    assert [c[1:] for c in calls.values()] == [[choice.message.tool_calls[0].function.name,
                                               choice.message.tool_calls[0].function.arguments]]


def test_a_named_function_is_called_with_valid_arguments(client, name):
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model=name, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=60,
                                         temperature=0.8, seed=3, extra_body=NO_THINKING)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time" and _valid(call)["zone"] in ("CET", "UTC")
    stream = client.chat.completions.create(model=name, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=60,
                                            temperature=0.8, seed=3, stream=True, extra_body=NO_THINKING)
    calls, _ = _streamed_calls(stream)
    assert [c[1:] for c in calls.values()] == [["get_time", call.function.arguments]]


def _hermes_grammar() -> str:
    """A grammar making the model write one Hermes call to get_weather (arguments by its schema)."""
    opening = json.dumps('<tool_call>\n{"name": "get_weather", "arguments": ')
    closing = json.dumps("}\n</tool_call>")
    schema = {**WEATHER, "x-guidance": {"whitespace_flexible": False}}  # no room to wander in whitespace
    return f"start: {opening} arguments {closing}\narguments: %json {json.dumps(schema)}"


def test_auto_parses_the_hermes_call_the_model_writes(client, name):
    extra = {**NO_THINKING, "structured_outputs": {"grammar": _hermes_grammar()}}
    out = client.chat.completions.create(model=name, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
                                         extra_body=extra)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    _valid(call)
    stream = client.chat.completions.create(model=name, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
                                            stream=True, extra_body=extra)
    calls, reasons = _streamed_calls(stream)
    assert reasons == ["tool_calls"] and [c[1:] for c in calls.values()] == [["get_weather", call.function.arguments]]


def test_a_two_turn_loop_with_a_tool_result(client, name, edge):
    first = client.chat.completions.create(model=name, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=120, temperature=0,
                                           extra_body=NO_THINKING)
    call = first.choices[0].message.tool_calls[0]
    turns = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    second = client.chat.completions.create(model=name, messages=turns, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, temperature=0, extra_body=NO_THINKING)
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.tool_calls is None
    assert isinstance(second.choices[0].message.content, str)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    # The result and the earlier call (its arguments as an object) are in the prompt the template made.
    body = json.dumps({"model": name, "messages": turns, "tools": TOOLS, **NO_THINKING}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"http://{edge.edge_address}/tokenize", data=body), timeout=60) as r:
        tokens = json.loads(r.read())["tokens"]
    detok = urllib.request.Request(f"http://{edge.edge_address}/detokenize", data=json.dumps({"tokens": tokens}).encode())
    with urllib.request.urlopen(detok, timeout=60) as r:
        prompt = json.loads(r.read())["prompt"]
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in prompt
    assert f'"arguments": {json.dumps(json.loads(call.function.arguments))}' in prompt


def test_reasoning_is_split_end_to_end(client, name):
    grammar = 'start: "<think>" /[a-z ]{4,16}/ "</think>" "answer: " /[a-z]{1,6}/'
    extra = {"structured_outputs": {"grammar": grammar}}
    out = client.chat.completions.create(model=name, messages=ASK, max_tokens=60, temperature=0, extra_body=extra)
    message = out.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert 4 <= len(reasoning) <= 16 and message.content.startswith("answer: ")
    stream = client.chat.completions.create(model=name, messages=ASK, max_tokens=60, temperature=0, stream=True,
                                            extra_body=extra)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content


def test_fields_it_cannot_honour_are_refused_by_name(client, name):
    import openai

    with pytest.raises(openai.BadRequestError) as stored:
        client.chat.completions.create(model=name, messages=ASK, max_tokens=4, store=True)
    assert stored.value.body["param"] == "store"
    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(model=name, messages=ASK, max_tokens=4, extra_body={"priority": 1})
    assert unknown.value.body["param"] == "priority"
    with pytest.raises(openai.BadRequestError) as streamed:
        client.chat.completions.create(model=name, messages=ASK, max_tokens=4, n=2, stream=True,
                                       extra_body={"use_beam_search": True})
    assert streamed.value.body["param"] == "stream"  # the best beams are known only at the end
    with pytest.raises(openai.BadRequestError) as suffix:
        client.completions.create(model=name, prompt="def f(", suffix="):", max_tokens=4)
    assert suffix.value.body["param"] == "suffix"  # the tiny tokenizer has no FIM tokens


def test_the_typed_grpc_chat_carries_tools_and_returns_calls(edge):
    import grpc

    from gridserve.api.common.v1 import common_pb2
    from gridserve.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc

    request = gateway_pb2.ChatRequest(
        messages=[gateway_pb2.ChatMessage(role="user", content="What time is it in Paris?")],
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=60),
        tools=[gateway_pb2.Tool(name=t["function"]["name"], parameters_json=json.dumps(t["function"]["parameters"]))
               for t in TOOLS],
        tool_choice="get_time", chat_template_kwargs_json=json.dumps({"enable_thinking": False}))
    with grpc.insecure_channel(edge.edge_address) as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).Chat(request, timeout=60)
    (call,) = reply.message.tool_calls
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("CET", "UTC")
    assert reply.finish_reason == common_pb2.FINISH_REASON_STOP  # a named function keeps "stop"
    request.tool_choice = "required"
    request.parallel_tool_calls = False
    with grpc.insecure_channel(edge.edge_address) as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).Chat(request, timeout=60)
    assert len(reply.message.tool_calls) == 1 and reply.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS


def test_an_unknown_message_key_is_named_in_a_response_header_through_the_edge(edge, name):
    body = {"model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi", "provider_fields": {}}]}
    request = urllib.request.Request(f"http://{edge.edge_address}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        assert response.headers["x-gridserve-ignored-fields"] == "messages[0].provider_fields"


def test_beam_search_over_rest_equals_transformers_num_beams(client, name, model):
    from gridserve.services.gateway.tokenizer import GatewayTokenizer

    from .test_beam_search_matches_hf import hf_beams

    tokenizer = GatewayTokenizer(str(model))
    prompt = list(tokenizer.encode("The capital of France is", True))
    completion = client.completions.create(model=name, prompt=prompt, n=3, max_tokens=6,
                                           extra_body={"use_beam_search": True, "ignore_eos": True})
    best = hf_beams(name, prompt, 3, 6, eos=False)
    assert [c.text for c in completion.choices] == [tokenizer.decode(t) for t, _ in best]
    assert completion.usage.completion_tokens == 18
    chat = client.chat.completions.create(model=name, messages=ASK, n=2, max_tokens=4,
                                          extra_body={"use_beam_search": True, "length_penalty": 0.5, **NO_THINKING})
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].finish_reason in ("stop", "length")

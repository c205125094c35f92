"""The Responses API end to end: the official ``openai`` client's ``client.responses`` through the
Envoy edge, a real deployment of the tiny random Llama with a Qwen-style chat template that renders
tools, gateways run with ``--enable-auto-tool-choice --tool-call-parser hermes
--enable-responses-store``.

A random model writes nothing on its own accord, so the function call is forced (``tool_choice:
"required"``, the gateway's schema); the round trip sends its result back both as the whole input
and through ``previous_response_id``, which must render the same prompt. The store is per API key:
two clients with different bearer tokens see only their own responses.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from gridserve.launcher import free_port
from tests.unit.gateway.scripted_engine import copy_checkpoint

from .services import deployment

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GATEWAY_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-responses-store"]


@pytest.fixture(scope="module")
def model(llama_tiny, tmp_path_factory):
    return copy_checkpoint(llama_tiny, tmp_path_factory.mktemp("qwen-style"))


@pytest.fixture(scope="module")
def edge(model, tmp_path_factory):
    with deployment(model, tmp_path_factory.mktemp("logs"), edge_port=free_port(), gateway_args=GATEWAY_ARGS) as launcher:
        yield launcher


def _client(edge, key: str):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://{edge.edge_address}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(edge):
    return _client(edge, "alice")


@pytest.fixture(scope="module")
def name(model):
    return str(model)


def test_a_unary_and_a_streamed_response_say_the_same(client, name):
    out = client.responses.create(model=name, input="Say hi", instructions="Be brief.", max_output_tokens=8,
                                  temperature=0)
    assert out.object == "response" and out.id.startswith("resp_") and out.output[0].type == "message"
    assert out.usage.output_tokens <= 8 and out.instructions == "Be brief."
    assert out.status == ("incomplete" if out.usage.output_tokens == 8 else "completed")
    events = list(client.responses.create(model=name, input="Say hi", instructions="Be brief.", max_output_tokens=8,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == f"response.{out.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == events[-1].response.output_text == out.output_text


def test_a_function_call_round_trip_whole_input_and_previous_response_id(client, name):
    first = client.responses.create(model=name, input=ASK, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}
    whole = client.responses.create(model=name, input=[*ASK, call.model_dump(exclude_none=True), result],
                                    tools=TOOLS, tool_choice="none", max_output_tokens=4, temperature=0)
    chained = client.responses.create(model=name, input=[result], previous_response_id=first.id, tools=TOOLS,
                                      tool_choice="none", max_output_tokens=4, temperature=0)
    assert whole.output[0].type == chained.output[0].type == "message"
    assert whole.usage.input_tokens == chained.usage.input_tokens > first.usage.input_tokens
    assert chained.previous_response_id == first.id and whole.output_text == chained.output_text

    events = list(client.responses.create(model=name, input=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=120, temperature=0,
                                          stream=True))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == done.arguments == call.arguments and events[-1].type == "response.completed"


def test_stored_responses_are_kept_per_api_key(client, edge, name):
    import openai

    first = client.responses.create(model=name, input="Remember this.", max_output_tokens=4, temperature=0,
                                    metadata={"topic": "memory"})
    fetched = client.responses.retrieve(first.id)
    assert fetched.model_dump() == first.model_dump() and fetched.metadata == {"topic": "memory"}
    stranger = _client(edge, "bob")
    with pytest.raises(openai.NotFoundError) as other_key:
        stranger.responses.create(model=name, input="What did I say?", previous_response_id=first.id,
                                  max_output_tokens=4)
    assert other_key.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        stranger.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=name, input="hi", background=True)
    assert refused.value.body["param"] == "background"

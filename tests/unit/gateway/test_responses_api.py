"""The Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``) on a real tokenizer and
template with a scripted engine: OpenAI's event sequence and its agreement with the unary object,
reasoning and function-call items, input items flowing through the chat template, and the store —
``previous_response_id`` per API key, its bounds (entries, bytes, TTL), other replicas, and the
refusals when it is off."""

from __future__ import annotations

import json

import pytest

from gridserve.services.gateway.chat_options import ChatOptions
from gridserve.services.gateway.responses_api import ResponsesAPI
from gridserve.services.gateway.responses_events import ResponseEvents, ResponseShape
from gridserve.services.gateway.responses_store import (
    ResponsesStoreOptions,
    ResponseStore,
    owner_of,
)
from tests.unit.gateway.scripted_engine import THINK_TOKENS, body, routes, run, tokenizer_folder

TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
REPLY = ('<think>plan it</think>Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
         "\n</tool_call>")
PARSERS = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")


@pytest.fixture(scope="module")
def folder(llama_tiny, tmp_path_factory):
    return tokenizer_folder(llama_tiny, tmp_path_factory.mktemp("tok"), added=tuple(THINK_TOKENS))


def _api(folder, reply: str = "hello", options=None, store: ResponseStore | None = None):
    chat, engine = routes(folder, reply, options or ChatOptions())
    return ResponsesAPI(chat, store), engine


def _request(**fields) -> bytes:
    return json.dumps({"model": "m", "input": "Weather in Paris?", **fields}).encode()


async def _events(response) -> list[dict]:
    events = []
    async for chunk in response.chunks:
        header, data = chunk.decode().split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert header == f"event: {event['type']}"
        events.append(event)
    return events


def _without_ids(output: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]


def test_a_streamed_response_is_openais_event_sequence_and_matches_the_unary_one(folder):
    async def go():
        api, _ = _api(folder, REPLY, PARSERS)
        unary = body(await api.create(_request(tools=TOOLS)))
        return unary, await _events(await api.create(_request(tools=TOOLS, stream=True)))

    unary, events = run(go())
    assert [item["type"] for item in unary["output"]] == ["reasoning", "message", "function_call"]
    reasoning, message, call = unary["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "plan it"}]
    assert message["content"][0]["text"] == "Checking." and message["role"] == "assistant"
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"].startswith("call_") and unary["status"] == "completed"
    assert unary["usage"]["output_tokens"] > 0 and unary["usage"]["total_tokens"] > unary["usage"]["output_tokens"]

    kinds = [e["type"] for e in events]
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # runs of deltas as one
    text_item = ["response.output_item.added", "response.content_part.added", "{}.delta", "{}.done",
                 "response.content_part.done", "response.output_item.done"]
    assert squeezed == ["response.created", "response.in_progress",
                        *[k.format("response.reasoning_text") for k in text_item],
                        *[k.format("response.output_text") for k in text_item],
                        "response.output_item.added", "response.function_call_arguments.delta",
                        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    by_type = {}
    for e in events:
        by_type.setdefault(e["type"], []).append(e)
    assert "".join(e["delta"] for e in by_type["response.reasoning_text.delta"]) == "plan it"
    assert "".join(e["delta"] for e in by_type["response.output_text.delta"]) == "Checking."
    arguments = "".join(e["delta"] for e in by_type["response.function_call_arguments.delta"])
    assert arguments == by_type["response.function_call_arguments.done"][0]["arguments"] == call["arguments"]
    assert [e["output_index"] for e in by_type["response.output_item.added"]] == [0, 1, 2]
    final = events[-1]["response"]
    assert final["status"] == "completed" and _without_ids(final["output"]) == _without_ids(unary["output"])
    assert [e["item"] for e in by_type["response.output_item.done"]] == final["output"]


def test_a_plain_reply_is_one_message_and_a_forced_call_has_no_message(folder):
    async def go():
        api, engine = _api(folder, "hello")
        plain = body(await api.create(_request(instructions="Be brief.", max_output_tokens=5)))
        forced_api, _ = _api(folder, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
        forced = body(await forced_api.create(_request(tools=TOOLS, tool_choice="required")))
        return plain, forced, engine

    plain, forced, engine = run(go())
    (message,) = plain["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "hello"
    assert plain["instructions"] == "Be brief." and plain["max_output_tokens"] == 5 and plain["store"] is False
    assert engine.params[-1].max_tokens == 5
    assert engine.tokenizer.decode(engine.prompts[-1]).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    (call,) = forced["output"]
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"city": "Oslo"}


def test_input_items_become_the_conversation_the_template_renders(folder):
    items = [{"role": "developer", "content": "Use tools."},
             {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "call the tool"}]},
             {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}', "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees"}]

    async def go():
        api, engine = _api(folder)
        response = await api.create(_request(input=items, tools=TOOLS, tool_choice="none"))
        return response, engine

    response, engine = run(go())
    assert response.status == 200, body(response)
    prompt = engine.tokenizer.decode(engine.prompts[-1])
    assert "<|im_start|>system\nUse tools.<|im_end|>" in prompt
    assert "<think>\ncall the tool\n</think>" in prompt
    assert '"arguments": {"city": "Paris"}' in prompt  # parsed into an object, as chat
    assert "<tool_response>\n18 degrees\n</tool_response>" in prompt


def test_unknown_keys_inside_input_items_are_named_and_unserved_items_refused(folder):
    async def go():
        api, _ = _api(folder)
        named = await api.create(_request(input=[{"role": "user", "content": "hi", "provider_data": {}}]))
        refused = await api.create(_request(input=[{"role": "user", "content": "hi"},
                                                   {"type": "web_search_call", "id": "ws_1"}]))
        return named, body(refused)

    named, refused = run(go())
    assert named.status == 200 and named.headers["x-gridserve-ignored-fields"] == "input[0].provider_data"
    assert refused["error"]["param"] == "input" and refused["error"]["message"].startswith("input[1]:")


def test_refusals_from_the_chat_machinery_name_the_responses_fields(folder):
    bad_schema = {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}
    cases = [({"input": []}, "input"),
             ({"text": {"format": bad_schema}}, "text.format.schema"),
             ({"text": {"format": bad_schema}, "stream": True}, "text.format.schema"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
             ({"tools": [{**TOOLS[0], "parameters": {"type": "bogus"}}], "tool_choice": "required"},
              "tools[0].parameters")]

    async def go():
        api, _ = _api(folder)
        return [body(await api.create(_request(**fields)))["error"] for fields, _ in cases]

    for error, (_, param) in zip(run(go()), cases):
        assert error["code"] == 400 and error["param"] == param and error["message"].startswith(param), error


def test_previous_response_id_continues_its_owners_conversation(folder):
    store = ResponseStore(16, 1 << 20, 60.0)

    async def go():
        api, engine = _api(folder, "sunny", store=store)
        first = body(await api.create(_request(instructions="Be brief."), owner="alice"))
        follow = body(await api.create(_request(input="And tomorrow?", previous_response_id=first["id"]),
                                       owner="alice"))
        prompt = engine.tokenizer.decode(engine.prompts[-1])
        stranger = body(await api.create(_request(previous_response_id=first["id"]), owner="bob"))
        fetched = body(await api.retrieve(first["id"], owner="alice"))
        hidden = body(await api.retrieve(first["id"], owner="bob"))
        return first, follow, prompt, stranger, fetched, hidden

    first, follow, prompt, stranger, fetched, hidden = run(go())
    assert first["store"] is True and first["id"].startswith("resp_")
    assert follow["previous_response_id"] == first["id"]
    assert "Weather in Paris?" in prompt and "sunny<|im_end|>" in prompt and "And tomorrow?" in prompt
    assert "Be brief." not in prompt  # instructions are not carried over, as OpenAI
    assert stranger["error"]["param"] == "previous_response_id" and stranger["error"]["code"] == 404
    assert fetched == first
    assert hidden["error"]["param"] == "response_id" and hidden["error"]["code"] == 404


def test_a_streamed_response_is_stored_once_it_completes(folder):
    store = ResponseStore(16, 1 << 20, 60.0)

    async def go():
        api, _ = _api(folder, REPLY, PARSERS, store)
        events = await _events(await api.create(_request(tools=TOOLS, stream=True), owner="alice"))
        return events, body(await api.retrieve(events[-1]["response"]["id"], owner="alice"))

    events, stored = run(go())
    assert stored == events[-1]["response"] and stored["status"] == "completed"
    message = store.entries[stored["id"]].messages[-1]
    assert message["content"] == "Checking." and message["reasoning_content"] == "plan it"
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"


def test_without_the_store_store_true_and_previous_response_id_are_refused(folder):
    async def go():
        api, _ = _api(folder)
        return (body(await api.create(_request(store=True))),
                body(await api.create(_request(previous_response_id="resp_x"))),
                body(await api.retrieve("resp_x")))

    stored, previous, fetched = run(go())
    assert stored["error"]["param"] == "store" and stored["error"]["code"] == 400
    assert previous["error"]["param"] == "previous_response_id" and "--enable-responses-store" in previous["error"]["message"]
    assert fetched["error"]["code"] == 404 and fetched["error"]["param"] == "response_id"


def test_an_id_another_replica_made_is_a_404_that_says_so(folder):
    here, there = ResponseStore(16, 1 << 20, 60.0), ResponseStore(16, 1 << 20, 60.0)

    async def go():
        api_there, _ = _api(folder, store=there)
        made = body(await api_there.create(_request()))
        api_here, _ = _api(folder, store=here)
        return body(await api_here.create(_request(previous_response_id=made["id"])))

    error = run(go())["error"]
    assert error["code"] == 404 and error["param"] == "previous_response_id" and "replica" in error["message"]


# ---- the event stream alone --------------------------------------------------------------------
def _shape() -> ResponseShape:
    return ResponseShape("resp_1", "m", False)


def _decoded(chunks: list[bytes]) -> list[dict]:
    return [json.loads(c.decode().split("data: ", 1)[1]) for c in chunks]


def test_a_reply_cut_by_max_output_tokens_ends_with_response_incomplete():
    events = ResponseEvents(_shape(), None)
    out = _decoded(events.start() + events.feed("hel") + events.finish("length", None))
    assert out[-1]["type"] == "response.incomplete"
    final = out[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete" and final["output"][0]["content"][0]["text"] == "hel"


def test_an_empty_reply_still_has_its_message_and_a_failure_is_an_error_then_response_failed():
    events = ResponseEvents(_shape(), None)
    out = _decoded(events.start() + events.finish("stop", None))
    assert [e["type"] for e in out][2:] == ["response.output_item.added", "response.content_part.added",
                                            "response.output_text.done", "response.content_part.done",
                                            "response.output_item.done", "response.completed"]
    failing = ResponseEvents(_shape(), None)
    out = _decoded(failing.start() + failing.feed("he") + failing.failed("500", "engine lost", None))
    assert [e["type"] for e in out][-2:] == ["error", "response.failed"]
    assert out[-2]["message"] == "engine lost" and out[-1]["response"]["error"]["message"] == "engine lost"


# ---- the store alone ---------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _put(store: ResponseStore, owner: str, size: int) -> str:
    response_id = store.new_id()
    assert store.put(owner, response_id, b"{}", [], size)
    return response_id


def test_the_store_keeps_at_most_its_entries_and_bytes_oldest_out_first():
    store = ResponseStore(max_entries=2, max_bytes=100, ttl_s=60.0)
    a, b = _put(store, "k", 10), _put(store, "k", 10)
    c = _put(store, "k", 10)  # a third entry: the oldest goes
    assert store.get("k", a) is None and store.get("k", b) and store.get("k", c)
    d = _put(store, "k", 95)  # 20 + 95 > 100: b goes (also the entry bound), then c (bytes)
    assert store.get("k", b) is None and store.get("k", c) is None and store.get("k", d)
    assert store.bytes == 95 and len(store) == 1
    assert not store.put("k", store.new_id(), b"{}", [], 101)  # larger than the whole budget: not kept
    assert store.get("k", d) and store.bytes == 95


def test_the_store_forgets_after_its_ttl_and_answers_only_the_owner():
    clock = Clock()
    store = ResponseStore(max_entries=10, max_bytes=1000, ttl_s=30.0, clock=clock)
    kept = _put(store, owner_of([("authorization", "Bearer key-a")]), 10)
    assert store.get(owner_of([("authorization", "Bearer key-a")]), kept)
    assert store.get(owner_of([("authorization", "Bearer key-b")]), kept) is None
    assert store.get(owner_of([]), kept) is None and owner_of([]) == ""
    clock.now = 29.0
    assert store.get(owner_of([("authorization", "Bearer key-a")]), kept)
    clock.now = 30.0
    assert store.get(owner_of([("authorization", "Bearer key-a")]), kept) is None and store.bytes == 0


def test_ids_carry_the_replica_tag():
    here, there = ResponseStore(1, 1, 1.0), ResponseStore(1, 1, 1.0)
    assert here.made_here(here.new_id()) and not here.made_here(there.new_id())


def test_the_store_flags_reach_the_gateway_and_serve_hands_them_on():
    from gridserve.cli import _parser
    from gridserve.services.gateway.limits import gateway_argv

    args = _parser().parse_args(["serve", "m", "--enable-responses-store", "--responses-store-ttl-s", "5"])
    options = ResponsesStoreOptions.from_args(args)
    assert options.enable_responses_store and options.responses_store_ttl_s == 5.0
    argv = gateway_argv(args)
    assert "--enable-responses-store" in argv and argv[argv.index("--responses-store-ttl-s") + 1] == "5.0"
    gateway = _parser().parse_args(["gateway", *argv])
    assert ResponsesStoreOptions.from_args(gateway) == options
    assert ResponsesStoreOptions().store() is None and options.store().ttl_s == 5.0

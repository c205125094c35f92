"""Tool-call parsers on hand-written replies in each model family's published format.

Nothing can be captured from a real model offline: each fixture is written from the format's
published description (the URL above its group). Every fixture is read whole (``extract``) and
streamed in pieces of several sizes; the streamed content and the concatenated argument
fragments must equal the unary result. Malformed replies never raise: the text is the content.
"""

from __future__ import annotations

import json
import string

import pytest

from gridserve.services.gateway.tool_parsers import TOOL_PARSERS, ToolParser
from gridserve.services.gateway.tool_parsers.forced import NamedToolParser, RequiredToolParser
from gridserve.services.gateway.tool_parsers.json_scan import ObjectScanner, scan_object

WEATHER = {"city": "Paris", "unit": "celsius"}
CALL = ("get_weather", WEATHER)

# parser -> [(fixture name, reply, content, [(name, arguments), ...])]
FIXTURES = {
    # Hermes 2 Pro model card (https://huggingface.co/NousResearch/Hermes-2-Pro-Llama-3-8B) and Qwen's
    # function calling guide (https://qwen.readthedocs.io/en/latest/framework/function_call.html).
    "hermes": [
        ("one call", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                     "</tool_call>", None, [CALL]),
        ("content then two calls", 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                   '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
                                   '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
         "Let me check both.", [CALL, ("get_time", {"zone": "CET"})]),
        ("arguments before the name", '<tool_call>\n{"arguments": {"city": "Paris", "unit": "celsius"}, '
                                      '"name": "get_weather"}\n</tool_call>', None, [CALL]),
        ("nested arguments", '<tool_call>\n{"name": "book", "arguments": {"guests": [{"name": "A \\"B\\"", '
                             '"tags": ["x}", "{y"]}], "n": 2}}\n</tool_call>', None,
         [("book", {"guests": [{"name": 'A "B"', "tags": ["x}", "{y"]}], "n": 2})]),
        ("no call", "It is sunny in Paris.", "It is sunny in Paris.", []),
    ],
    # Llama 3.1 JSON-based tool calling
    # (https://www.llama.com/docs/model-cards-and-prompt-formats/llama3_1/#json-based-tool-calling).
    "llama3_json": [
        ("one call", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None, [CALL]),
        ("python tag, two calls", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                                  '"unit": "celsius"}}; {"name": "get_time", "parameters": {"zone": "CET"}}',
         None, [CALL, ("get_time", {"zone": "CET"})]),
        ("no call", "The weather in Paris is mild.", "The weather in Paris is mild.", []),
    ],
    # Mistral function calling (https://docs.mistral.ai/capabilities/function_calling/), tokenizer v3
    # (Mistral-7B-Instruct-v0.3) and v11+ (Mistral-Small-3.2) layouts in mistral-common.
    "mistral": [
        ("v3 array", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
         None, [CALL]),
        ("v3 content, two calls", 'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                                  '"unit": "celsius"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]',
         "Checking.", [CALL, ("get_time", {"zone": "CET"})]),
        ("v11 named", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
                      '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}', None, [CALL, ("get_time", {"zone": "CET"})]),
        ("no call", "Paris: 18 degrees.", "Paris: 18 degrees.", []),
    ],
    # Llama 3.2 zero-shot function calling
    # (https://github.com/meta-llama/llama-models/blob/main/models/llama3_2/text_prompt_format.md).
    "pythonic": [
        ("two calls", '[get_weather(city="Paris", unit="celsius"), get_time(zone=\'CET, Europe\')]', None,
         [CALL, ("get_time", {"zone": "CET, Europe"})]),
        ("literals", "[search(query='a(b)', limit=3, exact=True, filters={'lang': ['en', 'fr']}, since=None)]", None,
         [("search", {"query": "a(b)", "limit": 3, "exact": True, "filters": {"lang": ["en", "fr"]}, "since": None})]),
        ("llama 4 tags", '<|python_start|>[get_weather(city="Paris", unit="celsius")]<|python_end|>', None, [CALL]),
        ("no call", "I cannot check that.", "I cannot check that.", []),
    ],
    # OpenAI harmony (https://cookbook.openai.com/articles/openai-harmony): a commentary message to a function.
    "openai": [
        ("analysis then call", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
                               "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                               '{"city": "Paris", "unit": "celsius"}<|call|>', None, [CALL]),
        ("recipient in the role", "<|channel|>analysis<|message|>ok<|end|><|start|>assistant to=functions.get_time"
                                  '<|channel|>commentary json<|message|>{"zone": "CET"}<|call|>', None,
         [("get_time", {"zone": "CET"})]),
        ("final answer", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
                         "It is 18 degrees.<|return|>", "It is 18 degrees.", []),
    ],
}

MALFORMED = {
    "hermes": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "<tool_call>\nnot json\n</tool_call>",
               '<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"name": "f", "arguments": 3}\n</tool_call>'],
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": ', '{"nam": 1}', '{"name": "f"}; nonsense'],
    "mistral": ["[TOOL_CALLS] [{", "[TOOL_CALLS] not json", "[TOOL_CALLS]get_weather[ARGS]{broken",
                "[TOOL_CALLS] [1, 2]"],
    "pythonic": ["[get_weather(city=", "[get_weather('Paris')]", "[os.system(cmd=__import__('os'))]",
                 "[f(x={1, 2})]", "[]"],
    "openai": ["<|channel|>commentary to=functions.f <|constrain|>json<|message|>{not json<|call|>"],
}

CASES = [(name, *fixture) for name, fixtures in FIXTURES.items() for fixture in fixtures]


def _stream(parser: ToolParser, text: str, size: int) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Content, (name, arguments) per call, and ids, from streaming ``text`` in ``size``-character pieces."""
    deltas = [parser.stream(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, list[str]] = {}
    ids: dict[int, str] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index not in ids, "a call's id and name are sent once"
                ids[call.index] = call.id
                calls[call.index] = [call.name, ""]
            assert call.index in calls, "arguments only after the call's name"
            calls[call.index][1] += call.arguments
    return content, [(n, a) for n, a in calls.values()], list(ids.values())


@pytest.mark.parametrize("parser_name, fixture, text, content, calls", CASES)
def test_a_published_reply_parses_into_its_calls(parser_name, fixture, text, content, calls):
    extracted = TOOL_PARSERS[parser_name]().extract(text)
    assert extracted.content == content
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == calls
    assert len({c.id for c in extracted.calls}) == len(calls)


@pytest.mark.parametrize("size", [1, 3, 8])
@pytest.mark.parametrize("parser_name, fixture, text, content, calls", CASES)
def test_streamed_deltas_add_up_to_the_unary_result(parser_name, fixture, text, content, calls, size):
    unary = TOOL_PARSERS[parser_name]().extract(text)
    streamed_content, streamed_calls, ids = _stream(TOOL_PARSERS[parser_name](), text, size)
    assert streamed_content == (unary.content or "")
    assert streamed_calls == [(c.name, c.arguments) for c in unary.calls]
    assert len(set(ids)) == len(calls)


@pytest.mark.parametrize("parser_name, text", [(p, t) for p, texts in MALFORMED.items() for t in texts])
def test_a_malformed_reply_is_content_never_an_error(parser_name, text):
    extracted = TOOL_PARSERS[parser_name]().extract(text)
    assert extracted.calls == [] and extracted.content == text
    parser = TOOL_PARSERS[parser_name]()
    for i in range(0, len(text), 2):
        parser.stream(text[i:i + 2])
    parser.finish()  # a stream of it ends without raising too


@pytest.mark.parametrize("parser_name, fixture, text, content, calls", CASES)
def test_every_prefix_of_a_reply_parses_without_raising(parser_name, fixture, text, content, calls):
    for end in range(len(text) + 1):
        TOOL_PARSERS[parser_name]().extract(text[:end])


def test_a_stream_sends_the_name_before_the_arguments_are_complete():
    parser = TOOL_PARSERS["hermes"]()
    first = parser.stream('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert [(c.index, c.name) for c in first.tool_calls] == [(0, "get_weather")]
    assert first.tool_calls[0].id.startswith("call_") and first.tool_calls[0].arguments == '{"city": "Pa'
    second = parser.stream('ris"}}\n</tool_call>')
    assert [(c.id, c.name, c.arguments) for c in second.tool_calls] == [(None, None, 'ris"}')]


def test_mistral_call_ids_are_nine_alphanumerics():
    calls = TOOL_PARSERS["mistral"]().extract(FIXTURES["mistral"][0][1]).calls
    assert len(calls[0].id) == 9 and set(calls[0].id) <= set(string.ascii_letters + string.digits)


def test_required_output_is_the_calls_array():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, ' \
           '{"name": "get_time", "parameters": {}}]'
    extracted = RequiredToolParser().extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == [CALL, ("get_time", {})]
    assert _stream(RequiredToolParser(), text, 4)[1] == [(c.name, c.arguments) for c in extracted.calls]
    assert RequiredToolParser().extract('[{"name": "get_weather", "param').calls == []  # cut short: content


def test_named_output_is_the_arguments():
    extracted = NamedToolParser(function="get_weather").extract('{"city": "Paris", "unit": "celsius"}')
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == [CALL] and extracted.content is None
    streamed = _stream(NamedToolParser(function="get_weather"), '{"city": "Paris", "unit": "celsius"}', 5)
    assert streamed[1] == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]


def test_every_parser_cites_its_format():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic", "openai"} == set(FIXTURES)
    assert all(parser.source.startswith("https://") for parser in TOOL_PARSERS.values())


@pytest.mark.parametrize("text", [
    '{"name": "f", "arguments": {"a": "x\\\\\\"y}", "b": [1, {"c": null}], "d": -1.5e3}}',
    '{ "arguments" : { } , "name" : "g" }', '{"name": "h", "arguments": "{\\"a\\": 1}"}', '{"a": tru', '{"a" 1}',
])
def test_the_resumable_scanner_reads_a_growing_object_as_a_whole_scan_does(text):
    for step in (1, 2, 5):
        scanner = ObjectScanner()
        for end in range(step, len(text) + step, step):
            resumed, whole = scanner.scan(text[:end]), scan_object(text[:end])
            assert (resumed.fields, resumed.end, resumed.broken) == (whole.fields, whole.end, whole.broken), text[:end]

"""``mistral``: Mistral's ``[TOOL_CALLS]`` control token, in either of its two layouts::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]     (tokenizer v3, e.g. Mistral-7B-Instruct-v0.3)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                            (tokenizer v11+, e.g. Mistral-Small-3.2)

Text before ``[TOOL_CALLS]`` is content. ``[TOOL_CALLS]`` is a special token: the route keeps
special tokens in the text for this parser. Tool call ids are 9 alphanumerics, which Mistral's
chat templates require. Published in mistral-common's tokenizer
(https://github.com/mistralai/mistral-common, ``InstructTokenizerV3`` / ``V11``) and the function
calling guide (https://docs.mistral.ai/capabilities/function_calling/).
"""

from __future__ import annotations

import json
import secrets
import string

from gridserve.services.gateway.tool_parsers.base import (
    ExtractedToolCalls,
    PartialCall,
    ToolCall,
    ToolParser,
    call_from_json,
    partial_json_call,
)
from gridserve.services.gateway.tool_parsers.json_scan import (
    WHITESPACE,
    ArrayScanner,
    array_items,
    value_end,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS, ARGS)
    start_markers = (TOOL_CALLS,)
    source = "https://docs.mistral.ai/capabilities/function_calling/"

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        self._items = ArrayScanner()

    def new_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def extract(self, text: str) -> ExtractedToolCalls:
        at = text.find(TOOL_CALLS)
        if at < 0:
            return ExtractedToolCalls.text(text)
        section = text[at:]
        calls = _named_calls(section) if ARGS in section else _json_calls(section[len(TOOL_CALLS):])
        if not calls:
            return ExtractedToolCalls.text(text)
        for call in calls:
            call.id = self.new_id()
        return ExtractedToolCalls(text[:at].rstrip() or None, calls)

    def partial_calls(self, section: str) -> list[PartialCall]:
        body = section[len(TOOL_CALLS):].lstrip()
        if body.startswith("["):
            items = self._items.scan(body)
            return [c for c in (partial_json_call(item, scanner=self.scanner(i)) for i, item in enumerate(items))
                    if c is not None]
        if body.startswith("{"):
            call = partial_json_call(body, scanner=self.scanner(0))
            return [call] if call is not None else []
        calls = []
        for chunk in section.split(TOOL_CALLS)[1:]:
            name, found, arguments = chunk.partition(ARGS)
            if not found:
                if name.strip() and not name.strip().isidentifier():
                    break
                calls.append(PartialCall(None))
                break
            end = value_end(arguments.lstrip(), 0)
            raw = arguments.lstrip()
            calls.append(PartialCall(name.strip(), raw[:end] if end is not None else raw.rstrip(WHITESPACE)))
        return calls


def _named_calls(section: str) -> list[ToolCall]:
    """``[TOOL_CALLS]name[ARGS]{...}`` repeated; [] if any of them is malformed."""
    calls = []
    for chunk in section.split(TOOL_CALLS)[1:]:
        name, found, arguments = chunk.partition(ARGS)
        arguments = arguments.strip()
        if not found or not name.strip() or not _is_object(arguments):
            return []
        calls.append(ToolCall(name.strip(), arguments))
    return calls


def _json_calls(body: str) -> list[ToolCall]:
    """A JSON array of call objects (or one object); [] if malformed."""
    body = body.strip()
    items = array_items(body) if body.startswith("[") else [body]
    if body.startswith("[") and value_end(body, 0) != len(body):
        return []
    calls = [call_from_json(item) for item in items]
    return [c for c in calls if c is not None] if calls and all(calls) else []


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False

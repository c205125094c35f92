"""``llama3_json``: Llama 3.1 / 3.2 / 4 JSON-based tool calling — the whole reply is the call::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after ``<|python_tag|>``; several calls are separated by ``;``. A reply that does not
begin with a call is plain content. Published in Meta's Llama 3.1 prompt format
(https://www.llama.com/docs/model-cards-and-prompt-formats/llama3_1/#json-based-tool-calling).
"""

from __future__ import annotations

from gridserve.services.gateway.tool_parsers.base import (
    ExtractedToolCalls,
    PartialCall,
    ToolParser,
    call_from_json,
    partial_json_call,
)
from gridserve.services.gateway.tool_parsers.json_scan import split_top_level

PYTHON_TAG = "<|python_tag|>"
KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)
    source = "https://www.llama.com/docs/model-cards-and-prompt-formats/llama3_1/#json-based-tool-calling"

    def section_start(self, text: str) -> tuple[int, bool]:
        body = text.lstrip()
        lead = len(text) - len(body)
        if body.startswith(PYTHON_TAG) or body.startswith("{"):
            return lead, True
        if PYTHON_TAG.startswith(body):  # empty so far, or the tag's beginning
            return 0, False
        return len(text), False

    def extract(self, text: str) -> ExtractedToolCalls:
        body = _body(text)
        if body is None:
            return ExtractedToolCalls.text(text)
        calls = []
        for part in split_top_level(body, ";"):
            if not part.strip():
                continue
            call = call_from_json(part, KEYS)
            if call is None:
                return ExtractedToolCalls.text(text)
            calls.append(call)
        return ExtractedToolCalls(None, calls) if calls else ExtractedToolCalls.text(text)

    def partial_calls(self, section: str) -> list[PartialCall]:
        body = _body(section)
        calls = []
        for i, part in enumerate(split_top_level(body or "", ";")):
            call = partial_json_call(part, KEYS, self.scanner(i))
            if call is None:
                break
            calls.append(call)
        return calls


def _body(text: str) -> str | None:
    """The calls' text (after the optional tag), or None when the reply does not begin with one."""
    body = text.strip().removeprefix(PYTHON_TAG).lstrip()
    return body if body.startswith("{") else None

"""``hermes``: Hermes 2 Pro / Hermes 3, Qwen2.5 and Qwen3 — each call a JSON object in tags::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text before the first ``<tool_call>`` is the message's content; several calls are several tagged
blocks. Published in the Hermes-2-Pro model card (https://huggingface.co/NousResearch/Hermes-2-Pro-Llama-3-8B)
and Qwen's function-calling guide (https://qwen.readthedocs.io/en/latest/framework/function_call.html).
"""

from __future__ import annotations

from gridserve.services.gateway.tool_parsers.base import (
    ExtractedToolCalls,
    PartialCall,
    ToolParser,
    call_from_json,
    partial_json_call,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (OPEN, CLOSE)
    start_markers = (OPEN,)
    source = "https://qwen.readthedocs.io/en/latest/framework/function_call.html"

    def extract(self, text: str) -> ExtractedToolCalls:
        at = text.find(OPEN)
        if at < 0:
            return ExtractedToolCalls.text(text)
        calls = []
        for block in text[at:].split(OPEN)[1:]:
            call = call_from_json(block.split(CLOSE, 1)[0])
            if call is None:
                return ExtractedToolCalls.text(text)
            calls.append(call)
        return ExtractedToolCalls(text[:at].rstrip() or None, calls)

    def partial_calls(self, section: str) -> list[PartialCall]:
        calls = []
        for i, block in enumerate(section.split(OPEN)[1:]):
            call = partial_json_call(block.split(CLOSE, 1)[0], scanner=self.scanner(i))
            if call is None:
                break
            calls.append(call)
        return calls

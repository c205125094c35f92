"""``openai``: gpt-oss tool calls in the harmony format — a message on the ``commentary`` channel
addressed to a function, its body the arguments::

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location": "Paris"}<|call|>

The message's content is the ``final`` channel (and commentary preambles addressed to nobody);
``analysis`` is reasoning, left to the ``openai_gptoss`` reasoning parser. This parser reads the
whole reply, not only what a reasoning parser leaves of it. Format: ``services/gateway/harmony.py``
(https://cookbook.openai.com/articles/openai-harmony).
"""

from __future__ import annotations

import json

from gridserve.services.gateway import harmony
from gridserve.services.gateway.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedDelta,
    PartialCall,
    SentCall,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)


class OpenAIToolParser(ToolParser):
    name = "openai"
    markers = harmony.MARKERS
    source = harmony.SOURCE
    reads_whole_reply = True

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        self._bodies = harmony.BodyStream()
        self._call_of: dict[int, int] = {}  # message index -> tool call index

    def extract(self, text: str) -> ExtractedToolCalls:
        messages = harmony.messages_of(text)
        if harmony.MESSAGE not in text:
            return ExtractedToolCalls.text(text)
        content = "".join(m.body for m in messages if m.is_content) or None
        calls = [ToolCall(m.function, m.body) for m in messages if m.function and m.has_body]
        if not all(_is_object(c.arguments) for c in calls):
            return ExtractedToolCalls(content or text, [])
        return ExtractedToolCalls(content, calls)

    def partial_calls(self, section: str) -> list[PartialCall]:
        return [PartialCall(m.function, m.body) for m in harmony.messages_of(section, hold_back=True)
                if m.function and m.has_body]

    def stream(self, delta: str) -> ParsedDelta:
        return self._deltas(self._bodies.feed(delta))

    def finish(self) -> ParsedDelta:
        rest = self._bodies.finish()
        return ParsedDelta(content=self._bodies.text) if rest is None else self._deltas(rest)

    def _deltas(self, bodies: list[tuple[int, harmony.HarmonyMessage, str]]) -> ParsedDelta:
        out = ParsedDelta()
        for i, message, new in bodies:
            if message.function and message.has_body:
                out.tool_calls.append(self._call_delta(i, message.function, new))
            elif message.is_content:
                out.content += new
        out.tool_calls = [d for d in out.tool_calls if d.id or d.arguments]
        return out

    def _call_delta(self, message_index: int, function: str, arguments: str) -> ToolCallDelta:
        if message_index in self._call_of:
            index = self._call_of[message_index]
            self._sent[index].arguments += arguments
            return ToolCallDelta(index, arguments=arguments)
        index = self._call_of[message_index] = len(self._sent)
        sent = SentCall(self.new_id(), function, arguments)
        self._sent.append(sent)
        return ToolCallDelta(index, sent.id, function, arguments)


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False

"""``openai_gptoss``: gpt-oss's harmony format — the ``analysis`` channel is the reasoning, the
``final`` channel (and commentary preambles) the content; tool-call messages are left to the
``openai`` tool parser. Format: ``services/gateway/harmony.py``
(https://cookbook.openai.com/articles/openai-harmony)."""

from __future__ import annotations

from typing import Optional

from gridserve.services.gateway import harmony
from gridserve.services.gateway.reasoning_parsers.base import ReasoningParser, SpecialId, lark_token
from gridserve.services.gateway.tool_parsers.base import ParsedDelta


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    markers = harmony.MARKERS
    source = harmony.SOURCE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._bodies = harmony.BodyStream()

    def extract(self, text: str) -> tuple[Optional[str], Optional[str]]:
        if harmony.MESSAGE not in text:
            return None, text or None
        messages = harmony.messages_of(text)
        reasoning = "".join(m.body for m in messages if m.is_reasoning)
        content = "".join(m.body for m in messages if m.is_content)
        return reasoning or None, content or None

    def stream(self, delta: str) -> ParsedDelta:
        return self._deltas(self._bodies.feed(delta))

    def finish(self) -> ParsedDelta:
        rest = self._bodies.finish()
        return ParsedDelta(content=self._bodies.text) if rest is None else self._deltas(rest)

    def _deltas(self, bodies: list[tuple[int, harmony.HarmonyMessage, str]]) -> ParsedDelta:
        out = ParsedDelta()
        for _, message, new in bodies:
            if message.is_reasoning:
                out.reasoning += new
            elif message.is_content:
                out.content += new
        return out

    def grammar_prefix(self, special_id: SpecialId) -> Optional[str]:
        def tok(marker: str) -> str:
            return lark_token(marker, special_id)

        analysis = (f'{tok(harmony.CHANNEL)} "analysis" {tok(harmony.MESSAGE)} analysis_text {tok(harmony.END)} '
                    f'{tok(harmony.START)} "assistant"')
        return "\n".join([f'reasoning_prefix: ({analysis})? {tok(harmony.CHANNEL)} "final" {tok(harmony.MESSAGE)}',
                          "analysis_text: /(?s:.*)/"])

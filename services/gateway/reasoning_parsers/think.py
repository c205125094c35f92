"""Reasoning between ``<think>`` and ``</think>``: the base of ``deepseek_r1`` and ``qwen3``.

The two differ in one thing, what a reply without ``<think>`` means: DeepSeek-R1 is reasoning
from its first token (its template opens the tag in the prompt), Qwen3 is answering (thinking
off, or a model that chose not to think). Both treat a reply whose ``</think>`` never came as all
reasoning (cut short by ``max_tokens``). The content's leading whitespace (``</think>\\n\\n``) is
dropped; the reasoning is kept as written.
"""

from __future__ import annotations

import re
from typing import ClassVar, Optional

from gridserve.services.gateway.reasoning_parsers.base import (
    PromptState,
    ReasoningParser,
    SpecialId,
    lark_token,
)
from gridserve.services.gateway.tool_parsers.base import ParsedDelta, held_back

START, END = "<think>", "</think>"
WHITESPACE = " \t\r\n"


class ThinkReasoningParser(ReasoningParser):
    """``<think>reasoning</think>content``; ``reasons_without_tag``: a reply without ``<think>``
    is reasoning (DeepSeek-R1) or content (Qwen3)."""

    markers = (START, END)
    reasons_without_tag: ClassVar[bool] = True

    def __init__(self, prompt: PromptState = PromptState.NONE) -> None:
        super().__init__(prompt)
        self._text = ""
        self._at = 0  # what of the text has been given out
        self._phase = "content" if prompt is PromptState.ENDED else "start"
        self._content_started = False

    @classmethod
    def prompt_state(cls, prompt_tail: str) -> PromptState:
        tail = prompt_tail.rstrip(WHITESPACE)
        if tail.endswith(END):
            return PromptState.ENDED
        if tail.endswith(START):
            return PromptState.STARTED
        return PromptState.NONE

    @property
    def _reasons_first(self) -> bool:
        return self.reasons_without_tag or self.prompt is PromptState.STARTED

    def extract(self, text: str) -> tuple[Optional[str], Optional[str]]:
        if self.prompt is PromptState.ENDED:
            return None, text.lstrip(WHITESPACE) or None
        body = text.lstrip(WHITESPACE)
        if body.startswith(START):
            body = body[len(START):]
        elif not self._reasons_first:
            return None, body or None
        else:
            body = text
        reasoning, found, content = body.partition(END)
        if not found:
            return reasoning or None, None
        return reasoning or None, content.lstrip(WHITESPACE) or None

    def stream(self, delta: str) -> ParsedDelta:
        self._text += delta
        out = ParsedDelta()
        if self._phase == "start":
            self._start()
        if self._phase == "reasoning":
            end = self._text.find(END, self._at)
            if end < 0:
                safe = len(self._text) - held_back(self._text[self._at:], (END,))
                out.reasoning, self._at = self._text[self._at:safe], safe
                return out
            out.reasoning, self._at, self._phase = self._text[self._at:end], end + len(END), "content"
        if self._phase == "content":
            out.content = self._content()
        return out

    def finish(self) -> ParsedDelta:
        rest, self._at = self._text[self._at:], len(self._text)
        if self._phase == "reasoning" or (self._phase == "start" and self._reasons_first):
            return ParsedDelta(reasoning=rest)
        if not self._content_started:
            rest = rest.lstrip(WHITESPACE)
        return ParsedDelta(content=rest)

    def _start(self) -> None:
        """Decide, once the reply's first characters are in, whether it begins with reasoning."""
        body = self._text[self._at:].lstrip(WHITESPACE)
        if body.startswith(START):
            self._at, self._phase = len(self._text) - len(body) + len(START), "reasoning"
        elif body and not START.startswith(body):
            self._phase = "reasoning" if self._reasons_first else "content"

    def _content(self) -> str:
        if not self._content_started:
            while self._at < len(self._text) and self._text[self._at] in WHITESPACE:
                self._at += 1
            self._content_started = self._at < len(self._text)
        text, self._at = self._text[self._at:], len(self._text)
        return text

    def grammar_prefix(self, special_id: SpecialId) -> Optional[str]:
        if self.prompt is PromptState.ENDED:
            return None
        start, end = lark_token(START, special_id), lark_token(END, special_id)
        if special_id(END) is not None:  # a special token ends the text: any text before it
            text = "think_text: /(?s:.*)/ " + end
        else:
            text = "think_text[lazy]: /(?s:.*)" + re.escape(END).replace("/", "\\/") + "/"
        opening = f"{start}?" if self._reasons_first else start
        rule = f"reasoning_prefix: {opening} think_text think_sep?"
        if not self._reasons_first:  # the reply may answer without thinking
            rule = f"reasoning_prefix: ({opening} think_text think_sep?)?"
        return "\n".join([rule, text, r"think_sep: /[ \t\r\n]+/"])

"""The contract of a reasoning parser: a reply's reasoning split from its content.

Reasoning models think before they answer, in a format of their own (``<think>...</think>``,
harmony's ``analysis`` channel). A ``ReasoningParser`` splits a reply into ``reasoning_content``
and ``content``: ``extract`` for a whole reply, ``stream`` / ``finish`` delta by delta (one parser
per choice; a marker split over two deltas is held back until it is whole). What the prompt
already did matters: a chat template may open the reasoning (DeepSeek-R1 ends the prompt with
``<think>``) or close it (Qwen3 with ``enable_thinking: false`` renders an empty
``<think></think>``), which ``PromptState`` reads off the prompt's tail.

``grammar_prefix`` is how structured output (and forced tool calls) start only after the
reasoning: the Lark rules of the reasoning part, which the gateway puts in front of the
constraint (``shared/structured_output.py`` ``after_prefix``), so the model thinks freely and the
constraint applies from the end of the reasoning on.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, Optional

from gridserve.services.gateway.tool_parsers.base import ParsedDelta

# A marker's id when it is one added token of the model's tokenizer (None: an ordinary string there).
SpecialId = Callable[[str], Optional[int]]


class PromptState(enum.Enum):
    """How far the prompt itself took the reasoning."""

    NONE = "none"  # the reply decides
    STARTED = "started"  # the prompt opened it: the reply begins inside the reasoning
    ENDED = "ended"  # the prompt closed it (reasoning off): the reply is all content


class ReasoningParser(ABC):
    """Splits one choice's reply into reasoning and content (see the module docstring)."""

    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()  # special tokens among them: the route keeps them in the text
    source: ClassVar[str] = ""

    def __init__(self, prompt: PromptState = PromptState.NONE) -> None:
        self.prompt = prompt

    @classmethod
    def prompt_state(cls, prompt_tail: str) -> PromptState:
        """What the end of the rendered prompt says about the reasoning."""
        return PromptState.NONE

    @abstractmethod
    def extract(self, text: str) -> tuple[Optional[str], Optional[str]]:
        """``(reasoning, content)`` of a whole reply (None for an empty part)."""

    @abstractmethod
    def stream(self, delta: str) -> ParsedDelta:
        """The reasoning and content that ``delta`` adds (``ParsedDelta.reasoning`` / ``.content``)."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """What was held back, at the end of the reply."""

    @abstractmethod
    def grammar_prefix(self, special_id: SpecialId) -> Optional[str]:
        """Lark rules defining ``reasoning_prefix`` (what comes before the constrained part), or
        None when the reply starts with the constrained part (the prompt ended the reasoning).
        ``special_id`` gives a marker's id when it is one added token of the tokenizer: llguidance
        reads those as special tokens, named by id (``<[id]>``) in Lark, never by their text."""


def lark_token(marker: str, special_id: SpecialId) -> str:
    """A marker in Lark: its special token by id, or the literal string."""
    token_id = special_id(marker)
    if token_id is not None:
        return f"<[{token_id}]>"
    return '"' + marker.replace("\\", "\\\\").replace('"', '\\"') + '"'

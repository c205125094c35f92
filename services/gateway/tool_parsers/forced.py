"""The outputs of forced tool calls (``tool_choice`` ``"required"`` or a named function).

These are not a model's own format: structured output makes the model write exactly this
(``services/gateway/tool_choice.py`` builds the schemas), so the text parses straight into calls:

- ``"required"``: a JSON array of ``{"name": ..., "parameters": {...}}`` objects;
- a named function: the arguments object itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

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

KEYS = ("parameters",)


class RequiredToolParser(ToolParser):
    """``tool_choice: "required"``: the reply is ``[{"name": ..., "parameters": {...}}, ...]``."""

    name = "required"

    def __init__(self, tools: Optional[Sequence[dict[str, Any]]] = None) -> None:
        super().__init__(tools)
        self._items = ArrayScanner()

    def section_start(self, text: str) -> tuple[int, bool]:
        return 0, True

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if not body.startswith("[") or value_end(body, 0) != len(body):
            return ExtractedToolCalls.text(text)
        calls = [call_from_json(item, KEYS) for item in array_items(body)]
        if not calls or not all(calls):
            return ExtractedToolCalls.text(text)
        return ExtractedToolCalls(None, [c for c in calls if c is not None])

    def partial_calls(self, section: str) -> list[PartialCall]:
        body = section.lstrip()
        if not body.startswith("["):
            return []
        calls = []
        for i, item in enumerate(self._items.scan(body)):
            call = partial_json_call(item, KEYS, self.scanner(i))
            if call is None:
                break
            calls.append(call)
        return calls


class NamedToolParser(ToolParser):
    """A named ``tool_choice``: the whole reply is that function's arguments object. A reply cut
    short (``finish_reason: "length"``) is still the call, as vLLM answers it."""

    name = "named"

    def __init__(self, tools: Optional[Sequence[dict[str, Any]]] = None, function: str = "") -> None:
        super().__init__(tools)
        self.function = function

    def section_start(self, text: str) -> tuple[int, bool]:
        return 0, True

    def extract(self, text: str) -> ExtractedToolCalls:
        arguments = text.strip()
        return ExtractedToolCalls(None, [ToolCall(self.function, arguments)]) if arguments else \
            ExtractedToolCalls(None, [])

    def partial_calls(self, section: str) -> list[PartialCall]:
        arguments = section.strip(WHITESPACE)
        return [PartialCall(self.function, arguments)] if arguments else []


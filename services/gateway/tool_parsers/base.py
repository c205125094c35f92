"""The contract of a tool-call parser, and the streaming that every format shares.

A model asked to call tools writes the calls in its own format (Hermes' ``<tool_call>`` JSON,
Llama's bare JSON, Mistral's ``[TOOL_CALLS]``, Python call syntax, harmony messages). A
``ToolParser`` turns that text into OpenAI's ``tool_calls``:

- ``extract(text)`` reads a whole output (a unary response): the content before the calls, and the
  calls. Output that does not parse is never an error: it all comes back as content, no calls.
- ``stream(delta)`` reads it delta by delta and answers what to send now (``ParsedDelta``):
  content until the calls begin, then per call its id and name once, then argument fragments;
  ``finish()`` ends the stream with what was held back, checked against ``extract`` of the whole.

One parser object serves one choice (it holds the stream's state). A format describes itself by
two hooks: ``section_start`` (where the calls begin, and how much text to hold back because it
may be the start of a marker) and ``partial_calls`` (the calls in the text so far, each with the
part of its arguments that can already be sent: always a prefix of the final arguments text, so
the fragments a client concatenates equal the unary ``arguments``).
"""

from __future__ import annotations

import json
import logging
import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from gridserve.services.gateway.tool_parsers.json_scan import WHITESPACE, ObjectScanner, scan_object

logger = logging.getLogger(__name__)


def new_call_id() -> str:
    """An OpenAI-style tool call id (``call_`` and 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's ``arguments``)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


@dataclass
class ExtractedToolCalls:
    """A whole output split into its content (None when there is none) and its calls."""

    content: Optional[str]
    calls: list[ToolCall]

    @classmethod
    def text(cls, text: str) -> ExtractedToolCalls:
        """No calls: everything is content."""
        return cls(text or None, [])


@dataclass
class ToolCallDelta:
    """What one stream step adds to call ``index``: its id and name the first time, then arguments."""

    index: int
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    """What one stream step adds to the assistant message."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls
        return self


@dataclass
class PartialCall:
    """A call as far as the text goes: its name once known, the arguments text sendable so far."""

    name: Optional[str]
    arguments: str = ""


@dataclass
class SentCall:
    """A call the stream has announced, and the arguments sent for it so far."""

    id: str
    name: str
    arguments: str


class ToolParser(ABC):
    """Turns a model's tool-call format into OpenAI ``tool_calls`` (see the module docstring).

    ``markers``: the texts the format is recognized by; when one of them is a special token of the
    model's tokenizer, the route keeps special tokens in the output text (else they are skipped
    and the parser would never see them). ``start_markers``: where the calls begin (the default
    ``section_start`` finds the first one anywhere in the text)."""

    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()
    start_markers: ClassVar[tuple[str, ...]] = ()
    source: ClassVar[str] = ""  # where the format is published
    reads_whole_reply: ClassVar[bool] = False  # parses the reasoning too (harmony), not what a reasoning parser leaves

    def __init__(self, tools: Optional[Sequence[dict[str, Any]]] = None) -> None:
        self.tools = list(tools or [])
        self._text = ""
        self._content_sent = 0
        self._section: Optional[int] = None
        self._sent: list[SentCall] = []
        self._scanners: list[ObjectScanner] = []

    # ---- a format's hooks ---------------------------------------------------------------------
    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """The content and calls of a whole output."""

    @abstractmethod
    def partial_calls(self, section: str) -> list[PartialCall]:
        """The calls in ``section`` (the text from where the calls begin) so far."""

    def section_start(self, text: str) -> tuple[int, bool]:
        """``(n, True)``: the calls begin at ``text[n]``; ``(n, False)``: no calls yet, and
        ``text[:n]`` is content for sure (the rest might be the start of a marker)."""
        found = [at for marker in self.start_markers if (at := text.find(marker)) >= 0]
        if found:
            return min(found), True
        return len(text) - held_back(text, self.start_markers), False

    def new_id(self) -> str:
        return new_call_id()

    def scanner(self, index: int) -> ObjectScanner:
        """The resumable scanner of call ``index``'s JSON while it streams (each delta costs what it adds)."""
        while len(self._scanners) <= index:
            self._scanners.append(ObjectScanner())
        return self._scanners[index]

    # ---- streaming ----------------------------------------------------------------------------
    def stream(self, delta: str) -> ParsedDelta:
        """What to send for ``delta``, the next piece of the output."""
        self._text += delta
        out = ParsedDelta()
        if self._section is None:
            end, started = self.section_start(self._text)
            section = end
            end = len(self._text[:end].rstrip(WHITESPACE))  # whitespace waits for what follows it
            if end > self._content_sent:
                out.content = self._text[self._content_sent:end]
                self._content_sent = end
            if not started:
                return out
            self._section = section
        out.tool_calls = self._call_deltas(self.partial_calls(self._text[self._section:]))
        return out

    def finish(self) -> ParsedDelta:
        """The end of the stream: what was held back, reconciled with ``extract`` of the whole text."""
        final = self.extract(self._text)
        out = ParsedDelta()
        if not final.calls:
            if self._sent:
                logger.warning("%s: the streamed tool calls did not parse at the end", self.name)
            else:
                out.content = self._text[self._content_sent:]
            return out
        content = final.content or ""
        if len(content) > self._content_sent and content.startswith(self._text[:self._content_sent]):
            out.content = content[self._content_sent:]
        out.tool_calls = self._call_deltas([PartialCall(c.name, c.arguments) for c in final.calls], final=True)
        return out

    @property
    def called(self) -> bool:
        """Whether the stream has sent a tool call."""
        return bool(self._sent)

    def _call_deltas(self, partials: list[PartialCall], final: bool = False) -> list[ToolCallDelta]:
        deltas = []
        for index, partial in enumerate(partials):
            if index < len(self._sent):
                sent = self._sent[index]
                if len(partial.arguments) > len(sent.arguments) and partial.arguments.startswith(sent.arguments):
                    deltas.append(ToolCallDelta(index, arguments=partial.arguments[len(sent.arguments):]))
                    sent.arguments = partial.arguments
                elif final and partial.arguments != sent.arguments:
                    logger.warning("%s: call %d's streamed arguments differ from the final ones", self.name, index)
                continue
            if partial.name is None:
                break  # the calls are announced in order
            sent = SentCall(self.new_id(), partial.name, partial.arguments)
            self._sent.append(sent)
            deltas.append(ToolCallDelta(index, sent.id, sent.name, sent.arguments))
        return deltas


def held_back(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could be the start of one of ``markers``."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


# ---- JSON call objects ({"name": ..., "arguments": {...}}), shared by the JSON formats --------------
def call_from_json(text: str, argument_keys: Sequence[str] = ("arguments", "parameters")) -> Optional[ToolCall]:
    """The call a JSON object's text describes; None if it is not one. ``arguments`` is the raw
    text of the arguments object as written (what streaming sent), or a JSON string's content."""
    text = text.strip()
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((k for k in argument_keys if k in value), None)
    if key is None:
        return ToolCall(value["name"], "{}")
    arguments = value[key]
    if isinstance(arguments, str):  # a model that writes the arguments as a JSON string
        return ToolCall(value["name"], arguments) if _is_json_object(arguments) else None
    if not isinstance(arguments, dict):
        return None
    raw = scan_object(text).fields.get(key)
    return ToolCall(value["name"], raw.raw if raw is not None and raw.complete else json.dumps(arguments))


def partial_json_call(text: str, argument_keys: Sequence[str] = ("arguments", "parameters"),
                      scanner: Optional[ObjectScanner] = None) -> Optional[PartialCall]:
    """The call in a JSON object's text that may still be growing; None if it cannot be one.
    ``scanner``: the call's resumable scanner (a stream's), else the text is scanned whole."""
    text = text.lstrip()
    if not text:
        return PartialCall(None)
    obj = scanner.scan(text) if scanner is not None else scan_object(text)
    if obj.broken:
        return None
    name = None
    name_field = obj.fields.get("name")
    if name_field is not None and name_field.complete:
        decoded = _decoded(name_field.raw)
        name = decoded if isinstance(decoded, str) and decoded else None
    arguments = ""
    raw = next((obj.fields[k] for k in argument_keys if k in obj.fields), None)
    if raw is not None:
        if raw.raw.startswith('"'):  # a JSON string: sent once decoded, whole
            decoded = _decoded(raw.raw) if raw.complete else None
            arguments = decoded if isinstance(decoded, str) else ""
        else:
            arguments = raw.raw if raw.complete else raw.raw.rstrip(WHITESPACE)
    return PartialCall(name, arguments)


def _decoded(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _is_json_object(text: str) -> bool:
    return isinstance(_decoded(text), dict)

"""A Responses API reply in OpenAI's shapes: the output items of a whole reply, and the server-sent
events of a streamed one.

The reply, split by the chat plan (``ChatMessageParts``: reasoning, content, tool calls), becomes
items in the order the model wrote them: a ``reasoning`` item (with ``--reasoning-parser``), a
``message`` with one ``output_text`` part, then one ``function_call`` item per call. A reply with
calls and no text has no message; any other reply has one, even empty. Streamed, the same items
are opened and closed one after the other::

    response.created, response.in_progress,
    (response.output_item.added, response.content_part.added,
     response.reasoning_text.delta* | response.output_text.delta*,
     response.reasoning_text.done | response.output_text.done, response.content_part.done,
     response.output_item.done)
    | (response.output_item.added, response.function_call_arguments.delta*,
       response.function_call_arguments.done, response.output_item.done) ...,
    response.completed | response.incomplete (max_output_tokens reached)

each ``event: <type>`` with the event as JSON data, numbered by ``sequence_number``. A failure
after the stream started is an ``error`` event, then ``response.failed``.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from gridserve.services.gateway.chat_output import ChatMessageParts, ChoiceParser
from gridserve.services.gateway.protocol import AssistantToolCall, FunctionCall
from gridserve.services.gateway.responses_protocol import (
    FunctionCallItem,
    IncompleteDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseErrorInfo,
    ResponseObject,
    ResponseStreamEvent,
    ResponseUsage,
)
from gridserve.services.gateway.tool_parsers import ParsedDelta, ToolCall, ToolCallDelta
from gridserve.shared.outputs import RequestOutput


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def status_of(finish_reason: Optional[str]) -> str:
    """The response's status: ``incomplete`` when the output hit ``max_output_tokens``."""
    return "incomplete" if finish_reason == "length" else "completed"


def usage_of(out: Optional[RequestOutput]) -> Optional[ResponseUsage]:
    if out is None:
        return None
    prompt, output = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return ResponseUsage(input_tokens=prompt, output_tokens=output, total_tokens=prompt + output)


def output_items(parts: ChatMessageParts, status: str = "completed") -> list[OutputItem]:
    """A whole reply's items."""
    items: list[OutputItem] = []
    if parts.reasoning:
        items.append(ReasoningItem(id=item_id("rs"), status=status, content=[ReasoningText(text=parts.reasoning)]))
    if parts.content or not parts.tool_calls:
        items.append(OutputMessage(id=item_id("msg"), status=status, content=[OutputText(text=parts.content or "")]))
    items += [FunctionCallItem(id=item_id("fc"), call_id=call.id, name=call.name, arguments=call.arguments,
                               status=status) for call in parts.tool_calls]
    return items


def assistant_turn(parts: ChatMessageParts) -> dict[str, Any]:
    """The reply as a chat-template message (what a follow-up's conversation continues from)."""
    message: dict[str, Any] = {"role": "assistant", "content": parts.content or ""}
    if parts.reasoning:
        message["reasoning_content"] = parts.reasoning
    if parts.tool_calls:  # as an input function_call item becomes (arguments parsed, as vLLM)
        message["tool_calls"] = [AssistantToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                                 .for_template() for c in parts.tool_calls]
    return message


@dataclass
class ResponseShape:
    """What every response object of one request repeats: its id and the request's settings."""

    id: str
    model: str
    store: bool
    echo: dict[str, Any] = field(default_factory=dict)  # instructions, tools, temperature, ...
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[OutputItem], usage: Optional[ResponseUsage] = None,
                 error: Optional[ResponseErrorInfo] = None) -> ResponseObject:
        incomplete = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        return ResponseObject(id=self.id, created_at=self.created_at, status=status, model=self.model,
                              output=output, store=self.store, usage=usage, error=error,
                              incomplete_details=incomplete, **self.echo)


def sse(event: ResponseStreamEvent) -> bytes:
    return f"event: {event.type}\ndata: ".encode() + event.dumps() + b"\n\n"


@dataclass
class _OpenItem:
    """An item being streamed: its kind, id, output index and what it has so far."""

    kind: str  # "reasoning", "message" or "function_call"
    id: str
    index: int
    text: str = ""  # the text, or the call's arguments
    call_id: str = ""
    name: str = ""


class ResponseEvents:
    """The events of one streamed response, fed the reply's text step by step (see the module
    docstring); ``parser`` (None: the reply is plain text) splits reasoning, content and calls."""

    def __init__(self, shape: ResponseShape, parser: Optional[ChoiceParser]) -> None:
        self.shape, self.parser = shape, parser
        self.sequence = 0
        self.items: list[_OpenItem] = []
        self.open: Optional[_OpenItem] = None
        self.calls: dict[int, _OpenItem] = {}  # a tool call's index -> its item
        self.status = "in_progress"
        self.final: Optional[ResponseObject] = None

    def start(self) -> list[bytes]:
        response = self.shape.response("in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def feed(self, text: str) -> list[bytes]:
        return self._add(self.parser.feed(text) if self.parser is not None else ParsedDelta(content=text))

    def finish(self, finish_reason: Optional[str], out: Optional[RequestOutput]) -> list[bytes]:
        """The held-back text, the last item's end and ``response.completed`` (or ``.incomplete``)."""
        events = self._add(self.parser.finish()) if self.parser is not None else []
        if not any(item.kind in ("message", "function_call") for item in self.items):
            events += self._open("message")  # a reply without text or calls still has its message
        events += self._close()
        self.status = status_of(finish_reason)
        self.final = self.shape.response(self.status, self._output(), usage_of(out))
        return [*events, self._event(f"response.{self.status}", response=self.final)]

    def failed(self, code: str, message: str, param: Optional[str]) -> list[bytes]:
        """A failure after the stream started: an ``error`` event, then ``response.failed``."""
        self.status = "failed"
        response = self.shape.response("failed", self._output(), error=ResponseErrorInfo(code=code, message=message))
        return [self._event("error", code=code, message=message, param=param),
                self._event("response.failed", response=response)]

    def parts(self) -> ChatMessageParts:
        """The reply, split, as the items streamed it."""
        text = {kind: "".join(i.text for i in self.items if i.kind == kind) for kind in ("reasoning", "message")}
        calls = [ToolCall(name=i.name, arguments=i.text, id=i.call_id) for i in self.items if i.kind == "function_call"]
        return ChatMessageParts(text["message"] if text["message"] or not calls else None, text["reasoning"] or None,
                                calls)

    # ---- items -----------------------------------------------------------------------------
    def _add(self, parsed: ParsedDelta) -> list[bytes]:
        events = self._text("reasoning", parsed.reasoning) if parsed.reasoning else []
        if parsed.content:
            events += self._text("message", parsed.content)
        for call in parsed.tool_calls:
            events += self._call(call)
        return events

    def _text(self, kind: str, delta: str) -> list[bytes]:
        events = [] if self.open is not None and self.open.kind == kind else self._open(kind)
        item = self.open
        item.text += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [*events, self._event(name, item_id=item.id, output_index=item.index, content_index=0,
                                     delta=delta, **extra)]

    def _call(self, delta: ToolCallDelta) -> list[bytes]:
        events: list[bytes] = []
        if delta.id is not None:
            events += self._open("function_call", call_id=delta.id, name=delta.name or "")
            self.calls[delta.index] = self.open
        item = self.calls.get(delta.index)
        if item is None or not delta.arguments:
            return events
        item.text += delta.arguments
        return [*events, self._event("response.function_call_arguments.delta", item_id=item.id,
                                     output_index=item.index, delta=delta.arguments)]

    def _open(self, kind: str, call_id: str = "", name: str = "") -> list[bytes]:
        events = self._close()
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        self.open = _OpenItem(kind, item_id(prefix), len(self.items), call_id=call_id, name=name)
        self.items.append(self.open)
        events.append(self._event("response.output_item.added", output_index=self.open.index,
                                  item=self._item(self.open, "in_progress", parts=False)))
        if kind != "function_call":
            events.append(self._event("response.content_part.added", item_id=self.open.id,
                                      output_index=self.open.index, content_index=0, part=self._part(self.open)))
        return events

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            events = [self._event("response.function_call_arguments.done", **where, name=item.name,
                                  arguments=item.text)]
        else:
            done = "response.reasoning_text.done" if item.kind == "reasoning" else "response.output_text.done"
            extra = {} if item.kind == "reasoning" else {"logprobs": []}
            events = [self._event(done, **where, content_index=0, text=item.text, **extra),
                      self._event("response.content_part.done", **where, content_index=0, part=self._part(item))]
        return [*events, self._event("response.output_item.done", output_index=item.index,
                                     item=self._item(item, "completed"))]

    def _output(self) -> list[OutputItem]:
        status = "incomplete" if self.status == "incomplete" else "completed"
        return [self._item(item, status) for item in self.items]

    @staticmethod
    def _part(item: _OpenItem) -> Any:
        return ReasoningText(text=item.text) if item.kind == "reasoning" else OutputText(text=item.text)

    def _item(self, item: _OpenItem, status: str, parts: bool = True) -> OutputItem:
        """The item as it is now (``parts`` False: just opened, its content list still empty)."""
        if item.kind == "function_call":
            return FunctionCallItem(id=item.id, call_id=item.call_id, name=item.name, arguments=item.text,
                                    status=status)
        content = [self._part(item)] if parts else []
        if item.kind == "reasoning":
            return ReasoningItem(id=item.id, status=status, content=content)
        return OutputMessage(id=item.id, status=status, content=content)

    def _event(self, type_: str, **fields: Any) -> bytes:
        event = ResponseStreamEvent(type=type_, sequence_number=self.sequence, **fields)
        self.sequence += 1
        return sse(event)

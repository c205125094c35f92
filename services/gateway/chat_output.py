"""What a chat reply becomes: reasoning, content and tool calls — unary and streamed.

A ``ChatPlan`` is made per request from its tools (``tool_choice.ToolPlan``), the gateway's
``--reasoning-parser`` and the rendered prompt; ``prepare`` adjusts the request's sampling
parameters for it, ``choice()`` makes a ``ChoiceParser`` per choice. A reply goes through the
reasoning parser first and the tool parser second, each seeing what the one before left (the
harmony tool parser reads the whole reply). Without tools and without a reasoning parser there is
no plan work at all: the reply is the content, as before.

Structured output and forced tool calls apply after the reasoning: the constraint is compiled at
the gateway behind the reasoning parser's Lark prefix (``shared/structured_output.after_prefix``),
so the worker masks ``<think>...</think>`` freely and constrains the rest. A request's own
``structured_outputs.grammar`` is the exception: it describes the whole reply, thinking included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from gridserve.services.gateway.chat_options import ChatOptions
from gridserve.services.gateway.reasoning_parsers import (
    REASONING_PARSERS,
    PromptState,
    ReasoningParser,
)
from gridserve.services.gateway.tool_choice import ToolPlan
from gridserve.services.gateway.tool_parsers import ParsedDelta, ToolCall, ToolParser
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.sampling_params import SamplingParams, StructuredOutputsParams
from gridserve.shared.structured_output import after_prefix, validate_structured_outputs

PROMPT_TAIL_TOKENS = 16  # how much of a rendered prompt tells whether it opened or closed the reasoning


@dataclass
class ChatMessageParts:
    """A whole reply, split."""

    content: Optional[str]
    reasoning: Optional[str] = None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChoiceParser:
    """One choice's reply through the reasoning parser, then the tool parser."""

    def __init__(self, reasoning: Optional[ReasoningParser], tools: Optional[ToolParser], parallel: bool) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.parallel = parallel

    def parse(self, text: str) -> ChatMessageParts:
        reasoning, content = self.reasoning.extract(text) if self.reasoning is not None else (None, text)
        calls: list[ToolCall] = []
        if self.tools is not None:
            extracted = self.tools.extract(text if self.tools.reads_whole_reply else content or "")
            content, calls = extracted.content, extracted.calls[: None if self.parallel else 1]
        return ChatMessageParts(content if calls else content or "", reasoning, calls)

    def feed(self, delta: str) -> ParsedDelta:
        """What ``delta`` of the reply adds to the message."""
        return self._through_tools(self.reasoning.stream(delta) if self.reasoning else ParsedDelta(content=delta),
                                   delta, final=False)

    def finish(self) -> ParsedDelta:
        """What was held back, at the end of the reply."""
        return self._through_tools(self.reasoning.finish() if self.reasoning else ParsedDelta(), "", final=True)

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    def _through_tools(self, parts: ParsedDelta, raw: str, final: bool) -> ParsedDelta:
        if self.tools is None:
            return parts
        text = raw if self.tools.reads_whole_reply else parts.content
        out = self.tools.stream(text) if text else ParsedDelta()
        if final:
            out.extend(self.tools.finish())
        calls = out.tool_calls if self.parallel else [d for d in out.tool_calls if d.index == 0]
        return ParsedDelta(content=out.content, reasoning=parts.reasoning, tool_calls=calls)


@dataclass
class ChatPlan:
    """How one chat request's replies are read (see the module docstring)."""

    tools: ToolPlan
    reasoning_parser: Optional[str] = None
    prompt_state: PromptState = PromptState.NONE

    @property
    def parses(self) -> bool:
        """Whether replies need parsing at all."""
        return self.reasoning_parser is not None or self.tools.forced or self.tools.parser_class is not None

    def choice(self) -> Optional[ChoiceParser]:
        """A parser for one choice's reply; None when the reply is plain content."""
        reasoning = self._reasoning()
        tools = self.tools.parser()
        if reasoning is None and tools is None:
            return None
        return ChoiceParser(reasoning, tools, self.tools.parallel)

    def finish_reason(self, reason: Optional[str], called: bool) -> Optional[str]:
        """OpenAI's: ``"tool_calls"`` when a reply that ended by itself called tools (a named
        ``tool_choice`` keeps ``"stop"``, as OpenAI and vLLM answer it)."""
        if called and reason == "stop" and self.tools.mode != "named":
            return "tool_calls"
        return reason

    def prepare(self, params: SamplingParams, tokenizer: Any) -> SamplingParams:
        """``params`` for this plan: the forced calls' constraint (or the request's own), behind
        the reasoning prefix; special tokens kept in the text when a parser's markers are ones.
        Blocking (compiles and validates grammars): run it off the event loop."""
        constraint = params.structured_outputs
        if self.tools.forced:
            if constraint is not None:
                raise InvalidArgumentError("tool_choice", f'"{self.tools.mode}" forces the tool calls with '
                                           "structured output: leave out response_format and structured_outputs")
            _validate_tool_schemas(self.tools, tokenizer)
            constraint = self.tools.constraint()
        reasoning = self._reasoning()
        # A request's own grammar describes the whole reply, reasoning included (so it can shape or
        # bound the thinking); every other constraint starts where the reasoning ends.
        if constraint is not None and reasoning is not None and constraint.kind != "grammar":
            prefix = reasoning.grammar_prefix(lambda marker: added_token_id(tokenizer, marker))
            if prefix is not None:
                validate_structured_outputs(constraint, tokenizer)  # errors name the request's own field
                constraint = after_prefix(constraint, prefix)
        changes: dict[str, Any] = {"structured_outputs": constraint}
        if any(special_token_id(tokenizer, marker) is not None for marker in self._markers()):
            changes["skip_special_tokens"] = False
        return dataclasses.replace(params, **changes)

    def _reasoning(self) -> Optional[ReasoningParser]:
        if self.reasoning_parser is None:
            return None
        return REASONING_PARSERS[self.reasoning_parser](self.prompt_state)

    def _markers(self) -> tuple[str, ...]:
        markers: tuple[str, ...] = ()
        if self.reasoning_parser is not None:
            markers += REASONING_PARSERS[self.reasoning_parser].markers
        if self.tools.parser_class is not None:
            markers += self.tools.parser_class.markers
        return markers


async def plan_chat(service: Any, options: ChatOptions, tools: ToolPlan, prompt_token_ids: list[int],
                    params: SamplingParams) -> tuple[Optional[ChatPlan], SamplingParams]:
    """How a chat request's replies are read (None: plain content, no work per token) and its
    sampling parameters for that; ``service`` is the ``GatewayService`` (its tokenizer and
    blocking pool)."""
    reasoning_parser = options.reasoning_parser
    state = PromptState.NONE
    if reasoning_parser is not None:
        tail = await service.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        state = prompt_state(reasoning_parser, tail)
    plan = ChatPlan(tools, reasoning_parser, state)
    if not plan.parses:
        return None, params
    return plan, await service.run_blocking(plan.prepare, params, service.tokenizer)


def prompt_state(reasoning_parser: Optional[str], prompt_tail: str) -> PromptState:
    """What the end of the rendered prompt says about the reasoning (``PromptState``)."""
    if reasoning_parser is None:
        return PromptState.NONE
    return REASONING_PARSERS[reasoning_parser].prompt_state(prompt_tail)


def special_token_id(tokenizer: Any, text: str) -> Optional[int]:
    """The id of ``text`` when it is one special token of ``tokenizer`` (decoding skips those)."""
    return _added_token(tokenizer, text, "special_tokens", special_only=True)


def added_token_id(tokenizer: Any, text: str) -> Optional[int]:
    """The id of ``text`` when it is one added token of ``tokenizer``, special or not: llguidance
    reads every added token as a special one, which a grammar names by id (``<[id]>``)."""
    return _added_token(tokenizer, text, "added_tokens", special_only=False)


def _added_token(tokenizer: Any, text: str, table: str, special_only: bool) -> Optional[int]:
    known = getattr(tokenizer, table, None)
    if isinstance(known, dict):
        return known.get(text)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
        return None
    return next((token_id for token_id, token in backend.get_added_tokens_decoder().items()
                 if token.content == text and (token.special or not special_only)), None)


def _validate_tool_schemas(plan: ToolPlan, tokenizer: Any) -> None:
    """Each forced tool's parameters compile as a JSON schema; a refusal names the tool."""
    for i, tool in enumerate(plan.tools):
        if plan.mode == "named" and tool["function"]["name"] != plan.function:
            continue
        parameters = tool["function"].get("parameters")
        if not parameters:
            continue
        try:
            validate_structured_outputs(StructuredOutputsParams(json=parameters), tokenizer)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"tools[{i}].function.parameters", exc.message) from None

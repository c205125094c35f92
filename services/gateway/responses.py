"""The gateway's results in OpenAI's response shapes (``protocol.py`` models): whole completions,
SSE events of streamed ones (one per engine step), logprobs in the completions and chat forms,
prompt logprobs in vLLM's form. A chat reply goes through its ``ChatPlan`` (``chat_output.py``):
reasoning, content and tool calls, whole or as deltas."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional

from gridserve.services.gateway.chat_output import ChatPlan, ChoiceParser
from gridserve.services.gateway.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    PromptLogprob,
    PromptLogprobs,
    ResponseModel,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
)
from gridserve.services.gateway.service import StreamChunk
from gridserve.services.gateway.tool_parsers import ParsedDelta
from gridserve.shared.outputs import Logprob, RequestOutput
from gridserve.shared.sampling_params import SamplingParams

DONE = b"data: [DONE]\n\n"
Positions = list[Optional[dict[int, Logprob]]]


def sse(event: ResponseModel) -> bytes:
    """One server-sent event carrying ``event`` as JSON."""
    return b"data: " + event.dumps() + b"\n\n"


def finish_reason(reason: Optional[str]) -> Optional[str]:
    """OpenAI's finish reason (an aborted sample reads as "stop")."""
    return None if reason is None else ("stop" if reason == "abort" else reason)


def _sampled(token_id: int, position: dict[int, Logprob]) -> Logprob:
    return position.get(token_id) or next(iter(position.values()))


# ---- logprobs --------------------------------------------------------------------------------
def completion_logprobs(positions: Positions, token_ids: list[int], text_offset: int = 0,
                        first_text: str = "") -> CompletionLogprobs:
    """The completions form; a position without logprobs (an echoed prompt's first token) is null,
    its text ``first_text``."""
    tokens: list[str] = []
    token_logprobs: list[Optional[float]] = []
    top: list[Optional[dict[str, float]]] = []
    offsets: list[int] = []
    for token_id, position in zip(token_ids, positions):
        if position is None:
            text, logprob, candidates = first_text, None, None
        else:
            sampled = _sampled(token_id, position)
            text, logprob = sampled.decoded_token or "", sampled.logprob
            candidates = {(lp.decoded_token or ""): lp.logprob for tid, lp in position.items() if tid != token_id}
            candidates[text] = sampled.logprob
        tokens.append(text)
        token_logprobs.append(logprob)
        top.append(candidates)
        offsets.append(text_offset)
        text_offset += len(text)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets)


def echoed_logprobs(prompt: Positions, prompt_ids: list[int], first_text: str, positions: Positions,
                    token_ids: list[int]) -> CompletionLogprobs:
    """``echo`` with ``logprobs``: the prompt's tokens (from its prompt logprobs), then the output's."""
    return completion_logprobs(list(prompt) + list(positions), list(prompt_ids) + list(token_ids),
                               first_text=first_text)


def prompt_logprobs_out(positions: Optional[Positions]) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt position, token id -> logprob, rank, decoded token."""
    return [None if position is None else
            {str(tid): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
             for tid, lp in position.items()}
            for position in positions or []]


def chat_logprobs(positions: list[dict[int, Logprob]], token_ids: list[int], top_n: int) -> ChatLogprobs:
    content = []
    for token_id, position in zip(token_ids, positions):
        sampled = _sampled(token_id, position)
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank or 0)[:top_n] if top_n else []
        content.append(ChatLogprobToken(
            token=sampled.decoded_token or "", logprob=sampled.logprob,
            bytes=list((sampled.decoded_token or "").encode()),
            top_logprobs=[TopLogprob(token=lp.decoded_token or "", logprob=lp.logprob,
                                     bytes=list((lp.decoded_token or "").encode())) for _, lp in ranked]))
    return ChatLogprobs(content=content)


# ---- completions -----------------------------------------------------------------------------
class CompletionShape:
    """What a completions request asks to see besides the text: the echoed prompts (with ``echo`` +
    ``logprobs``, their tokens' logprobs too: ``decode`` gives the first token's text, which has
    none) and whether ``prompt_logprobs`` are returned."""

    def __init__(self, echo_texts: Optional[list[str]] = None, decode: Optional[Callable[[int], str]] = None,
                 prompt_logprobs: bool = False) -> None:
        self.echo_texts = echo_texts
        self.decode = decode
        self.prompt_logprobs = prompt_logprobs

    def echo(self, i: int) -> str:
        return self.echo_texts[i] if self.echo_texts is not None else ""

    def logprobs(self, i: int, params: SamplingParams, prompt: Optional[Positions], prompt_ids: list[int],
                 positions: Optional[Positions], token_ids: list[int], echoed: bool) -> Optional[CompletionLogprobs]:
        if params.logprobs is None or positions is None:
            return None
        if echoed and self.decode is not None and prompt and prompt_ids:
            return echoed_logprobs(prompt, prompt_ids, self.decode(prompt_ids[0]), positions, token_ids)
        return completion_logprobs(positions, token_ids, len(self.echo(i)) if echoed else 0)


def completion_response(model: str, shape: CompletionShape, outs: list[RequestOutput],
                        params: SamplingParams) -> CompletionResponse:
    """One completions body for every prompt's result."""
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, out in enumerate(outs):
        prompt_tokens += len(out.prompt_token_ids)
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            extra: dict[str, Any] = {}
            if shape.prompt_logprobs:
                extra["prompt_logprobs"] = prompt_logprobs_out(out.prompt_logprobs)
            logprobs = shape.logprobs(i, params, out.prompt_logprobs, out.prompt_token_ids, c.logprobs,
                                      c.token_ids, shape.echo_texts is not None)
            choices.append(CompletionChoice(index=i * params.n + c.index, text=shape.echo(i) + c.text,
                                            logprobs=logprobs, finish_reason=finish_reason(c.finish_reason),
                                            stop_reason=c.stop_reason, **extra))
    return CompletionResponse(id=f"cmpl-{outs[0].request_id}", created=int(time.time()), model=model,
                              choices=choices, usage=UsageInfo.of(prompt_tokens, completion_tokens))


class _Usage:
    """Token counts of a stream: so far (continuous usage: counted chunk by chunk), or from each
    prompt's final output (no work per token)."""

    def __init__(self, continuous: bool) -> None:
        self.continuous = continuous
        self.prompt: dict[int, int] = {}  # prompt index -> its token count
        self.completion = 0

    def add(self, i: int, chunk: StreamChunk) -> None:
        if self.continuous:
            self.prompt[i] = chunk.num_prompt_tokens
            self.completion += sum(len(d.token_ids) for d in chunk.deltas)
        elif chunk.final is not None:
            self.prompt[i] = len(chunk.final.prompt_token_ids)
            self.completion += sum(len(c.token_ids) for c in chunk.final.outputs)

    def info(self) -> UsageInfo:
        return UsageInfo.of(sum(self.prompt.values()), self.completion)


class CompletionEvents:
    """The SSE events of a streamed completion, one engine step's chunk at a time."""

    def __init__(self, model: str, request_id: str, params: SamplingParams, shape: CompletionShape,
                 include_usage: bool, continuous_usage: bool = False) -> None:
        self.params, self.shape = params, shape
        self.include_usage, self.continuous_usage = include_usage, continuous_usage
        self.base: dict[str, Any] = {"id": f"cmpl-{request_id}", "created": int(time.time()), "model": model}
        self.usage = _Usage(continuous_usage)
        self.echoed: set[tuple[int, int]] = set()  # (prompt, sample) pairs whose prompt was echoed

    def chunk(self, i: int, chunk: StreamChunk) -> Optional[bytes]:
        """The event for prompt ``i``'s chunk (None when it carries nothing)."""
        params, choices = self.params, []
        self.usage.add(i, chunk)
        for delta in chunk.deltas:
            text, echoed = delta.text, False
            if self.shape.echo_texts is not None and (i, delta.index) not in self.echoed:
                self.echoed.add((i, delta.index))
                text, echoed = self.shape.echo(i) + text, True
            logprobs = None
            if delta.logprobs:
                logprobs = self.shape.logprobs(i, params, chunk.prompt_logprobs, chunk.prompt_token_ids or [],
                                               delta.logprobs, delta.token_ids, echoed)
            choices.append(CompletionChoice(index=i * params.n + delta.index, text=text, logprobs=logprobs,
                                            finish_reason=finish_reason(delta.finish_reason)))
        if not choices:
            return None
        extra = {"usage": self.usage.info() if self.continuous_usage else None} if self.include_usage else {}
        return sse(CompletionResponse(**self.base, choices=choices, **extra))

    def end(self) -> list[bytes]:
        last = [sse(CompletionResponse(**self.base, choices=[], usage=self.usage.info()))] if self.include_usage else []
        return [*last, DONE]


# ---- chat ------------------------------------------------------------------------------------
def chat_response(model: str, out: RequestOutput, params: SamplingParams, top_n: int,
                  plan: Optional[ChatPlan] = None, prompt_logprobs: bool = False) -> ChatCompletionResponse:
    choices = []
    for c in out.outputs:
        logprobs = None
        if params.logprobs is not None and c.logprobs is not None:
            logprobs = chat_logprobs(c.logprobs, c.token_ids, top_n)
        parser = plan.choice() if plan is not None else None
        reason = finish_reason(c.finish_reason)
        if parser is None:
            message = ChatResponseMessage(content=c.text)
        else:
            parts = parser.parse(c.text)
            message = ChatResponseMessage(content=parts.content, **_reasoning(plan, parts.reasoning), **(
                {"tool_calls": [ToolCallOut(id=t.id, function=FunctionCallOut(name=t.name, arguments=t.arguments))
                                for t in parts.tool_calls]} if parts.tool_calls else {}))
            reason = plan.finish_reason(reason, bool(parts.tool_calls))
        choices.append(ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=reason,
                                  stop_reason=c.stop_reason))
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    extra = {"prompt_logprobs": prompt_logprobs_out(out.prompt_logprobs)} if prompt_logprobs else {}
    return ChatCompletionResponse(id=f"chatcmpl-{out.request_id}", created=int(time.time()), model=model,
                                  choices=choices, usage=UsageInfo.of(len(out.prompt_token_ids), completion_tokens),
                                  **extra)


def _reasoning(plan: ChatPlan, reasoning: Optional[str]) -> dict[str, Any]:
    return {"reasoning_content": reasoning} if plan.reasoning_parser is not None else {}


def delta_message(parsed: ParsedDelta) -> DeltaMessage:
    """One step's additions as OpenAI's delta (empty parts left out)."""
    fields: dict[str, Any] = {}
    if parsed.reasoning:
        fields["reasoning_content"] = parsed.reasoning
    if parsed.content:
        fields["content"] = parsed.content
    if parsed.tool_calls:
        fields["tool_calls"] = [
            DeltaToolCall(index=d.index, function=DeltaFunctionCall(name=d.name, arguments=d.arguments), id=d.id,
                          type="function") if d.id is not None else
            DeltaToolCall(index=d.index, function=DeltaFunctionCall(arguments=d.arguments))
            for d in parsed.tool_calls]
    return DeltaMessage(**fields)


class ChatEvents:
    """The SSE events of a streamed chat completion: the role chunk, one per step, usage, [DONE]."""

    def __init__(self, model: str, request_id: str, params: SamplingParams, top_n: int, include_usage: bool,
                 continuous_usage: bool = False, plan: Optional[ChatPlan] = None) -> None:
        self.params, self.top_n, self.plan = params, top_n, plan
        self.include_usage, self.continuous_usage = include_usage, continuous_usage
        self.base: dict[str, Any] = {"id": f"chatcmpl-{request_id}", "created": int(time.time()), "model": model}
        if include_usage:
            self.base["usage"] = None
        self.usage = _Usage(continuous_usage)
        self.parsers: dict[int, Optional[ChoiceParser]] = {}

    def start(self) -> bytes:
        choices = [ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                   for i in range(self.params.n)]
        return sse(ChatCompletionChunk(**self.base, choices=choices))

    def chunk(self, chunk: StreamChunk) -> Optional[bytes]:
        choices = []
        self.usage.add(0, chunk)
        for delta in chunk.deltas:
            logprobs = None
            if self.params.logprobs is not None and delta.logprobs:
                logprobs = chat_logprobs(delta.logprobs, delta.token_ids, self.top_n)
            reason = finish_reason(delta.finish_reason)
            if self.plan is None:  # plain content: no parsing
                message = DeltaMessage(content=delta.text) if delta.text else DeltaMessage()
            else:
                message, reason = self._message(delta.index, delta.text, reason)
                if not (message.model_fields_set or logprobs or reason):
                    continue  # the parsers hold this step's text back: nothing to send yet
            choices.append(ChatStreamChoice(index=delta.index, delta=message, logprobs=logprobs, finish_reason=reason))
        if not choices:
            return None
        usage = {"usage": self.usage.info()} if self.continuous_usage else {}
        return sse(ChatCompletionChunk(**{**self.base, **usage}, choices=choices))

    def _message(self, index: int, text: str, reason: Optional[str]) -> tuple[DeltaMessage, Optional[str]]:
        if index not in self.parsers:
            self.parsers[index] = self.plan.choice()
        parser = self.parsers[index]
        if parser is None:
            return (DeltaMessage(content=text) if text else DeltaMessage()), reason
        parsed = parser.feed(text) if text else ParsedDelta()
        if reason is not None:
            parsed.extend(parser.finish())
            reason = self.plan.finish_reason(reason, parser.called)
        return delta_message(parsed), reason

    def end(self) -> list[bytes]:
        if not self.include_usage:
            return [DONE]
        return [sse(ChatCompletionChunk(**{**self.base, "usage": self.usage.info()}, choices=[])), DONE]

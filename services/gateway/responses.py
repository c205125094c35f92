"""The gateway's results in OpenAI's response shapes (``protocol.py`` models): whole completions,
SSE events of streamed ones (one per engine step), logprobs in the completions and chat forms."""

from __future__ import annotations

import time
from typing import Any, Optional

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
    DeltaMessage,
    ResponseModel,
    TopLogprob,
    UsageInfo,
)
from gridserve.services.gateway.service import StreamChunk
from gridserve.shared.outputs import Logprob, RequestOutput
from gridserve.shared.sampling_params import SamplingParams

DONE = b"data: [DONE]\n\n"


def sse(event: ResponseModel) -> bytes:
    """One server-sent event carrying ``event`` as JSON."""
    return b"data: " + event.dumps() + b"\n\n"


def finish_reason(reason: Optional[str]) -> Optional[str]:
    """OpenAI's finish reason (an aborted sample reads as "stop")."""
    return None if reason is None else ("stop" if reason == "abort" else reason)


def _sampled(token_id: int, position: dict[int, Logprob]) -> Logprob:
    return position.get(token_id) or next(iter(position.values()))


def completion_logprobs(positions: list[dict[int, Logprob]], token_ids: list[int],
                        text_offset: int = 0) -> CompletionLogprobs:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, position in zip(token_ids, positions):
        sampled = _sampled(token_id, position)
        text = sampled.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(sampled.logprob)
        top.append({(lp.decoded_token or ""): lp.logprob for tid, lp in position.items() if tid != token_id}
                   | {text: sampled.logprob})
        offsets.append(text_offset)
        text_offset += len(text)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets)


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


def completion_response(model: str, prompt_texts: list[str], outs: list[RequestOutput],
                        params: SamplingParams) -> CompletionResponse:
    """One completions body for every prompt's result; ``prompt_texts`` are echoed ("" if not)."""
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, (prefix, out) in enumerate(zip(prompt_texts, outs)):
        prompt_tokens += len(out.prompt_token_ids)
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            logprobs = None
            if params.logprobs is not None and c.logprobs is not None:
                logprobs = completion_logprobs(c.logprobs, c.token_ids, len(prefix))
            choices.append(CompletionChoice(index=i * params.n + c.index, text=prefix + c.text, logprobs=logprobs,
                                            finish_reason=finish_reason(c.finish_reason),
                                            stop_reason=c.stop_reason))
    return CompletionResponse(id=f"cmpl-{outs[0].request_id}", created=int(time.time()), model=model,
                              choices=choices, usage=UsageInfo.of(prompt_tokens, completion_tokens))


def chat_response(model: str, out: RequestOutput, params: SamplingParams, top_n: int) -> ChatCompletionResponse:
    choices = []
    for c in out.outputs:
        logprobs = None
        if params.logprobs is not None and c.logprobs is not None:
            logprobs = chat_logprobs(c.logprobs, c.token_ids, top_n)
        choices.append(ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text), logprobs=logprobs,
                                  finish_reason=finish_reason(c.finish_reason), stop_reason=c.stop_reason))
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    return ChatCompletionResponse(id=f"chatcmpl-{out.request_id}", created=int(time.time()), model=model,
                                  choices=choices, usage=UsageInfo.of(len(out.prompt_token_ids), completion_tokens))


class CompletionEvents:
    """The SSE events of a streamed completion, one engine step's chunk at a time."""

    def __init__(self, model: str, request_id: str, params: SamplingParams, echo_texts: Optional[list[str]],
                 include_usage: bool) -> None:
        self.params, self.echo_texts, self.include_usage = params, echo_texts, include_usage
        self.base: dict[str, Any] = {"id": f"cmpl-{request_id}", "created": int(time.time()), "model": model}
        self.prompt_tokens = self.completion_tokens = 0
        self.echoed: set[tuple[int, int]] = set()  # (prompt, sample) pairs whose prompt was echoed

    def chunk(self, i: int, chunk: StreamChunk) -> Optional[bytes]:
        """The event for prompt ``i``'s chunk (None when it carries nothing)."""
        params, choices = self.params, []
        for delta in chunk.deltas:
            text = delta.text
            if self.echo_texts is not None and (i, delta.index) not in self.echoed:
                self.echoed.add((i, delta.index))
                text = self.echo_texts[i] + text
            logprobs = None
            if params.logprobs is not None and delta.logprobs:
                logprobs = completion_logprobs(delta.logprobs, delta.token_ids)
            choices.append(CompletionChoice(index=i * params.n + delta.index, text=text, logprobs=logprobs,
                                            finish_reason=finish_reason(delta.finish_reason)))
        if chunk.final is not None:
            self.prompt_tokens += len(chunk.final.prompt_token_ids)
            self.completion_tokens += sum(len(c.token_ids) for c in chunk.final.outputs)
        if not choices:
            return None
        extra = {"usage": None} if self.include_usage else {}
        return sse(CompletionResponse(**self.base, choices=choices, **extra))

    def end(self) -> list[bytes]:
        usage = UsageInfo.of(self.prompt_tokens, self.completion_tokens)
        last = [sse(CompletionResponse(**self.base, choices=[], usage=usage))] if self.include_usage else []
        return [*last, DONE]


class ChatEvents:
    """The SSE events of a streamed chat completion: the role chunk, one per step, usage, [DONE]."""

    def __init__(self, model: str, request_id: str, params: SamplingParams, top_n: int, include_usage: bool) -> None:
        self.params, self.top_n, self.include_usage = params, top_n, include_usage
        self.base: dict[str, Any] = {"id": f"chatcmpl-{request_id}", "created": int(time.time()), "model": model}
        if include_usage:
            self.base["usage"] = None
        self.usage = UsageInfo.of(0, 0)

    def start(self) -> bytes:
        choices = [ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                   for i in range(self.params.n)]
        return sse(ChatCompletionChunk(**self.base, choices=choices))

    def chunk(self, chunk: StreamChunk) -> Optional[bytes]:
        choices = []
        for delta in chunk.deltas:
            logprobs = None
            if self.params.logprobs is not None and delta.logprobs:
                logprobs = chat_logprobs(delta.logprobs, delta.token_ids, self.top_n)
            message = DeltaMessage(content=delta.text) if delta.text else DeltaMessage()
            choices.append(ChatStreamChoice(index=delta.index, delta=message, logprobs=logprobs,
                                            finish_reason=finish_reason(delta.finish_reason)))
        if chunk.final is not None:
            self.usage = UsageInfo.of(len(chunk.final.prompt_token_ids),
                                      sum(len(c.token_ids) for c in chunk.final.outputs))
        return sse(ChatCompletionChunk(**self.base, choices=choices)) if choices else None

    def end(self) -> list[bytes]:
        if not self.include_usage:
            return [DONE]
        return [sse(ChatCompletionChunk(**{**self.base, "usage": self.usage}, choices=[])), DONE]

"""OpenAI's JSON <-> the gateway's domain: request bodies to prompts and ``SamplingParams``, results
and stream chunks to OpenAI's response shapes, errors to ``{"error": {...}}`` with an HTTP status.

Plain Python (``json``), like vLLM's OpenAI server: unknown fields are ignored. ``OpenAIApi``
answers one route with an ``HttpResponse`` (status, content type, body chunks); the servicer only
wraps those chunks in ``google.api.HttpBody`` messages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from gridserve.services.gateway.processor import PromptType
from gridserve.services.gateway.service import GatewayService, StreamChunk
from gridserve.shared.errors import EngineDeadError, InvalidArgumentError
from gridserve.shared.outputs import Logprob, RequestOutput
from gridserve.shared.sampling_params import SamplingParams, StructuredOutputsParams

JSON = "application/json"
SSE = "text/event-stream"
DONE = b"data: [DONE]\n\n"

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type_: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_

    def body(self) -> bytes:
        return _dumps({"error": {"message": self.message, "type": self.type, "param": self.param,
                                 "code": self.status}})


@dataclass
class HttpResponse:
    """What one route answers: the status, the content type and the body, in chunks."""

    status: int
    content_type: str
    chunks: Iterable[bytes] = field(default_factory=list)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


def to_api_error(exc: Exception) -> ApiError:
    """The OpenAI error of a known failure; anything else is re-raised (a bug, not a user error)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidArgumentError):
        # Domain field paths ("sampling_params.temperature") name the OpenAI field ("temperature").
        param = exc.field.removeprefix("sampling_params.")
        return ApiError(400, f"{param}: {exc.message}", param)
    if isinstance(exc, EngineDeadError):
        return ApiError(503, str(exc), None, "ServiceUnavailableError")
    raise exc


def with_inband_errors(events: Iterator[bytes], on_error: Callable[[], None] = lambda: None) -> Iterator[bytes]:
    """An SSE stream that, when it fails after the response has started, sends the error as one
    ``data: {"error": {...}}`` event and then ``data: [DONE]`` (an HTTP/1.1 client sees no trailers,
    so the status alone would be lost); ``on_error`` releases what the stream held."""
    try:
        yield from events
    except Exception as exc:  # noqa: BLE001 - every failure is reported in-band
        error = _inband_error(exc)
        on_error()
        yield sse(json.loads(error.body()))
        yield DONE


async def awith_inband_errors(events: AsyncIterator[bytes],
                              on_error: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
    """``with_inband_errors`` for an asyncio stream."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001 - every failure is reported in-band
        error = _inband_error(exc)
        await on_error()
        yield sse(json.loads(error.body()))
        yield DONE


def _inband_error(exc: Exception) -> ApiError:
    try:
        return to_api_error(exc)
    except Exception:  # noqa: BLE001 - an unexpected one is logged and reported as a 500
        logger.exception("stream failed")
        return ApiError(500, f"internal error: {type(exc).__name__}", None, "InternalServerError")


# ---- requests --------------------------------------------------------------------------------
def parse_body(data: bytes) -> dict:
    try:
        body = json.loads(data or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _get(body: dict, name: str, kinds: tuple, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise ApiError(400, f"{name}: expected {_kind_names(kinds)}, got {value!r}", name)
    if not isinstance(value, kinds):
        raise ApiError(400, f"{name}: expected {_kind_names(kinds)}, got {value!r}", name)
    return value


def _kind_names(kinds: tuple) -> str:
    return " or ".join(k.__name__ for k in kinds)


def _prompts(body: dict) -> list[PromptType]:
    """OpenAI's ``prompt``: a string, a list of strings, token ids or a list of token-id lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [{"prompt_token_ids": list(prompt)}]
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [{"prompt_token_ids": list(p)} for p in prompt]
    raise ApiError(400, "prompt: expected a string, a list of strings, token ids or a list of "
                   "token-id lists", "prompt")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise ApiError(400, "stop: expected a string or a list of strings", "stop")


def _logit_bias(body: dict) -> Optional[dict[int, float]]:
    bias = _get(body, "logit_bias", (dict,))
    if not bias:
        return None
    try:
        return {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError):
        raise ApiError(400, "logit_bias: expected a map of token id to bias", "logit_bias") from None


def _structured(body: dict) -> Optional[StructuredOutputsParams]:
    fmt = _get(body, "response_format", (dict,))
    if not fmt or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema: expected a JSON schema object",
                           "response_format")
        return StructuredOutputsParams(json=schema)
    raise ApiError(400, f"response_format.type: unsupported {fmt.get('type')!r}", "response_format")


def _common_params(body: dict, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
    number = (int, float)
    kwargs: dict[str, Any] = {
        "n": _get(body, "n", (int,), 1),
        "max_tokens": max_tokens,
        "temperature": float(_get(body, "temperature", number, 1.0)),
        "top_p": float(_get(body, "top_p", number, 1.0)),
        "top_k": _get(body, "top_k", (int,), 0),
        "min_p": float(_get(body, "min_p", number, 0.0)),
        "seed": _get(body, "seed", (int,)),
        "presence_penalty": float(_get(body, "presence_penalty", number, 0.0)),
        "frequency_penalty": float(_get(body, "frequency_penalty", number, 0.0)),
        "repetition_penalty": float(_get(body, "repetition_penalty", number, 1.0)),
        "min_tokens": _get(body, "min_tokens", (int,), 0),
        "ignore_eos": _get(body, "ignore_eos", (bool,), False),
        "stop": _stop(body),
        "stop_token_ids": _get(body, "stop_token_ids", (list,), []),
        "logit_bias": _logit_bias(body),
        "logprobs": logprobs,
        "structured_outputs": _structured(body),
    }
    if kwargs["top_k"] == -1:
        kwargs["top_k"] = 0
    try:
        return SamplingParams(**kwargs)
    except InvalidArgumentError:
        raise
    except (TypeError, ValueError) as exc:
        raise ApiError(400, str(exc)) from None


def completion_request(body: dict) -> tuple[list[PromptType], SamplingParams]:
    prompts = _prompts(body)
    logprobs = _get(body, "logprobs", (int,))
    return prompts, _common_params(body, _get(body, "max_tokens", (int,), 16), logprobs)


def chat_messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: expected a non-empty list of messages", "messages")
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "messages: each message needs a role", "messages")
        content = message.get("content") or ""
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise ApiError(400, "messages: content must be a string or a list of parts", "messages")
        out.append({"role": message["role"], "content": content})
    return out


def chat_request(body: dict) -> SamplingParams:
    max_tokens = _get(body, "max_completion_tokens", (int,))
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,))
    logprobs = None
    if _get(body, "logprobs", (bool,), False):
        logprobs = _get(body, "top_logprobs", (int,), 0)
    return _common_params(body, max_tokens, logprobs)


# ---- responses ------------------------------------------------------------------------------
def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finish(reason: Optional[str]) -> Optional[str]:
    return None if reason is None else ("stop" if reason == "abort" else reason)


def completion_logprobs(positions: list[dict[int, Logprob]], token_ids: list[int],
                        text_offset: int = 0) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, position in zip(token_ids, positions):
        sampled = position.get(token_id) or next(iter(position.values()))
        text = sampled.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(sampled.logprob)
        top.append({(lp.decoded_token or ""): lp.logprob for tid, lp in position.items() if tid != token_id}
                   | {text: sampled.logprob})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(positions: list[dict[int, Logprob]], token_ids: list[int], top_n: int) -> dict:
    content = []
    for token_id, position in zip(token_ids, positions):
        sampled = position.get(token_id) or next(iter(position.values()))
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank or 0)[:top_n] if top_n else []
        content.append({
            "token": sampled.decoded_token or "",
            "logprob": sampled.logprob,
            "bytes": list((sampled.decoded_token or "").encode()),
            "top_logprobs": [{"token": lp.decoded_token or "", "logprob": lp.logprob,
                              "bytes": list((lp.decoded_token or "").encode())} for _, lp in ranked],
        })
    return {"content": content}


class OpenAIApi:
    """The OpenAI routes of one gateway."""

    def __init__(self, service: GatewayService, served_model_name: Optional[str] = None,
                 version: str = "") -> None:
        self.service = service
        self.model = served_model_name or service.model_name
        self.version = version

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model:
            raise ApiError(404, f"The model `{model}` does not exist.", "model", "NotFoundError")

    # ---- simple routes ----------------------------------------------------------------------
    def models(self) -> HttpResponse:
        card = {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "gridserve",
                "root": self.service.model_name, "parent": None, "max_model_len": self.service.max_model_len}
        return HttpResponse(200, JSON, [_dumps({"object": "list", "data": [card]})])

    def health(self) -> HttpResponse:
        if self.service.is_ready():
            return HttpResponse(200, JSON, [b"{}"])
        return HttpResponse(503, JSON, [ApiError(503, "not ready", None, "ServiceUnavailableError").body()])

    def version_info(self) -> HttpResponse:
        return HttpResponse(200, JSON, [_dumps({"version": self.version})])

    # ---- tokenizer routes (vLLM's /tokenize and /detokenize) ---------------------------------
    def tokenize(self, data: bytes) -> HttpResponse:
        """``{"prompt": str}`` or ``{"messages": [...]}`` -> ``{"count", "max_model_len", "tokens"}``."""
        try:
            body = parse_body(data)
            self._check_model(body)
            add_special = _get(body, "add_special_tokens", (bool,), True)
            if "messages" in body:
                prompt = self.service.chat_prompt(chat_messages(body), _get(body, "chat_template", (str,)),
                                                  _get(body, "add_generation_prompt", (bool,), True))
                tokens = prompt["prompt_token_ids"]
            else:
                text = _get(body, "prompt", (str,))
                if text is None:
                    raise ApiError(400, "prompt: expected a string (or give messages)", "prompt")
                tokens = list(self.service.tokenizer.encode(text, add_special))
            result: dict[str, Any] = {"count": len(tokens), "max_model_len": self.service.max_model_len,
                                      "tokens": tokens, "token_strs": None}
            if _get(body, "return_token_strs", (bool,), False):
                result["token_strs"] = [self.service.tokenizer.decode([t]) for t in tokens]
            return HttpResponse(200, JSON, [_dumps(result)])
        except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error or re-raised
            error = to_api_error(exc)
            return HttpResponse(error.status, JSON, [error.body()])

    def detokenize(self, data: bytes) -> HttpResponse:
        """``{"tokens": [int, ...]}`` -> ``{"prompt": str}``."""
        try:
            body = parse_body(data)
            self._check_model(body)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in tokens):
                raise ApiError(400, "tokens: expected a list of token ids", "tokens")
            vocab = self.service.input_processor.vocab_size
            bad = [t for t in tokens if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"tokens: token id {bad[0]} is out of range [0, {vocab})", "tokens")
            return HttpResponse(200, JSON, [_dumps({"prompt": self.service.tokenizer.decode(tokens)})])
        except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error or re-raised
            error = to_api_error(exc)
            return HttpResponse(error.status, JSON, [error.body()])

    # ---- completions ------------------------------------------------------------------------
    def completions(self, data: bytes, on_done: Callable, traceparent: str = "") -> HttpResponse:
        try:
            body = parse_body(data)
            self._check_model(body)
            prompts, params = completion_request(body)
            rank = _get(body, "data_parallel_rank", (int,))  # vLLM's extension: pin an engine
            echo = bool(_get(body, "echo", (bool,), False))
            if _get(body, "stream", (bool,), False):
                include_usage = _include_usage(body)
                streams = [self.service.generate(p, params, "", on_done, traceparent, rank) for p in prompts]
                first = next(streams[0])  # validation errors surface here, before the status is sent
                events = self._completion_events(prompts, streams, first, params, echo, include_usage)
                return HttpResponse(200, SSE, with_inband_errors(events, lambda: _close(streams)))
            outs = [self.service.complete(p, params, "", on_done, traceparent, rank) for p in prompts]
            return HttpResponse(200, JSON, [_dumps(self._completion_body(prompts, outs, params, echo))])
        except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error or re-raised
            error = to_api_error(exc)
            return HttpResponse(error.status, JSON, [error.body()])

    async def completions_async(self, data: bytes, on_done: Callable, traceparent: str = "") -> HttpResponse:
        """``completions`` on an asyncio loop: a stream is served by the loop (``generate_async``),
        anything else by the blocking path in a thread."""
        try:
            body = parse_body(data)
            if not _get(body, "stream", (bool,), False):
                return await asyncio.to_thread(self.completions, data, on_done, traceparent)
            self._check_model(body)
            prompts, params = completion_request(body)
            rank = _get(body, "data_parallel_rank", (int,))
            echo = bool(_get(body, "echo", (bool,), False))
            include_usage = _include_usage(body)
            streams = [self.service.generate_async(p, params, "", traceparent, rank) for p in prompts]
            first = await anext(streams[0])  # validation errors surface here, before the status is sent
            events = self._completion_events_async(prompts, streams, first, params, echo, include_usage)
            return HttpResponse(200, SSE, awith_inband_errors(events, lambda: _aclose(streams)))
        except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error or re-raised
            error = to_api_error(exc)
            return HttpResponse(error.status, JSON, [error.body()])

    def _prompt_text(self, prompt: PromptType, out_prompt_ids: Optional[list[int]] = None) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.service.tokenizer.decode(out_prompt_ids or prompt["prompt_token_ids"])

    def _completion_body(self, prompts: list[PromptType], outs: list[RequestOutput],
                         params: SamplingParams, echo: bool) -> dict:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            prompt_tokens += len(out.prompt_token_ids)
            prefix = self._prompt_text(prompt, out.prompt_token_ids) if echo else ""
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                logprobs = None
                if params.logprobs is not None and c.logprobs is not None:
                    logprobs = completion_logprobs(c.logprobs, c.token_ids, len(prefix))
                choices.append({"index": i * params.n + c.index, "text": prefix + c.text, "logprobs": logprobs,
                                "finish_reason": _finish(c.finish_reason), "stop_reason": c.stop_reason})
        return {"id": f"cmpl-{outs[0].request_id}", "object": "text_completion", "created": int(time.time()),
                "model": self.model, "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}

    def _completion_events(self, prompts: list[PromptType], streams: list[Iterator[StreamChunk]],
                           first: StreamChunk, params: SamplingParams, echo: bool,
                           include_usage: bool) -> Iterator[bytes]:
        events = _CompletionEvents(self, first.request_id, params, echo, include_usage)
        for i, (prompt, stream) in enumerate(zip(prompts, streams)):
            for chunk in _chain(first, stream) if i == 0 else stream:
                event = events.chunk(i, prompt, chunk)
                if event is not None:
                    yield event
        yield from events.end()

    async def _completion_events_async(self, prompts: list[PromptType], streams: list[AsyncIterator[StreamChunk]],
                                       first: StreamChunk, params: SamplingParams, echo: bool,
                                       include_usage: bool) -> AsyncIterator[bytes]:
        events = _CompletionEvents(self, first.request_id, params, echo, include_usage)
        for i, (prompt, stream) in enumerate(zip(prompts, streams)):
            if i == 0:
                event = events.chunk(0, prompt, first)
                if event is not None:
                    yield event
            async for chunk in stream:
                event = events.chunk(i, prompt, chunk)
                if event is not None:
                    yield event
        for event in events.end():
            yield event

    # ---- chat -------------------------------------------------------------------------------
    def chat_completions(self, data: bytes, on_done: Callable, traceparent: str = "") -> HttpResponse:
        try:
            body = parse_body(data)
            self._check_model(body)
            params, rank, template_args = _chat_args(body)
            prompt = self.service.chat_prompt(*template_args)
            top_n = params.logprobs or 0
            if _get(body, "stream", (bool,), False):
                include_usage = _include_usage(body)
                stream = self.service.generate(prompt, params, "", on_done, traceparent, rank)
                first = next(stream)
                events = self._chat_events(_chain(first, stream), params, top_n, include_usage, first.request_id)
                return HttpResponse(200, SSE, with_inband_errors(events, lambda: _close([stream])))
            out = self.service.complete(prompt, params, "", on_done, traceparent, rank)
            return HttpResponse(200, JSON, [_dumps(self._chat_body(out, params, top_n))])
        except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error or re-raised
            error = to_api_error(exc)
            return HttpResponse(error.status, JSON, [error.body()])

    async def chat_completions_async(self, data: bytes, on_done: Callable, traceparent: str = "") -> HttpResponse:
        """``chat_completions`` on an asyncio loop (see ``completions_async``)."""
        try:
            body = parse_body(data)
            if not _get(body, "stream", (bool,), False):
                return await asyncio.to_thread(self.chat_completions, data, on_done, traceparent)
            self._check_model(body)
            params, rank, template_args = _chat_args(body)
            prompt = await asyncio.to_thread(self.service.chat_prompt, *template_args)
            include_usage = _include_usage(body)
            stream = self.service.generate_async(prompt, params, "", traceparent, rank)
            first = await anext(stream)
            events = self._chat_events_async(first, stream, params, params.logprobs or 0, include_usage)
            return HttpResponse(200, SSE, awith_inband_errors(events, lambda: _aclose([stream])))
        except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error or re-raised
            error = to_api_error(exc)
            return HttpResponse(error.status, JSON, [error.body()])

    def _chat_body(self, out: RequestOutput, params: SamplingParams, top_n: int) -> dict:
        choices = []
        for c in out.outputs:
            logprobs = None
            if params.logprobs is not None and c.logprobs is not None:
                logprobs = chat_logprobs(c.logprobs, c.token_ids, top_n)
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                            "logprobs": logprobs, "finish_reason": _finish(c.finish_reason),
                            "stop_reason": c.stop_reason})
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return {"id": f"chatcmpl-{out.request_id}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model, "choices": choices,
                "usage": _usage(len(out.prompt_token_ids), completion_tokens)}

    def _chat_events(self, chunks: Iterator[StreamChunk], params: SamplingParams, top_n: int,
                     include_usage: bool, request_id: str) -> Iterator[bytes]:
        events = _ChatEvents(self.model, request_id, params, top_n, include_usage)
        yield events.start()
        for chunk in chunks:
            event = events.chunk(chunk)
            if event is not None:
                yield event
        yield from events.end()

    async def _chat_events_async(self, first: StreamChunk, rest: AsyncIterator[StreamChunk], params: SamplingParams,
                                 top_n: int, include_usage: bool) -> AsyncIterator[bytes]:
        events = _ChatEvents(self.model, first.request_id, params, top_n, include_usage)
        yield events.start()
        event = events.chunk(first)
        if event is not None:
            yield event
        async for chunk in rest:
            event = events.chunk(chunk)
            if event is not None:
                yield event
        for event in events.end():
            yield event


class _CompletionEvents:
    """The SSE events of a streamed completion, one engine step's chunk at a time."""

    def __init__(self, api: OpenAIApi, request_id: str, params: SamplingParams, echo: bool,
                 include_usage: bool) -> None:
        self.api, self.params, self.echo, self.include_usage = api, params, echo, include_usage
        self.base = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
                     "model": api.model}
        self.prompt_tokens = self.completion_tokens = 0
        self.echoed: set[tuple[int, int]] = set()  # (prompt, sample) pairs whose prompt was echoed

    def chunk(self, i: int, prompt: PromptType, chunk: StreamChunk) -> Optional[bytes]:
        """The event for prompt ``i``'s chunk (None when it carries nothing)."""
        params, choices = self.params, []
        for delta in chunk.deltas:
            text = delta.text
            if self.echo and (i, delta.index) not in self.echoed:
                self.echoed.add((i, delta.index))
                text = self.api._prompt_text(prompt) + text
            logprobs = None
            if params.logprobs is not None and delta.logprobs:
                logprobs = completion_logprobs(delta.logprobs, delta.token_ids)
            choices.append({"index": i * params.n + delta.index, "text": text, "logprobs": logprobs,
                            "finish_reason": _finish(delta.finish_reason)})
        if chunk.final is not None:
            self.prompt_tokens += len(chunk.final.prompt_token_ids)
            self.completion_tokens += sum(len(c.token_ids) for c in chunk.final.outputs)
        if not choices:
            return None
        event = {**self.base, "choices": choices}
        if self.include_usage:
            event["usage"] = None
        return sse(event)

    def end(self) -> list[bytes]:
        usage = [sse({**self.base, "choices": [], "usage": _usage(self.prompt_tokens, self.completion_tokens)})]
        return [*(usage if self.include_usage else []), DONE]


class _ChatEvents:
    """The SSE events of a streamed chat completion: the role chunk, one per step, usage, [DONE]."""

    def __init__(self, model: str, request_id: str, params: SamplingParams, top_n: int, include_usage: bool) -> None:
        self.params, self.top_n, self.include_usage = params, top_n, include_usage
        self.base = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": model}
        self.extra = {"usage": None} if include_usage else {}
        self.usage = _usage(0, 0)

    def start(self) -> bytes:
        return sse({**self.base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}
                                             for i in range(self.params.n)], **self.extra})

    def chunk(self, chunk: StreamChunk) -> Optional[bytes]:
        choices = []
        for delta in chunk.deltas:
            logprobs = None
            if self.params.logprobs is not None and delta.logprobs:
                logprobs = chat_logprobs(delta.logprobs, delta.token_ids, self.top_n)
            choices.append({"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                            "logprobs": logprobs, "finish_reason": _finish(delta.finish_reason)})
        if chunk.final is not None:
            self.usage = _usage(len(chunk.final.prompt_token_ids), sum(len(c.token_ids) for c in chunk.final.outputs))
        return sse({**self.base, "choices": choices, **self.extra}) if choices else None

    def end(self) -> list[bytes]:
        return [*([sse({**self.base, "choices": [], "usage": self.usage})] if self.include_usage else []), DONE]


def _chat_args(body: dict) -> tuple[SamplingParams, Optional[int], tuple]:
    """A chat request's sampling params, pinned DP rank and ``chat_prompt`` arguments."""
    template_args = (chat_messages(body), _get(body, "chat_template", (str,)),
                     _get(body, "add_generation_prompt", (bool,), True))
    return chat_request(body), _get(body, "data_parallel_rank", (int,)), template_args


def _include_usage(body: dict) -> bool:
    return bool((_get(body, "stream_options", (dict,), {}) or {}).get("include_usage"))


def _close(streams: list[Iterator[StreamChunk]]) -> None:
    """Close every request stream (each aborts its engine requests if they are still running)."""
    for stream in streams:
        stream.close()


async def _aclose(streams: list[AsyncIterator[StreamChunk]]) -> None:
    for stream in streams:
        await stream.aclose()


def _chain(first: StreamChunk, rest: Iterator[StreamChunk]) -> Iterator[StreamChunk]:
    yield first
    yield from rest

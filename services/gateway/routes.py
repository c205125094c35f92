"""The OpenAI-compatible REST routes of one gateway, each an ``async`` handler on its event loop.

A handler gets the raw body (Envoy passes it through as ``google.api.HttpBody``), validates it
with the ``protocol.py`` model of its route, calls ``GatewayService`` and answers an
``HttpResponse``: the status, the content type and the body in chunks (a list, or an async
iterator of SSE events). Every failure before the first byte is an OpenAI error body with its
status; one after a stream started is sent in band, then ``[DONE]``.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Optional, TypeVar, Union

from pydantic import BaseModel

from gridserve.services.gateway import caller
from gridserve.services.gateway.api_errors import ApiError, to_api_error
from gridserve.services.gateway.beam_search import search_all
from gridserve.services.gateway.chat_options import ChatOptions
from gridserve.services.gateway.chat_output import plan_chat
from gridserve.services.gateway.fim import fill_in_the_middle
from gridserve.services.gateway.lora import LoraAdapters, LoraRefusal, not_found
from gridserve.services.gateway.multimodal import chat_images
from gridserve.services.gateway.openapi import openapi_document
from gridserve.services.gateway.protocol import (
    ChatCompletionRequest,
    ChatTemplateFields,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoraAdapterRequest,
    VersionResponse,
)
from gridserve.services.gateway.responses import (
    DONE,
    ChatEvents,
    CompletionEvents,
    CompletionShape,
    chat_response,
    completion_response,
)
from gridserve.services.gateway.service import GatewayService, StreamChunk, gather_or_cancel
from gridserve.services.gateway.tool_choice import plan_tools

JSON = "application/json"
SSE = "text/event-stream"
TEXT = "text/plain; charset=utf-8"
RUNTIME_LORA_OFF = ("loading and unloading LoRA adapters at run time is off: it needs the gateway's --api-key "
                    "(callers send the key as a bearer token) and the engines' --allow-runtime-lora-updating")
REFUSED_TEMPLATE = ("a request's own chat template is refused; the server must run with "
                    "--trust-request-chat-template")
IGNORED_FIELDS_HEADER = "x-gridserve-ignored-fields"  # unknown keys inside messages (protocol.py's rule)
REQUEST_TOOLS: Any = object()  # ``render_chat``: the template sees the request's own tools

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


@dataclass
class HttpResponse:
    """What one route answers: the status, the content type and the body, in chunks."""

    status: int
    content_type: str
    chunks: Union[Iterable[bytes], AsyncIterator[bytes]] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)  # extra response headers (``retry-after``)


def answers_errors(route: Callable[..., Awaitable[HttpResponse]]) -> Callable[..., Awaitable[HttpResponse]]:
    """Turn any exception of ``route`` into an OpenAI error response."""

    @functools.wraps(route)
    async def answered(*args: Any, **kwargs: Any) -> HttpResponse:
        try:
            return await route(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            error = to_api_error(exc)
            return HttpResponse(error.status, JSON, [error.body()], error.headers)

    return answered


class OpenAIRoutes:
    """The OpenAI routes of one gateway (and vLLM's ``/tokenize``, ``/detokenize``).

    ``sampling_defaults``: what a generation request gets for a sampling field it leaves out (the
    model's generation config, as ``SamplingParams`` keywords; none: ``SamplingParams``' own).
    ``runtime_lora_updating``: whether ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
    are open (the gateway has an ``--api-key``, so only callers holding it reach them)."""

    def __init__(self, service: GatewayService, served_model_name: Optional[str] = None,
                 version: str = "", sampling_defaults: Optional[Mapping[str, Any]] = None,
                 runtime_lora_updating: bool = False) -> None:
        self.service = service
        self.model = served_model_name or service.model_name
        self.version = version
        self.sampling_defaults = dict(sampling_defaults or {})
        self.runtime_lora_updating = runtime_lora_updating
        self.loras: LoraAdapters = getattr(service, "loras", None) or LoraAdapters([])
        self._openapi: Optional[bytes] = None

    def parse_body(self, model: type[M], data: bytes) -> M:
        return model.model_validate_json(data or b"{}", context={"limits": self.service.limits})

    def check_generates(self) -> None:
        """A generate request to a pooling model: 400 naming the runner and the endpoints to use."""
        info = getattr(self.service, "model_info", None)
        if info is not None:
            info.check_generates(self.model)

    async def adapter_for(self, requested: Optional[str]) -> Optional[str]:
        """The LoRA adapter a request's ``model`` names (None: the served model itself, or no name);
        any other name is a 404 (``ModelNotFoundError``)."""
        if requested is None or requested == self.model:
            return None
        if await self.loras.lookup(requested) is None:
            raise not_found(requested)
        return requested

    async def render_chat(self, request: ChatTemplateFields, tools: Any = REQUEST_TOOLS,
                           variables: Optional[dict[str, Any]] = None) -> dict:
        """The rendered, tokenized conversation; with its images (loaded, not yet preprocessed) as
        ``multi_modal_data`` for a vision-language model, refused naming the part for any other.
        ``tools``: what the template sees (the request's own by default); ``variables``: further
        template variables (``chat_template_kwargs``)."""
        if request.chat_template is not None and not self.service.limits.trust_request_chat_template:
            raise ApiError(400, f"chat_template: {REFUSED_TEMPLATE}", "chat_template")
        messages, images = chat_images(request.template_messages())
        if images and self.service.input_processor.multimodal is None:
            field = images[0][0]
            raise ApiError(400, f"{field}: the model {self.model!r} takes text only (it has no vision encoder); "
                           "send no image parts", field)
        tools = request.template_tools() if tools is REQUEST_TOOLS else tools
        extra = {"chat_template_kwargs": variables} if variables else {}
        prompt = await self.service.chat_prompt(messages, request.chat_template, request.add_generation_prompt,
                                                tools, **extra)
        if images:
            prompt["multi_modal_data"] = {"image": await self.service.media.load_all(images)}
        return prompt

    # ---- simple routes ----------------------------------------------------------------------
    @answers_errors
    async def models(self) -> HttpResponse:
        """The served model, then its LoRA adapters (``parent``: the served model, ``root``: the
        adapter's folder), as the engines list them."""
        cards = [ModelCard(id=self.model, created=int(time.time()), root=self.service.model_name,
                           max_model_len=self.service.max_model_len)]
        cards += [ModelCard(id=a.name, created=int(a.created), root=a.path, parent=self.model,
                            max_model_len=self.service.max_model_len) for a in await self.adapters()]
        return HttpResponse(200, JSON, [ModelList(data=cards).dumps()])

    async def adapters(self) -> list:
        """The LoRA adapters the engines list (none when they cannot be asked now)."""
        try:
            return list((await self.loras.current()).adapters.values())
        except Exception as exc:  # noqa: BLE001 - the served model is listed whatever the engines say
            logger.warning("/v1/models lists no LoRA adapters: %s", exc)
            return []

    # ---- LoRA adapters at run time (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter) -----
    @answers_errors
    async def load_lora_adapter(self, data: bytes) -> HttpResponse:
        """``{"lora_name", "lora_path"}``: load the adapter on every engine (or none), then answer
        vLLM's plain text. Refusals (``lora.py``): 400 naming the field (a bad adapter, a path outside
        ``--lora-dir``, a name in use), 403 without ``--api-key`` here or without the engines'
        ``--allow-runtime-lora-updating`` / ``--enable-lora`` (vLLM leaves the route out: 404), 503
        while an engine is unreachable."""
        self._check_runtime_updating()
        request = self.parse_body(LoadLoraAdapterRequest, data)
        if request.lora_name in (self.model, self.service.model_name):
            raise ApiError(400, f"lora_name: {request.lora_name!r} is the base model's name; give the adapter "
                                "another one", "lora_name")
        await self.loras.load(request.lora_name, request.lora_path)
        return HttpResponse(200, TEXT, [f"Success: LoRA adapter '{request.lora_name}' added successfully.".encode()])

    @answers_errors
    async def unload_lora_adapter(self, data: bytes) -> HttpResponse:
        """``{"lora_name"}`` (vLLM's optional ``lora_int_id`` is checked and not used): unload the
        adapter from every engine; 404 when none serves it, otherwise as loading."""
        self._check_runtime_updating()
        request = self.parse_body(UnloadLoraAdapterRequest, data)
        await self.loras.unload(request.lora_name)
        return HttpResponse(200, TEXT, [f"Success: LoRA adapter '{request.lora_name}' removed successfully.".encode()])

    def _check_runtime_updating(self) -> None:
        if not self.runtime_lora_updating:
            raise LoraRefusal(403, RUNTIME_LORA_OFF, None, "PermissionDeniedError")

    @answers_errors
    async def health(self) -> HttpResponse:
        if self.service.is_ready():
            return HttpResponse(200, JSON, [b"{}"])
        return HttpResponse(503, JSON, [ApiError(503, "not ready", None, "ServiceUnavailableError").body()])

    @answers_errors
    async def version_info(self) -> HttpResponse:
        return HttpResponse(200, JSON, [VersionResponse(version=self.version).dumps()])

    @answers_errors
    async def openapi(self) -> HttpResponse:
        if self._openapi is None:
            self._openapi = await self.service.run_blocking(openapi_document, self.version)
        return HttpResponse(200, JSON, [self._openapi])

    # ---- tokenizer routes (vLLM's /tokenize and /detokenize) ---------------------------------
    @answers_errors
    async def tokenize(self, data: bytes) -> HttpResponse:
        """``{"prompt": str}`` or ``{"messages": [...]}`` -> ``{"count", "max_model_len", "tokens"}``
        (an adapter's name as ``model`` tokenizes as the base model: adapters share its tokenizer)."""
        request = self.parse_body(TokenizeRequest, data)
        await self.adapter_for(request.model)
        if request.messages is not None:
            chat = ChatTemplateFields.model_construct(
                messages=request.messages, chat_template=request.chat_template,
                add_generation_prompt=request.add_generation_prompt, tools=request.tools)
            if not caller.api_key_given() and chat_images(chat.template_messages())[1]:
                raise ApiError(401, caller.IMAGES_NEED_KEY, None, "AuthenticationError")
            prompt = await self.render_chat(chat, variables=request.chat_template_kwargs)
            tokens = prompt["prompt_token_ids"]
            if "multi_modal_data" in prompt:  # each image placeholder as the image's tokens
                expand = self.service.input_processor.multimodal.process
                tokens, _ = await self.service.run_blocking(expand, tokens, prompt["multi_modal_data"]["image"])
        elif request.prompt is not None:
            tokens = await self.service.encode(request.prompt, request.add_special_tokens)
        else:
            raise ApiError(400, "prompt: expected a string (or give messages)", "prompt")
        token_strs = None
        if request.return_token_strs:
            decode = self.service.tokenizer.decode
            token_strs = await self.service.run_blocking(lambda: [decode([t]) for t in tokens])
        response = TokenizeResponse(count=len(tokens), max_model_len=self.service.max_model_len, tokens=tokens,
                                    token_strs=token_strs)
        return HttpResponse(200, JSON, [response.dumps()])

    @answers_errors
    async def detokenize(self, data: bytes) -> HttpResponse:
        """``{"tokens": [int, ...]}`` -> ``{"prompt": str}``."""
        request = self.parse_body(DetokenizeRequest, data)
        await self.adapter_for(request.model)
        vocab = self.service.input_processor.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens: token id {bad[0]} is out of range [0, {vocab})", "tokens")
        text = await self.service.decode(request.tokens, skip_special_tokens=False)
        return HttpResponse(200, JSON, [DetokenizeResponse(prompt=text).dumps()])

    # ---- completions ------------------------------------------------------------------------
    @answers_errors
    async def completions(self, data: bytes, traceparent: str = "", timeout: Optional[float] = None) -> HttpResponse:
        request = self.parse_body(CompletionRequest, data)
        lora = await self.adapter_for(request.model)
        self.check_generates()
        served, engine_kw = lora or self.model, engine_keywords(lora, request.priority, request.cache_salt)
        prompts = request.prompts()
        shape = CompletionShape(await self._echo_texts(prompts) if request.echo else None,
                                self._decode_one if request.echo and request.logprobs is not None else None,
                                request.prompt_logprobs is not None)
        if request.suffix is not None:  # fill in the middle (the echo stays the prompt itself)
            prompts = [await self.service.run_blocking(fill_in_the_middle, self.service.tokenizer, p, request.suffix)
                       for p in prompts]
        if request.use_beam_search:  # the gateway's loop of one-token requests (beam_search.py)
            beam = request.to_beam_search_params(request.max_tokens, self.service.max_model_len)
            outs = await search_all(self.service, [_prompt_arg(p) for p in prompts], beam, traceparent,
                                    request.data_parallel_rank, timeout, **engine_kw)
            log_user(request.user, outs[0].request_id)
            return HttpResponse(200, JSON, [completion_response(served, shape, outs, beam.as_sampling()).dumps()])
        params = request.to_sampling_params(request.max_tokens, request.logprobs, self.sampling_defaults)
        self.service.limits.open_request(len(prompts), params.n)  # n x prompts, prompt tokens in flight: 400 beyond
        if shape.decode is not None and params.prompt_logprobs is None:  # echo's logprobs: the prompt's too
            params = replace(params, prompt_logprobs=request.logprobs)
        rank = request.data_parallel_rank  # vLLM's extension: pin an engine
        generate = functools.partial(self.service.generate, params=params, traceparent=traceparent,
                                     data_parallel_rank=rank, timeout=timeout, **engine_kw)
        if request.stream:
            streams = [generate(_prompt_arg(p)) for p in prompts]
            first = await anext(streams[0])  # validation errors surface here, before the status is sent
            log_user(request.user, first.request_id)
            events = CompletionEvents(served, first.request_id, params, shape, request.include_usage(),
                                      request.continuous_usage())
            return HttpResponse(200, SSE, _with_inband_errors(_completion_events(events, streams, first), streams))
        outs = await gather_or_cancel(self.service.complete(_prompt_arg(p), params, "", traceparent, rank, timeout,
                                                            **engine_kw) for p in prompts)
        log_user(request.user, outs[0].request_id)
        return HttpResponse(200, JSON, [completion_response(served, shape, outs, params).dumps()])

    def _decode_one(self, token_id: int) -> str:
        """One token's text (special tokens shown): an echoed prompt's first token."""
        return self.service.tokenizer.decode([token_id], skip_special_tokens=False)

    async def _echo_texts(self, prompts: list[Union[str, list[int]]]) -> list[str]:
        """Each prompt as text (token-id prompts decoded), for ``echo``."""
        return [p if isinstance(p, str) else await self.service.decode(p, skip_special_tokens=False)
                for p in prompts]

    # ---- chat -------------------------------------------------------------------------------
    @answers_errors
    async def chat_completions(self, data: bytes, traceparent: str = "",
                               timeout: Optional[float] = None) -> HttpResponse:
        request = self.parse_body(ChatCompletionRequest, data)
        lora = await self.adapter_for(request.model)
        self.check_generates()
        served, engine_kw = lora or self.model, engine_keywords(lora, request.priority, request.cache_salt)
        params = request.to_params(self.sampling_defaults)
        options = getattr(self.service, "chat_options", None) or ChatOptions()
        choice = request.tool_choice.model_dump() if isinstance(request.tool_choice, BaseModel) else request.tool_choice
        tools = plan_tools(request.template_tools(), choice, request.parallel_tool_calls, options)
        prompt = await self.render_chat(request, tools.template_tools, request.template_variables())
        plan, params = await plan_chat(self.service, options, tools, prompt["prompt_token_ids"], params)
        headers = ignored_fields_header(request.ignored_fields())
        top_n = params.logprobs or 0
        if request.use_beam_search:
            beam = request.to_beam_search_params(request.max_completion_tokens or request.max_tokens,
                                                 self.service.max_model_len)
            out = (await search_all(self.service, [prompt], beam, traceparent, request.data_parallel_rank, timeout,
                                    **engine_kw))[0]
            log_user(request.user or request.safety_identifier, out.request_id)
            response = chat_response(served, out, beam.as_sampling(), 0, plan, False)
            return HttpResponse(200, JSON, [response.dumps()], headers)
        if request.stream:
            stream = self.service.generate(prompt, params, "", traceparent, request.data_parallel_rank, timeout,
                                           **engine_kw)
            first = await anext(stream)
            log_user(request.user or request.safety_identifier, first.request_id)
            events = ChatEvents(served, first.request_id, params, top_n, request.include_usage(),
                                request.continuous_usage(), plan)
            return HttpResponse(200, SSE, _with_inband_errors(_chat_events(events, stream, first), [stream]), headers)
        out = await self.service.complete(prompt, params, "", traceparent, request.data_parallel_rank, timeout,
                                          **engine_kw)
        log_user(request.user or request.safety_identifier, out.request_id)
        response = chat_response(served, out, params, top_n, plan, request.prompt_logprobs is not None)
        return HttpResponse(200, JSON, [response.dumps()], headers)


def ignored_fields_header(paths: list[str], most: int = 16) -> dict[str, str]:
    """The ``x-gridserve-ignored-fields`` header naming unknown keys inside messages (ASCII-escaped)."""
    if not paths:
        return {}
    named = ", ".join(json.dumps(p)[1:-1] for p in paths[:most])
    return {IGNORED_FIELDS_HEADER: named + (f", ... ({len(paths)} in all)" if len(paths) > most else "")}


def log_user(user: Optional[str], request_id: str) -> None:
    """OpenAI's ``user``: who asks, for the operator (the request's id ties it to the other logs)."""
    if user:
        logger.info("request %s for user %s", request_id, json.dumps(user))


def engine_keywords(lora_name: Optional[str], priority: int = 0, cache_salt: Optional[str] = None) -> dict[str, Any]:
    """The LoRA adapter, the priority and the prefix-cache salt as the service's keywords (none for
    the base model, 0 and no salt)."""
    kw: dict[str, Any] = {"lora_name": lora_name} if lora_name else {}
    if priority:
        kw["priority"] = priority
    if cache_salt is not None:
        kw["cache_salt"] = cache_salt
    return kw


def _prompt_arg(prompt: Union[str, list[int]]) -> Any:
    return prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}


async def _completion_events(events: CompletionEvents, streams: list[AsyncIterator[StreamChunk]],
                             first: StreamChunk) -> AsyncIterator[bytes]:
    """Prompt after prompt, each engine step's event; then usage and ``[DONE]``."""
    for i, stream in enumerate(streams):
        if i == 0 and (event := events.chunk(0, first)) is not None:
            yield event
        async for chunk in stream:
            if (event := events.chunk(i, chunk)) is not None:
                yield event
    for event in events.end():
        yield event


async def _chat_events(events: ChatEvents, stream: AsyncIterator[StreamChunk], first: StreamChunk,
                       ) -> AsyncIterator[bytes]:
    yield events.start()
    if (event := events.chunk(first)) is not None:
        yield event
    async for chunk in stream:
        if (event := events.chunk(chunk)) is not None:
            yield event
    for event in events.end():
        yield event


async def _with_inband_errors(events: AsyncIterator[bytes], streams: list[Any]) -> AsyncIterator[bytes]:
    """An SSE stream that, when it fails after the response has started, sends the error as one
    ``data: {"error": {...}}`` event and then ``data: [DONE]`` (an HTTP/1.1 client sees no
    trailers, so the status alone would be lost); the request streams are closed either way."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001 - every failure is reported in-band
        error = to_api_error(exc)
        yield b"data: " + error.body() + b"\n\n"
        yield DONE
    finally:
        for stream in streams:
            await stream.aclose()

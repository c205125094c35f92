"""The gateway's gRPC servicer: the public ``Gateway`` API, proto <-> domain only."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, Optional

import grpc
from google.api import httpbody_pb2

from gridserve import __version__
from gridserve.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from gridserve.services.gateway.chat_output import plan_chat
from gridserve.services.gateway.console import Console
from gridserve.services.gateway.convert import (
    chat_fields_from_pb,
    chat_to_pb,
    chunk_to_pb,
    completion_to_pb,
    prompt_from_pb,
    tool_choice_from_pb,
)
from gridserve.services.gateway.pooling_api import PoolingAPI
from gridserve.services.gateway.pooling_protocol import ScoreTexts
from gridserve.services.gateway.protocol import (
    ChatTemplateFields,
    check_priority,
    check_sampling_params,
    validate_as,
)
from gridserve.services.gateway.responses_api import ResponsesAPI
from gridserve.services.gateway.responses_store import ResponseStore, owner_of
from gridserve.services.gateway.routes import (
    REFUSED_TEMPLATE,
    HttpResponse,
    OpenAIRoutes,
    engine_keywords,
)
from gridserve.services.gateway.service import GatewayService
from gridserve.services.gateway.status import StatusCollector, snapshot_to_pb
from gridserve.services.gateway.tool_choice import plan_tools
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.observability.tracing import traceparent_from_metadata
from gridserve.shared.request_checks import check_cache_salt
from gridserve.shared.rpc.convert import sampling_params_from_pb
from gridserve.shared.rpc.metadata import (
    HTTP_STATUS_HEADER,  # the Envoy edge makes it the HTTP status
)
from gridserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Translates the public RPCs into ``GatewayService`` calls; every method is ``async`` and runs
    on the gateway's event loop (blocking work goes to the service's own pool). A caller that goes
    away cancels its handler, which aborts its engine requests."""

    def __init__(self, service: GatewayService, served_model_name: Optional[str] = None,
                 responses_store: Optional[ResponseStore] = None, runtime_lora_updating: bool = False) -> None:
        """``runtime_lora_updating``: the REST edge may load and unload LoRA adapters (the gateway
        has an ``--api-key``, which those routes then need)."""
        self.service = service
        self.openai = OpenAIRoutes(service, served_model_name, __version__, service.sampling_defaults,
                                   runtime_lora_updating)
        self.responses = ResponsesAPI(self.openai, responses_store)
        self.pooling = PoolingAPI(self.openai)
        self.console = Console()
        self.status: Optional[StatusCollector] = None  # set by main once the server's address is known

    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        params = self._params(request, request.text if request.WhichOneof("prompt") == "text" else None)
        request_id = request.request_id or uuid.uuid4().hex
        engine_kw = await self._engine_kw(request)
        async for chunk in self.service.generate(prompt_from_pb(request), params, request_id,
                                                 self._traceparent(context), _dp_rank(request),
                                                 context.time_remaining(), **engine_kw):
            for message in chunk_to_pb(chunk):
                yield message

    async def Complete(self, request: gateway_pb2.CompleteRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.CompleteResponse:
        params = self._params(request, request.text if request.WhichOneof("prompt") == "text" else None)
        request_id = request.request_id or uuid.uuid4().hex
        engine_kw = await self._engine_kw(request)
        out = await self.service.complete(prompt_from_pb(request), params, request_id,
                                          self._traceparent(context), _dp_rank(request), context.time_remaining(),
                                          **engine_kw)
        return completion_to_pb(request_id, out)

    async def Chat(self, request: gateway_pb2.ChatRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.ChatResponse:
        """A conversation (with tools, tool results and reasoning, as the REST chat route) to its reply."""
        params = self._params(request)
        engine_kw = await self._engine_kw(request)
        chat = validate_as(ChatTemplateFields, chat_fields_from_pb(request), self.service.limits)
        if chat.chat_template is not None and not self.service.limits.trust_request_chat_template:
            raise InvalidArgumentError("chat_template", REFUSED_TEMPLATE)
        options = self.service.chat_options
        parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None
        tools = plan_tools(chat.template_tools(), tool_choice_from_pb(request), parallel, options)
        extra = {"chat_template_kwargs": chat.chat_template_kwargs} if chat.chat_template_kwargs else {}
        prompt = await self.service.chat_prompt(chat.template_messages(), chat.chat_template,
                                                chat.add_generation_prompt, tools.template_tools, **extra)
        plan, params = await plan_chat(self.service, options, tools, prompt["prompt_token_ids"], params)
        request_id = request.request_id or uuid.uuid4().hex
        out = await self.service.complete(prompt, params, request_id, self._traceparent(context), _dp_rank(request),
                                          context.time_remaining(), **engine_kw)
        return chat_to_pb(request_id, out, plan)

    async def _engine_kw(self, request) -> dict[str, Any]:
        """The LoRA adapter the request's ``model`` names (none for the served model, the model as
        ``ListModels`` names it, or no name; NOT_FOUND for another name) and its ``priority``
        (INVALID_ARGUMENT without ``--allow-client-priority``) and ``cache_salt``, as the service's
        keywords."""
        priority = check_priority(request.priority, self.service.limits) if request.HasField("priority") else 0
        salt = request.cache_salt if request.HasField("cache_salt") else None
        if salt is not None:
            check_cache_salt(salt)
        if not request.HasField("model") or request.model == self.service.model_name:
            return engine_keywords(None, priority, salt)
        return engine_keywords(await self.openai.adapter_for(request.model), priority, salt)

    def _params(self, request, text_prompt: Optional[str] = None) -> SamplingParams:
        """The request's sampling params, through the same checks as the REST routes; a field it
        leaves unset takes the model's default (its generation config) when there is one."""
        params = sampling_params_from_pb(request.sampling_params)
        unset = {name: value for name, value in self.service.sampling_defaults.items()
                 if not request.sampling_params.HasField(name)}
        if unset:
            params = dataclasses.replace(params, **unset)
        check_sampling_params(params, self.service.limits, text_prompt)
        return params

    def _traceparent(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's W3C trace context (gRPC metadata; Envoy passes the HTTP header), tracing on."""
        if self.service.tracing is None:
            return ""
        return traceparent_from_metadata(context.invocation_metadata())

    async def Tokenize(self, request: gateway_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.TokenizeResponse:
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        return gateway_pb2.TokenizeResponse(token_ids=await self.service.encode(request.text, add_special))

    async def Detokenize(self, request: gateway_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> gateway_pb2.DetokenizeResponse:
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await self.service.decode(list(request.token_ids), skip_special_tokens=skip)
        return gateway_pb2.DetokenizeResponse(text=text)

    async def Embed(self, request: gateway_pb2.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> gateway_pb2.EmbedResponse:
        """Each input's embedding (a pooling model serving ``embed``), with the REST route's checks."""
        inputs = [i.text if i.WhichOneof("input") == "text" else list(i.token_ids.ids) for i in request.inputs]
        limits = self.service.limits
        if not inputs or any(not i for i in inputs):
            raise InvalidArgumentError("inputs", "expected at least one input, none of them empty")
        if len(inputs) > limits.max_prompts_per_request:
            raise InvalidArgumentError("inputs", f"at most {limits.max_prompts_per_request} inputs allowed "
                                                 f"(--max-prompts-per-request), got {len(inputs)}")
        longest = max(len(i) for i in inputs)
        if longest > limits.max_content_chars:
            raise InvalidArgumentError("inputs", f"an input of {longest} characters or tokens; at most "
                                                 f"{limits.max_content_chars} allowed (--max-content-chars)")
        outs = await self.pooling.embed(
            inputs, dimensions=_opt(request, "dimensions"), normalize=_opt(request, "normalize"),
            truncate=_truncation(request), model=self._model(request), traceparent=self._traceparent(context),
            timeout=context.time_remaining(), field_name="inputs")
        tokens = sum(out.num_prompt_tokens for out in outs)
        return gateway_pb2.EmbedResponse(
            request_id=request.request_id or (outs[0].request_id if outs else ""),
            embeddings=[gateway_pb2.Embedding(index=i, values=out.values) for i, out in enumerate(outs)],
            usage=gateway_pb2.Usage(prompt_tokens=tokens))

    async def Score(self, request: gateway_pb2.ScoreRequest,
                    context: grpc.aio.ServicerContext) -> gateway_pb2.ScoreResponse:
        """Each pair's score (a cross-encoder's, or an embedding model's cosine similarity)."""
        fields = {"text_1": list(request.text_1), "text_2": list(request.text_2)}
        validate_as(ScoreTexts, fields, self.service.limits)
        scores, tokens = await self.pooling.score(
            fields["text_1"], fields["text_2"], activation=_opt(request, "activation"),
            truncate=_truncation(request), model=self._model(request), traceparent=self._traceparent(context),
            timeout=context.time_remaining())
        return gateway_pb2.ScoreResponse(request_id=request.request_id or uuid.uuid4().hex, scores=scores,
                                         usage=gateway_pb2.Usage(prompt_tokens=tokens))

    def _model(self, request) -> Optional[str]:
        """The request's ``model`` (None: unset or the model as ``ListModels`` names it)."""
        if not request.HasField("model") or request.model == self.service.model_name:
            return None
        return request.model

    async def ListModels(self, request: gateway_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> gateway_pb2.ListModelsResponse:
        model = gateway_pb2.Model(id=self.service.model_name, max_model_len=self.service.max_model_len,
                                  owned_by="gridserve", root=self.service.model_name)
        adapters = [gateway_pb2.Model(id=a.name, max_model_len=self.service.max_model_len, owned_by="gridserve",
                                      parent=self.service.model_name, root=a.path)
                    for a in await self.openai.adapters()]
        return gateway_pb2.ListModelsResponse(models=[model, *adapters])

    # ---- OpenAI-compatible REST (google.api.HttpBody in and out, through the Envoy edge) ----------
    async def OpenAIListModels(self, request: httpbody_pb2.HttpBody, context: grpc.aio.ServicerContext):
        return await _unary(await self.openai.models(), context)

    async def OpenAICompletions(self, request: httpbody_pb2.HttpBody, context: grpc.aio.ServicerContext):
        response = await self.openai.completions(request.data, self._traceparent(context), context.time_remaining())
        async for body in _stream(response, context):
            yield body

    async def OpenAIChatCompletions(self, request: httpbody_pb2.HttpBody, context: grpc.aio.ServicerContext):
        response = await self.openai.chat_completions(request.data, self._traceparent(context),
                                                      context.time_remaining())
        async for body in _stream(response, context):
            yield body

    async def OpenAIResponses(self, request: httpbody_pb2.HttpBody, context: grpc.aio.ServicerContext):
        response = await self.responses.create(request.data, owner_of(context.invocation_metadata()),
                                               self._traceparent(context), context.time_remaining())
        async for body in _stream(response, context):
            yield body

    async def OpenAIGetResponse(self, request: gateway_pb2.OpenAIGetResponseRequest,
                                context: grpc.aio.ServicerContext):
        owner = owner_of(context.invocation_metadata())
        return await _unary(await self.responses.retrieve(request.response_id, owner), context)

    async def OpenAITokenize(self, request: httpbody_pb2.HttpBody, context: grpc.aio.ServicerContext):
        return await _unary(await self.openai.tokenize(request.data), context)

    async def OpenAIDetokenize(self, request: httpbody_pb2.HttpBody, context: grpc.aio.ServicerContext):
        return await _unary(await self.openai.detokenize(request.data), context)

    async def OpenAILoadLoraAdapter(self, request: httpbody_pb2.HttpBody, context: grpc.aio.ServicerContext):
        return await _unary(await self.openai.load_lora_adapter(request.data), context)

    async def OpenAIUnloadLoraAdapter(self, request: httpbody_pb2.HttpBody, context: grpc.aio.ServicerContext):
        return await _unary(await self.openai.unload_lora_adapter(request.data), context)

    async def OpenAIEmbeddings(self, request: httpbody_pb2.HttpBody, context: grpc.aio.ServicerContext):
        return await _unary(await self.pooling.embeddings(request.data, self._traceparent(context),
                                                          context.time_remaining()), context)

    async def OpenAIScore(self, request: httpbody_pb2.HttpBody, context: grpc.aio.ServicerContext):
        return await _unary(await self.pooling.score_route(request.data, self._traceparent(context),
                                                           context.time_remaining()), context)

    async def OpenAIRerank(self, request: httpbody_pb2.HttpBody, context: grpc.aio.ServicerContext):
        return await _unary(await self.pooling.rerank(request.data, self._traceparent(context),
                                                      context.time_remaining()), context)

    async def OpenAIClassify(self, request: httpbody_pb2.HttpBody, context: grpc.aio.ServicerContext):
        return await _unary(await self.pooling.classify_route(request.data, self._traceparent(context),
                                                              context.time_remaining()), context)

    async def OpenAIHealth(self, request: httpbody_pb2.HttpBody, context: grpc.aio.ServicerContext):
        return await _unary(await self.openai.health(), context)

    async def OpenAIVersion(self, request: httpbody_pb2.HttpBody, context: grpc.aio.ServicerContext):
        return await _unary(await self.openai.version_info(), context)

    async def OpenAIOpenAPI(self, request: httpbody_pb2.HttpBody, context: grpc.aio.ServicerContext):
        return await _unary(await self.openai.openapi(), context)

    async def GetStatus(self, request: gateway_pb2.GetStatusRequest, context: grpc.aio.ServicerContext):
        return snapshot_to_pb(await self.status.snapshot())

    async def GetConsoleFile(self, request: gateway_pb2.GetConsoleFileRequest, context: grpc.aio.ServicerContext):
        page = self.console.get(request.name)
        if page.status != 200:
            await context.send_initial_metadata(((HTTP_STATUS_HEADER, str(page.status)),))
        return httpbody_pb2.HttpBody(content_type=page.content_type, data=page.body)


def _opt(request, name: str):
    return getattr(request, name) if request.HasField(name) else None


def _truncation(request) -> Optional[int]:
    """``truncate_prompt_tokens`` (unset: none; 0 and below -1 refused naming it)."""
    value = _opt(request, "truncate_prompt_tokens")
    if value is not None and (value == 0 or value < -1):
        raise InvalidArgumentError("truncate_prompt_tokens", "must be -1 (max_model_len) or a positive number "
                                                             "of tokens")
    return value


def _dp_rank(request) -> Optional[int]:
    return request.data_parallel_rank if request.HasField("data_parallel_rank") else None


async def _send_status(response: HttpResponse, context: grpc.aio.ServicerContext) -> None:
    """The HTTP status (and extra headers, e.g. a 429's ``retry-after``) as initial metadata: the
    edge turns them into the transcoded response's status and headers."""
    if response.status != 200 or response.headers:
        await context.send_initial_metadata(((HTTP_STATUS_HEADER, str(response.status)),
                                             *response.headers.items()))


async def _unary(response: HttpResponse, context: grpc.aio.ServicerContext) -> httpbody_pb2.HttpBody:
    await _send_status(response, context)
    return httpbody_pb2.HttpBody(content_type=response.content_type, data=b"".join(response.chunks))


async def _stream(response: HttpResponse, context: grpc.aio.ServicerContext) -> AsyncIterator[httpbody_pb2.HttpBody]:
    await _send_status(response, context)
    if isinstance(response.chunks, (list, tuple)):
        for data in response.chunks:
            yield httpbody_pb2.HttpBody(content_type=response.content_type, data=data)
        return
    async for data in response.chunks:
        yield httpbody_pb2.HttpBody(content_type=response.content_type, data=data)

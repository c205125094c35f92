"""The gateway's gRPC servicer: the public ``Gateway`` API, proto <-> domain only."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Optional

import grpc
from google.api import httpbody_pb2

from gridserve import __version__
from gridserve.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from gridserve.services.gateway.console import Console
from gridserve.services.gateway.convert import (
    chat_to_pb,
    chunk_to_pb,
    completion_to_pb,
    prompt_from_pb,
)
from gridserve.services.gateway.openai_api import HttpResponse, OpenAIApi
from gridserve.services.gateway.service import GatewayService
from gridserve.services.gateway.status import StatusCollector, snapshot_to_pb
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.observability.tracing import traceparent_from_metadata
from gridserve.shared.rpc.convert import sampling_params_from_pb
from gridserve.shared.rpc.metadata import (
    HTTP_STATUS_HEADER,  # the Envoy edge makes it the HTTP status
)

logger = logging.getLogger(__name__)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Translates the public RPCs into ``GatewayService`` calls."""

    def __init__(self, service: GatewayService, served_model_name: Optional[str] = None) -> None:
        self.service = service
        self.openai = OpenAIApi(service, served_model_name, __version__)
        self.console = Console()
        self.status: Optional[StatusCollector] = None  # set by main once the server's address is known

    def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[gateway_pb2.GenerateResponse]:
        params = sampling_params_from_pb(request.sampling_params)
        request_id = request.request_id or uuid.uuid4().hex
        for chunk in self.service.generate(prompt_from_pb(request), params, request_id, context.add_callback,
                                           self._traceparent(context), _dp_rank(request)):
            yield from chunk_to_pb(chunk)

    def Complete(self, request: gateway_pb2.CompleteRequest, context: grpc.ServicerContext):
        params = sampling_params_from_pb(request.sampling_params)
        request_id = request.request_id or uuid.uuid4().hex
        out = self.service.complete(prompt_from_pb(request), params, request_id, context.add_callback,
                                    self._traceparent(context), _dp_rank(request))
        return completion_to_pb(request_id, out)

    def Chat(self, request: gateway_pb2.ChatRequest, context: grpc.ServicerContext):
        if not request.messages:
            raise InvalidArgumentError("messages", "the conversation is empty")
        params = sampling_params_from_pb(request.sampling_params)
        prompt = self.service.chat_prompt(
            [{"role": m.role, "content": m.content} for m in request.messages],
            request.chat_template if request.HasField("chat_template") else None,
            request.add_generation_prompt if request.HasField("add_generation_prompt") else True,
        )
        request_id = request.request_id or uuid.uuid4().hex
        out = self.service.complete(prompt, params, request_id, context.add_callback, self._traceparent(context),
                                    _dp_rank(request))
        return chat_to_pb(request_id, out)

    def _traceparent(self, context: grpc.ServicerContext) -> str:
        """The caller's W3C trace context (gRPC metadata; Envoy passes the HTTP header), tracing on."""
        if self.service.tracing is None:
            return ""
        return traceparent_from_metadata(context.invocation_metadata())

    def Tokenize(self, request: gateway_pb2.TokenizeRequest, context: grpc.ServicerContext):
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        return gateway_pb2.TokenizeResponse(token_ids=self.service.tokenizer.encode(request.text, add_special))

    def Detokenize(self, request: gateway_pb2.DetokenizeRequest, context: grpc.ServicerContext):
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = self.service.tokenizer.decode(list(request.token_ids), skip_special_tokens=skip)
        return gateway_pb2.DetokenizeResponse(text=text)

    def ListModels(self, request: gateway_pb2.ListModelsRequest, context: grpc.ServicerContext):
        model = gateway_pb2.Model(id=self.service.model_name, max_model_len=self.service.max_model_len,
                                  owned_by="gridserve")
        return gateway_pb2.ListModelsResponse(models=[model])

    # ---- OpenAI-compatible REST (google.api.HttpBody in and out, through the Envoy edge) ----------
    def OpenAIListModels(self, request: httpbody_pb2.HttpBody, context: grpc.ServicerContext):
        return _unary(self.openai.models(), context)

    # The two streaming routes run on the server's asyncio loop (RpcServer): one thread serves
    # every open stream; the rest of the methods run in its thread pool.
    async def OpenAICompletions(self, request: httpbody_pb2.HttpBody, context: grpc.aio.ServicerContext):
        response = await self.openai.completions_async(request.data, _on_done(context), self._traceparent(context))
        async for body in _astream(response, context):
            yield body

    async def OpenAIChatCompletions(self, request: httpbody_pb2.HttpBody, context: grpc.aio.ServicerContext):
        response = await self.openai.chat_completions_async(request.data, _on_done(context),
                                                            self._traceparent(context))
        async for body in _astream(response, context):
            yield body

    def OpenAITokenize(self, request: httpbody_pb2.HttpBody, context: grpc.ServicerContext):
        return _unary(self.openai.tokenize(request.data), context)

    def OpenAIDetokenize(self, request: httpbody_pb2.HttpBody, context: grpc.ServicerContext):
        return _unary(self.openai.detokenize(request.data), context)

    def OpenAIHealth(self, request: httpbody_pb2.HttpBody, context: grpc.ServicerContext):
        return _unary(self.openai.health(), context)

    def OpenAIVersion(self, request: httpbody_pb2.HttpBody, context: grpc.ServicerContext):
        return _unary(self.openai.version_info(), context)

    async def GetStatus(self, request: gateway_pb2.GetStatusRequest, context: grpc.aio.ServicerContext):
        return snapshot_to_pb(await self.status.snapshot())

    async def GetConsoleFile(self, request: gateway_pb2.GetConsoleFileRequest, context: grpc.aio.ServicerContext):
        page = self.console.get(request.name)
        if page.status != 200:
            await context.send_initial_metadata(((HTTP_STATUS_HEADER, str(page.status)),))
        return httpbody_pb2.HttpBody(content_type=page.content_type, data=page.body)


def _dp_rank(request) -> Optional[int]:
    return request.data_parallel_rank if request.HasField("data_parallel_rank") else None


def _send_status(response: HttpResponse, context: grpc.ServicerContext) -> None:
    if response.status != 200:
        context.send_initial_metadata(((HTTP_STATUS_HEADER, str(response.status)),))


def _unary(response: HttpResponse, context: grpc.ServicerContext) -> httpbody_pb2.HttpBody:
    _send_status(response, context)
    return httpbody_pb2.HttpBody(content_type=response.content_type, data=b"".join(response.chunks))


def _on_done(context: grpc.aio.ServicerContext) -> Callable[[Callable[[], None]], None]:
    """``on_done`` for the blocking paths: run ``fn`` when the call ends (the caller may be gone)."""
    return lambda fn: context.add_done_callback(lambda _call: fn())


async def _astream(response: HttpResponse, context: grpc.aio.ServicerContext) -> AsyncIterator[httpbody_pb2.HttpBody]:
    if response.status != 200:
        await context.send_initial_metadata(((HTTP_STATUS_HEADER, str(response.status)),))
    if isinstance(response.chunks, (list, tuple)):
        for data in response.chunks:
            yield httpbody_pb2.HttpBody(content_type=response.content_type, data=data)
        return
    async for data in response.chunks:
        yield httpbody_pb2.HttpBody(content_type=response.content_type, data=data)


def _stream(response: HttpResponse, context: grpc.ServicerContext) -> Iterator[httpbody_pb2.HttpBody]:
    _send_status(response, context)
    for data in response.chunks:
        yield httpbody_pb2.HttpBody(content_type=response.content_type, data=data)

"""``--api-key``: the gateway's bearer-token check, one gRPC server interceptor for every path.

Clients send ``authorization: Bearer <key>``, as an HTTP header through the Envoy edge (the
transcoder passes headers on as gRPC metadata) or as metadata on a native gRPC call. As with
``vllm serve --api-key``, the REST routes under ``/v1`` need the key and ``/health``, ``/version``,
``/tokenize``, ``/detokenize`` and ``/openapi.json`` do not (nor do the web console's static files,
whose page asks for the key); health checks and reflection stay open so probes and
tools work. ``/tokenize`` with images is the exception: it costs what generation's image path costs
(fetch, decode, resize), so it needs the key too; the route asks ``caller.api_key_given()``, which
this interceptor sets around the handler (``KEY_FOR_IMAGES``). A missing or wrong key is ``UNAUTHENTICATED`` for native gRPC and an OpenAI-shaped
HTTP 401 body for the REST routes (which return ``google.api.HttpBody``).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any, Optional

import grpc
from google.api import httpbody_pb2

from gridserve.services.gateway import caller
from gridserve.services.gateway.api_errors import ApiError
from gridserve.services.gateway.routes import JSON
from gridserve.shared.rpc.metadata import HTTP_STATUS_HEADER

GATEWAY = "/gridserve.gateway.v1.Gateway/"
# Gateway methods reachable without the key (vLLM leaves these REST paths open too).
OPEN_METHODS = frozenset(GATEWAY + m for m in ("OpenAIHealth", "OpenAIVersion", "OpenAITokenize",
                                               "OpenAIDetokenize", "OpenAIOpenAPI", "GetConsoleFile"))
# Open without the key except for their images: the handler sees whether the key came.
KEY_FOR_IMAGES = frozenset({GATEWAY + "OpenAITokenize"})
# Routes answering google.api.HttpBody: a refusal there is an HTTP 401 with OpenAI's error body.
REST_PREFIX = GATEWAY + "OpenAI"


def _bearer(metadata: Optional[tuple]) -> Optional[str]:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every ``Gateway`` call that does not carry the configured key."""

    def __init__(self, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self._key = api_key.encode()

    def _allowed(self, details: grpc.HandlerCallDetails) -> bool:
        method = details.method
        if not method.startswith(GATEWAY) or method in OPEN_METHODS:
            return True
        return self._key_given(details)

    def _key_given(self, details: grpc.HandlerCallDetails) -> bool:
        given = _bearer(details.invocation_metadata)
        return given is not None and hmac.compare_digest(given.encode(), self._key)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        """The method's handler itself, or one that refuses the call."""
        handler = await continuation(details)
        if handler is not None and details.method in KEY_FOR_IMAGES:
            return _knowing_the_key(handler, self._key_given(details))
        if handler is None or self._allowed(details):
            return handler
        if details.method.startswith(REST_PREFIX):
            return _http_401(handler)
        return _unauthenticated(handler)


_MESSAGE = "Unauthorized: a valid API key is required (header `Authorization: Bearer <key>`)"


def _knowing_the_key(handler: grpc.RpcMethodHandler, given: bool) -> grpc.RpcMethodHandler:
    """``handler`` (unary) run with ``caller.api_key_given()`` saying whether the key came."""
    behavior = handler.unary_unary

    async def answer(request: Any, context: grpc.aio.ServicerContext) -> Any:
        token = caller.set_api_key_given(given)
        try:
            return await behavior(request, context)
        finally:
            caller.reset(token)

    return handler._replace(unary_unary=answer)


def _error_body() -> httpbody_pb2.HttpBody:
    error = ApiError(401, _MESSAGE, None, "AuthenticationError")
    return httpbody_pb2.HttpBody(content_type=JSON, data=error.body())


def _http_401(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def answer(request: Any, context: grpc.aio.ServicerContext) -> httpbody_pb2.HttpBody:
        await context.send_initial_metadata(((HTTP_STATUS_HEADER, "401"),))
        return _error_body()

    async def answer_stream(request: Any, context: grpc.aio.ServicerContext):
        yield await answer(request, context)

    serializers = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(answer_stream, **serializers)
    return grpc.unary_unary_rpc_method_handler(answer, **serializers)


def _unauthenticated(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext):
        await refuse(request, context)
        yield  # pragma: no cover - abort raises

    serializers = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **serializers)
    if handler.stream_unary is not None or handler.stream_stream is not None:
        raise NotImplementedError("the Gateway service has no client-streaming methods")
    return grpc.unary_unary_rpc_method_handler(refuse, **serializers)

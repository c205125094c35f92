"""One server interceptor that maps gridserve's typed errors to gRPC status codes.

``InvalidArgumentError`` -> INVALID_ARGUMENT (the message names the field), ``EngineDeadError``
-> UNAVAILABLE, ``ModelNotFoundError`` -> NOT_FOUND, ``FailedPreconditionError`` ->
FAILED_PRECONDITION, ``PermissionDeniedError`` -> PERMISSION_DENIED, ``ResourceExhaustedError`` ->
RESOURCE_EXHAUSTED, ``DeadlineExceededError`` -> DEADLINE_EXCEEDED, ``RequestFailedError`` (one request
failed in a worker) -> INTERNAL with its reason; anything else -> INTERNAL (logged with its
traceback). An ``RpcError`` from an upstream call keeps its code. A ``grpc.aio`` server interceptor (``RpcServer`` is the only server):
it wraps unary and streaming handlers alike, ``async def`` ones on the loop and plain ones, which
that server runs in its thread pool.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import grpc

from gridserve.shared.errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    EngineDeadError,
    FailedPreconditionError,
    InvalidArgumentError,
    ModelNotFoundError,
    PermissionDeniedError,
    RequestFailedError,
    ResourceExhaustedError,
)

logger = logging.getLogger(__name__)

_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (ModelNotFoundError, grpc.StatusCode.NOT_FOUND),
    (AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (RequestFailedError, grpc.StatusCode.INTERNAL),
]


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a server answers for ``exc``."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return exc.code(), exc.details() or str(exc)
    for klass, code in _CODES:
        if isinstance(exc, klass):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def _logged_status(exc: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    """``status_for(exc)``, logged (with the traceback when it is a bug)."""
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL and not isinstance(exc, RequestFailedError):
        logger.exception("%s failed", method)
    else:
        logger.info("%s -> %s: %s", method, code.name, message)
    return code, message


def _abort_in_pool(context: grpc.ServicerContext, exc: Exception, method: str) -> None:
    """A plain handler's failure (it ran in the server's thread pool)."""
    context.abort(*_logged_status(exc, method))


async def _abort_on_loop(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    """An ``async def`` handler's failure."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc  # the handler aborted on purpose
    code, message = _logged_status(exc, method)
    await context.abort(code, message, trailing_metadata=_trailers(exc))


def _trailers(exc: Exception) -> tuple[tuple[str, str], ...]:
    """Metadata a status carries: a full queue's ``retry-after`` (seconds), as HTTP's header."""
    if isinstance(exc, ResourceExhaustedError):
        return (("retry-after", str(exc.retry_after_s)),)
    return ()


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler so a raised exception becomes the matching status code."""

    async def intercept_service(self, continuation: Callable, handler_call_details: Any):
        return wrap_handler(await continuation(handler_call_details), handler_call_details.method)


def wrap_handler(handler: Any, method: str) -> Any:
    """``handler`` with its behavior wrapped by the error mapping (async behaviors by async wrappers)."""
    if handler is None:
        return None
    if handler.unary_unary:
        return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, method))
    if handler.unary_stream:
        return handler._replace(unary_stream=_wrap_stream(handler.unary_stream, method))
    if handler.stream_unary:
        return handler._replace(stream_unary=_wrap_unary(handler.stream_unary, method))
    return handler._replace(stream_stream=_wrap_stream(handler.stream_stream, method))


def _wrap_unary(behavior: Callable, method: str) -> Callable:
    if inspect.iscoroutinefunction(behavior):
        async def wrapped_async(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behavior(request, context)
            except Exception as exc:  # noqa: BLE001 - every error becomes a status code
                await _abort_on_loop(context, exc, method)

        return wrapped_async

    def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behavior(request, context)
        except Exception as exc:  # noqa: BLE001 - every error becomes a status code
            _abort_in_pool(context, exc, method)

    return wrapped


def _wrap_stream(behavior: Callable, method: str) -> Callable:
    if inspect.isasyncgenfunction(behavior):
        async def wrapped_async(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async for response in behavior(request, context):
                    yield response
            except Exception as exc:  # noqa: BLE001 - every error becomes a status code
                await _abort_on_loop(context, exc, method)

        return wrapped_async
    if inspect.iscoroutinefunction(behavior):  # streams through ``context.write`` (health's Watch)
        async def wrapped_writer(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behavior(request, context)
            except Exception as exc:  # noqa: BLE001 - every error becomes a status code
                await _abort_on_loop(context, exc, method)

        return wrapped_writer

    def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            yield from behavior(request, context)
        except Exception as exc:  # noqa: BLE001 - every error becomes a status code
            _abort_in_pool(context, exc, method)

    return wrapped

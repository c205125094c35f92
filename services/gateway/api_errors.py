"""Errors of the REST routes, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

A refusal (a body the protocol models reject, an ``InvalidArgumentError`` from the domain) is 400
naming the field; an unknown model (neither the served model nor one of its LoRA adapters) 404; a
refused LoRA load or unload its ``LoraRefusal``'s status (``lora.py``); every engine's queue full 429 with ``Retry-After``; a
request past its deadline (the caller's or ``--request-timeout``) 504, as gRPC's DEADLINE_EXCEEDED
maps to HTTP (the request reached the server, which did not finish in time); no engine 503. Anything else is a bug: 500 in the same
shape, with the request id in the message and the traceback in the log.
"""

from __future__ import annotations

import logging
import re
import uuid
from typing import Optional

import grpc
from pydantic import ValidationError

from gridserve.services.gateway.lora import LoraRefusal
from gridserve.services.gateway.protocol import ErrorInfo, ErrorResponse
from gridserve.shared.errors import (
    DeadlineExceededError,
    EngineDeadError,
    InvalidArgumentError,
    ModelNotFoundError,
    RequestFailedError,
    ResourceExhaustedError,
)

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered as OpenAI's error body with an HTTP status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type_: str = "BadRequestError", headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.headers = headers or {}  # extra response headers (``retry-after``)

    def body(self) -> bytes:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status)
        return ErrorResponse(error=info).dumps()


# Parts of a pydantic error location that name a union member (``str``, ``list[ContentPart]``,
# ``function-after[...]``, a model class), not a field: OpenAI's fields are all snake_case.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|[A-Z]\w*|.*\[.*)$")


def _field_path(loc: tuple) -> list[str]:
    """Field names and list indices, union members dropped; an index joins its field as ``[i]``."""
    path: list[str] = []
    for part in loc:
        if isinstance(part, int) and path:
            path[-1] += f"[{part}]"
        elif not (isinstance(part, str) and _UNION_TAG.match(part)):
            path.append(str(part))
    return path


def from_validation_error(exc: ValidationError) -> ApiError:
    """The problem pydantic found, naming the field (``param`` is the top-level one).

    A field that takes a union (``content``: a string or a list of parts) fails once per member; the
    member tags are dropped from the path and the deepest failure is the one reported (a bad image
    part names ``messages[0].content[0].image_url``); failures that all stop at the union itself (a
    number where a string or list belongs) are reported together."""
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first['msg']}")
    if not first["loc"]:
        named = (first.get("ctx") or {}).get("error")
        if isinstance(named, InvalidArgumentError):  # a check across fields, naming the one at fault
            return ApiError(400, f"{named.field}: {named.message}", named.field.split(".")[0].split("[")[0])
        return ApiError(400, f"the request body must be a JSON object: {first['msg']}")
    paths = [_field_path(e["loc"]) for e in errors]
    depths = [sum(1 for part in e["loc"] if not (isinstance(part, str) and _UNION_TAG.match(part)))
              for e in errors]
    deepest = max(range(len(errors)), key=lambda i: (depths[i], -i))
    loc = paths[deepest]
    same = [e for e, p in zip(errors, paths) if p == loc]
    messages = list(dict.fromkeys(_message(e) for e in same))
    if not loc:
        loc = [str(part) for part in first["loc"]]
    return ApiError(400, f"{'.'.join(loc)}: {' or '.join(messages)}", loc[0].split("[")[0])


def _message(error: dict) -> str:
    if error["type"] == "extra_forbidden":  # OpenAI's words for a field it does not know
        return "unrecognized request argument supplied (neither an OpenAI nor a vLLM field this server serves)"
    return str(error["msg"]).removeprefix("Value error, ")


def to_api_error(exc: BaseException, request_id: str = "") -> ApiError:
    """The OpenAI error of any failure; an unexpected one is logged with its traceback as a 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, LoraRefusal):
        return ApiError(exc.status, exc.message, exc.param, exc.kind)
    if isinstance(exc, ModelNotFoundError):  # a model name that is neither the served model nor an adapter
        return ApiError(404, str(exc), "model", "NotFoundError")
    if isinstance(exc, InvalidArgumentError):
        # Domain field paths ("sampling_params.temperature") name the OpenAI field ("temperature").
        param = exc.field.removeprefix("sampling_params.")
        return ApiError(400, f"{param}: {exc.message}", param)
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        # An engine's own check refused what the gateway let through: still the client's error.
        details = exc.details() or "invalid argument"
        field = details.split(":", 1)[0] if ":" in details else ""
        param = field.removeprefix("sampling_params.") if field and " " not in field else None
        return ApiError(400, details.removeprefix("sampling_params."), param)
    if isinstance(exc, ResourceExhaustedError):
        return ApiError(429, str(exc), None, "RateLimitError", {"retry-after": str(exc.retry_after_s)})
    if isinstance(exc, DeadlineExceededError):
        return ApiError(504, str(exc), None, "TimeoutError")
    if isinstance(exc, EngineDeadError):
        return ApiError(503, str(exc), None, "ServiceUnavailableError")
    if isinstance(exc, RequestFailedError):  # one request failed in a worker; the message says why
        return ApiError(500, str(exc), None, "InternalServerError")
    request_id = request_id or uuid.uuid4().hex
    logger.error("request %s failed with an internal error", request_id, exc_info=exc)
    return ApiError(500, f"internal error ({type(exc).__name__}); request id {request_id}", None,
                    "InternalServerError")


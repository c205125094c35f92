"""Errors of the REST routes, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

A refusal (a body the protocol models reject, an ``InvalidArgumentError`` from the domain) is 400
naming the field; an unknown model 404; no engine 503. Anything else is a bug: 500 in the same
shape, with the request id in the message and the traceback in the log.
"""

from __future__ import annotations

import logging
import uuid
from typing import Optional

from pydantic import ValidationError

from gridserve.services.gateway.protocol import ErrorInfo, ErrorResponse
from gridserve.shared.errors import EngineDeadError, InvalidArgumentError, RequestFailedError

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered as OpenAI's error body with an HTTP status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type_: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_

    def body(self) -> bytes:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status)
        return ErrorResponse(error=info).dumps()


def from_validation_error(exc: ValidationError) -> ApiError:
    """The first problem pydantic found, naming the field (``param`` is the top-level one)."""
    error = exc.errors(include_url=False, include_input=False)[0]
    loc = [str(part) for part in error["loc"]]
    if error["type"] == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {error['msg']}")
    if not loc:
        return ApiError(400, f"the request body must be a JSON object: {error['msg']}")
    message = str(error["msg"]).removeprefix("Value error, ")
    return ApiError(400, f"{'.'.join(loc)}: {message}", loc[0])


def to_api_error(exc: BaseException, request_id: str = "") -> ApiError:
    """The OpenAI error of any failure; an unexpected one is logged with its traceback as a 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, InvalidArgumentError):
        # Domain field paths ("sampling_params.temperature") name the OpenAI field ("temperature").
        param = exc.field.removeprefix("sampling_params.")
        return ApiError(400, f"{param}: {exc.message}", param)
    if isinstance(exc, EngineDeadError):
        return ApiError(503, str(exc), None, "ServiceUnavailableError")
    if isinstance(exc, RequestFailedError):  # one request failed in a worker; the message says why
        return ApiError(500, str(exc), None, "InternalServerError")
    request_id = request_id or uuid.uuid4().hex
    logger.error("request %s failed with an internal error", request_id, exc_info=exc)
    return ApiError(500, f"internal error ({type(exc).__name__}); request id {request_id}", None,
                    "InternalServerError")


"""Typed errors. Each one names the offending field so a server can map it to INVALID_ARGUMENT / HTTP 400."""

from __future__ import annotations


class GridserveError(Exception):
    """Base class of every error gridserve raises on purpose."""


class InvalidArgumentError(GridserveError, ValueError):
    """A user-supplied value is invalid. ``field`` names it (e.g. ``sampling_params.top_p``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ConfigError(InvalidArgumentError):
    """An engine configuration value is invalid."""


class ModelNotFoundError(GridserveError, FileNotFoundError):
    """The model given by path or hub id could not be found."""


class AlreadyExistsError(GridserveError, ValueError):
    """The thing to create exists already (a LoRA adapter name in use)."""


class EngineDeadError(GridserveError, RuntimeError):
    """The engine or one of its workers failed; in-flight requests cannot complete."""


class FailedPreconditionError(GridserveError, RuntimeError):
    """The operation is valid but not in the current state (e.g. sleeping with requests in flight)."""


class ResourceExhaustedError(GridserveError, RuntimeError):
    """A queue is full (an engine's waiting queue, or every engine's): try again later.
    ``retry_after_s`` is the client's hint (HTTP ``Retry-After``)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceededError(GridserveError, TimeoutError):
    """A request ran past its deadline (the client's gRPC deadline or ``--request-timeout``)."""


class PermissionDeniedError(GridserveError, PermissionError):
    """The caller may not do this (e.g. call a worker method the extension does not define)."""


class RequestFailedError(GridserveError, RuntimeError):
    """One request failed inside the engine or a worker (e.g. its grammar); the others went on.
    INTERNAL over gRPC, HTTP 500 over REST, with the reason."""

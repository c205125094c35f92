"""What the gateway knows about the caller of the call it is handling, for the handler to read.

``api_key_given()``: whether the call carried the gateway's API key (always true when the gateway
has none). A route open without the key (vLLM's ``/tokenize``) asks it before work that costs like
generation does: with images, ``/tokenize`` fetches, decodes and resizes each one, so it needs the
key as ``/v1/chat/completions`` does. ``auth.ApiKeyInterceptor`` sets it around the handler.
"""

from __future__ import annotations

from contextvars import ContextVar

_API_KEY_GIVEN: ContextVar[bool] = ContextVar("gridserve_api_key_given", default=True)


def api_key_given() -> bool:
    return _API_KEY_GIVEN.get()


def set_api_key_given(given: bool):
    """Set it for the current call; returns the token ``reset`` takes."""
    return _API_KEY_GIVEN.set(given)


def reset(token) -> None:
    _API_KEY_GIVEN.reset(token)


IMAGES_NEED_KEY = ("Unauthorized: /tokenize with images needs a valid API key (header `Authorization: Bearer "
                   "<key>`), as generation does")

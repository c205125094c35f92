"""``/tokenize`` stays open without the API key (as vLLM's), but not its image path: with images it
fetches, decodes and resizes each one, work that costs what generation's does, so it needs the key
(services/gateway/auth.py sets ``caller.api_key_given()``, routes.py asks it)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import grpc

from gridserve.services.gateway import caller
from gridserve.services.gateway.auth import ApiKeyInterceptor
from gridserve.services.gateway.limits import RequestLimits
from gridserve.services.gateway.media_loader import MediaLoader
from gridserve.services.gateway.routes import OpenAIRoutes

TOKENIZE = "/gridserve.gateway.v1.Gateway/OpenAITokenize"


class _Service:
    model_name = "m"
    max_model_len = 64

    def __init__(self) -> None:
        self.limits = RequestLimits()
        self.media = MediaLoader()
        self.input_processor = SimpleNamespace(vocab_size=128, multimodal=None)
        self.tokenizer = SimpleNamespace(decode=lambda ids: "")

    async def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


def _images_body() -> bytes:
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "?"}]
    return json.dumps({"messages": [{"role": "user", "content": parts}]}).encode()


async def _tokenize(body: bytes, key_given: bool):
    token = caller.set_api_key_given(key_given)
    try:
        return await OpenAIRoutes(_Service(), "m").tokenize(body)
    finally:
        caller.reset(token)


def test_tokenize_with_images_without_the_key_is_401_and_text_stays_open():
    response = asyncio.run(_tokenize(_images_body(), key_given=False))
    error = json.loads(b"".join(response.chunks))["error"]
    assert response.status == 401 and error["type"] == "AuthenticationError" and "images" in error["message"]
    assert asyncio.run(_tokenize(json.dumps({"prompt": "hi"}).encode(), key_given=False)).status == 200
    # With the key the image path goes on (here to the text-only model's 400, past authentication).
    assert asyncio.run(_tokenize(_images_body(), key_given=True)).status == 400


def _seen_by_the_handler(metadata: tuple) -> bool:
    seen = []

    async def behavior(request, context):
        seen.append(caller.api_key_given())
        return b""

    async def continuation(details):
        return grpc.unary_unary_rpc_method_handler(behavior)

    async def go():
        details = SimpleNamespace(method=TOKENIZE, invocation_metadata=metadata)
        handler = await ApiKeyInterceptor("s3cret").intercept_service(continuation, details)
        await handler.unary_unary(None, None)

    asyncio.run(go())
    return seen[0]


def test_the_interceptor_tells_the_tokenize_handler_whether_the_key_came():
    assert _seen_by_the_handler(()) is False
    assert _seen_by_the_handler((("authorization", "Bearer wrong"),)) is False
    assert _seen_by_the_handler((("authorization", "Bearer s3cret"),)) is True
    assert caller.api_key_given() is True  # outside a call (and without a key configured): open

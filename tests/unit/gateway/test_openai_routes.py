"""The OpenAI routes (services/gateway/routes.py) on a fake service, no server: statuses, error
shapes, SSE framing, in-band errors after a stream started."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from gridserve.services.gateway.api_errors import ApiError, to_api_error
from gridserve.services.gateway.limits import RequestLimits
from gridserve.services.gateway.media_loader import MediaLoader
from gridserve.services.gateway.responses import DONE
from gridserve.services.gateway.routes import OpenAIRoutes
from gridserve.services.gateway.service import SampleDelta, StreamChunk
from gridserve.shared.errors import EngineDeadError, InvalidArgumentError

DEFAULT = RequestLimits()


class _FakeTokenizer:
    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != 1)


class _FakeService:
    """Just enough of GatewayService: a stream that fails after its first chunk."""

    model_name = "m"
    max_model_len = 64

    def __init__(self, limits: RequestLimits = DEFAULT):
        self.tokenizer = _FakeTokenizer()
        self.input_processor = SimpleNamespace(vocab_size=128, multimodal=None)
        self.media = MediaLoader()
        self.limits = limits
        self.closed = 0
        self.templates: list = []

    async def run_blocking(self, fn, *args):
        return fn(*args)

    async def encode(self, text, add_special_tokens=True):
        return self.tokenizer.encode(text, add_special_tokens)

    async def decode(self, ids, skip_special_tokens=True):
        return self.tokenizer.decode(ids)

    async def chat_prompt(self, messages, template, add_generation_prompt, tools=None):
        self.templates.append(template)
        return {"prompt_token_ids": self.tokenizer.encode(messages[-1]["content"])}

    async def generate(self, prompt, params, request_id="", traceparent="", data_parallel_rank=None, timeout=None):
        try:
            yield StreamChunk("r", [SampleDelta(0, "a", [97])], 3)
            raise EngineDeadError("engine 127.0.0.1:1: UNAVAILABLE")
        finally:
            self.closed += 1


def _run(coro):
    return asyncio.run(coro)


async def _events(response) -> list:
    chunks = [c async for c in response.chunks]
    return [c.decode().removeprefix("data: ").strip() for c in chunks]


def _body(response) -> dict:
    return json.loads(b"".join(response.chunks))


def test_error_after_the_stream_started_is_sent_in_band_then_done():
    async def go():
        service = _FakeService()
        routes = OpenAIRoutes(service, "m")
        response = await routes.completions(json.dumps({"prompt": "hi", "stream": True}).encode())
        assert response.status == 200
        events = await _events(response)
        assert json.loads(events[0])["choices"][0]["text"] == "a"
        error = json.loads(events[1])["error"]
        assert error["code"] == 503 and "UNAVAILABLE" in error["message"]
        assert events[2:] == ["[DONE]"] and service.closed == 1
        response = await routes.chat_completions(json.dumps({"messages": [{"role": "user", "content": "x"}],
                                                             "stream": True}).encode())
        events = await _events(response)
        assert json.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert json.loads(events[1])["choices"][0]["delta"] == {"content": "a"}
        assert json.loads(events[-2])["error"]["type"] == "ServiceUnavailableError" and events[-1] == "[DONE]"

    _run(go())


def test_streamed_echo_of_a_token_id_prompt_is_its_text_and_usage_is_null_until_the_end():
    async def go():
        routes = OpenAIRoutes(_FakeService(), "m")
        body = {"prompt": [ord("h"), ord("i")], "stream": True, "echo": True,
                "stream_options": {"include_usage": True}}
        events = await _events(await routes.completions(json.dumps(body).encode()))
        first = json.loads(events[0])
        assert first["choices"][0]["text"] == "hia" and first["usage"] is None
        assert first["object"] == "text_completion" and first["id"] == "cmpl-r"

    _run(go())


def test_tokenize_and_detokenize_routes():
    async def go():
        routes = OpenAIRoutes(_FakeService(), "m")
        response = await routes.tokenize(b'{"prompt": "hi", "return_token_strs": true}')
        assert response.status == 200
        assert _body(response) == {"count": 3, "max_model_len": 64, "tokens": [1, 104, 105],
                                   "token_strs": ["", "h", "i"]}
        body = _body(await routes.tokenize(b'{"prompt": "hi", "add_special_tokens": false}'))
        assert body["tokens"] == [104, 105]
        assert _body(await routes.detokenize(b'{"tokens": [104, 105]}')) == {"prompt": "hi"}
        for route, data, param in [(routes.tokenize, b"{}", "prompt"),
                                   (routes.detokenize, b'{"tokens": [500]}', "tokens"),
                                   (routes.detokenize, b'{"tokens": "x"}', "tokens")]:
            response = await route(data)
            assert response.status == 400
            assert _body(response)["error"]["param"] == param
        assert (await routes.tokenize(b'{"prompt": "x", "model": "other"}')).status == 404

    _run(go())


def test_bad_bodies_are_400_in_openai_shape_before_any_event():
    async def go():
        routes = OpenAIRoutes(_FakeService(), "m")
        for data, param in [(b"{not json", None), (b"[1]", None),
                            (b'{"prompt": "x", "stream": true, "n": 0}', "n"),
                            (b'{"prompt": "x", "temperature": NaN}', "temperature"),
                            (b'{"messages": []}', "messages")]:
            route = routes.chat_completions if b"messages" in data else routes.completions
            response = await route(data)
            assert response.status == 400, data
            error = _body(response)["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error

    _run(go())


def test_a_request_chat_template_is_refused_without_the_trust_flag():
    async def go():
        body = json.dumps({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}).encode()
        service = _FakeService()
        response = await OpenAIRoutes(service, "m").chat_completions(body)
        assert response.status == 400 and _body(response)["error"]["param"] == "chat_template"
        response = await OpenAIRoutes(service, "m").tokenize(body)
        assert response.status == 400 and _body(response)["error"]["param"] == "chat_template"
        assert service.templates == []
        trusting = _FakeService(RequestLimits(trust_request_chat_template=True))
        response = await OpenAIRoutes(trusting, "m").tokenize(body)
        assert response.status == 200 and trusting.templates == ["{{ 1 }}"]

    _run(go())


def _image_chat(url: str = "data:image/png;base64,AAAA", image_first: bool = False) -> bytes:
    parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": parts[::-1] if image_first else parts}]
    return json.dumps({"messages": messages}).encode()


def test_an_image_part_for_a_text_only_model_is_400_naming_the_part():
    async def go():
        service = _FakeService()
        response = await OpenAIRoutes(service, "m").chat_completions(_image_chat())
        assert response.status == 400
        error = _body(response)["error"]
        assert error["param"] == "messages[1].content[1]" and "text only" in error["message"]
        response = await OpenAIRoutes(service, "m").tokenize(_image_chat(image_first=True))
        assert response.status == 400 and _body(response)["error"]["param"] == "messages[1].content[0]"

    _run(go())


def test_unknown_content_part_types_are_400_not_dropped():
    async def go():
        for part in ({"type": "input_audio", "input_audio": {"data": "x"}}, {"type": "image_url"},
                     {"type": "image_url", "image_url": {"url": ""}}):
            body = json.dumps({"messages": [{"role": "user", "content": [part]}]}).encode()
            response = await OpenAIRoutes(_FakeService(), "m").chat_completions(body)
            assert response.status == 400, part
            assert _body(response)["error"]["param"].startswith("messages"), part

    _run(go())


def test_openapi_document_lists_the_routes_and_their_schemas():
    async def go():
        response = await OpenAIRoutes(_FakeService(), "m", "1.0").openapi()
        doc = _body(response)
        assert doc["openapi"].startswith("3.1")
        assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models"} <= set(doc["paths"])
        schemas = doc["components"]["schemas"]
        assert {"CompletionRequest", "ChatCompletionRequest", "ErrorResponse"} <= set(schemas)
        assert "temperature" in schemas["CompletionRequest"]["properties"]
        ref = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert ref == {"$ref": "#/components/schemas/CompletionRequest"}

    _run(go())


def test_error_mapping():
    err = to_api_error(InvalidArgumentError("sampling_params.temperature", "must be >= 0"))
    assert (err.status, err.param) == (400, "temperature") and "temperature" in err.message
    assert to_api_error(EngineDeadError("down")).status == 503
    internal = to_api_error(ZeroDivisionError("x"), "req-1")
    assert internal.status == 500 and "req-1" in internal.message and internal.type == "InternalServerError"
    assert json.loads(ApiError(400, "m", "p").body()) == {"error": {"message": "m", "type": "BadRequestError",
                                                                    "param": "p", "code": 400}}
    assert DONE == b"data: [DONE]\n\n"

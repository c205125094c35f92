"""``GET /openapi.json``: the OpenAPI 3.1 document of the REST routes, generated from the
``protocol.py`` models (the same models that validate the bodies, so the two cannot drift)."""

from __future__ import annotations

import json
from typing import Any, Optional

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gridserve.services.gateway.pooling_protocol import (
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from gridserve.services.gateway.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoraAdapterRequest,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoraAdapterRequest,
    VersionResponse,
)
from gridserve.services.gateway.responses_protocol import (
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)

_REF = "#/components/schemas/{model}"

# path, method, summary, request model, response model, streamed event model
ROUTES: list[tuple[str, str, str, Optional[type[BaseModel]], Optional[type[BaseModel]], Optional[type[BaseModel]]]] = [
    ("/v1/completions", "post", "Create a completion", CompletionRequest, CompletionResponse, CompletionResponse),
    ("/v1/chat/completions", "post", "Create a chat completion", ChatCompletionRequest, ChatCompletionResponse,
     ChatCompletionChunk),
    ("/v1/responses", "post", "Create a response (the Responses API)", ResponsesRequest, ResponseObject,
     ResponseStreamEvent),
    ("/v1/responses/{response_id}", "get", "A stored response (--enable-responses-store)", None, ResponseObject,
     None),
    ("/v1/embeddings", "post", "Create embeddings (a pooling model)", EmbeddingRequest, EmbeddingResponse, None),
    *[(path, "post", "Score text pairs (a cross-encoder, or an embedding model's cosine similarity)",
       ScoreRequest, ScoreResponse, None) for path in ("/score", "/v1/score")],
    *[(path, "post", "Rerank documents by relevance to a query", RerankRequest, RerankResponse, None)
      for path in ("/rerank", "/v1/rerank", "/v2/rerank")],
    *[(path, "post", "Classify inputs (a sequence classifier)", ClassificationRequest, ClassificationResponse, None)
      for path in ("/classify", "/v1/classify")],
    ("/v1/models", "get", "List the served model and its LoRA adapters", None, ModelList, None),
    ("/v1/load_lora_adapter", "post", "Load a LoRA adapter on every engine (--api-key and the engines' "
     "--allow-runtime-lora-updating)", LoadLoraAdapterRequest, None, None),
    ("/v1/unload_lora_adapter", "post", "Unload a LoRA adapter from every engine", UnloadLoraAdapterRequest, None,
     None),
    ("/tokenize", "post", "Tokenize a prompt or a conversation", TokenizeRequest, TokenizeResponse, None),
    ("/detokenize", "post", "Token ids back to text", DetokenizeRequest, DetokenizeResponse, None),
    ("/version", "get", "The gridserve version", None, VersionResponse, None),
    ("/health", "get", "200 when an engine is ready, 503 otherwise", None, None, None),
]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _operation(summary: str, request: Optional[type[BaseModel]], response: Optional[type[BaseModel]],
               event: Optional[type[BaseModel]]) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": _ref(response)}} if response else {}
    lora = request is not None and request.__name__.endswith("LoraAdapterRequest")
    if lora:  # vLLM's plain-text answer
        content["text/plain"] = {"schema": {"type": "string"},
                                 "description": "Success: LoRA adapter '<name>' added (removed) successfully."}
    if event is not None:
        content["text/event-stream"] = {"schema": {"type": "string"},
                                        "description": f"`data: <{event.__name__}>` events, then `data: [DONE]`"}
    error = {"content": {"application/json": {"schema": _ref(ErrorResponse)}}}
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": {"description": "OK", **({"content": content} if content else {})},
                      "400": {"description": "Invalid request (the error names the field)", **error},
                      "500": {"description": "Internal error (with a request id)", **error}},
    }
    if request is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
        operation["responses"]["404"] = {"description": "Unknown model", **error}
    if lora:
        operation["responses"]["403"] = {"description": "Runtime loading is off (no --api-key, or the engines' "
                                                        "--allow-runtime-lora-updating or --enable-lora)", **error}
        operation["responses"]["404"] = {"description": "Unknown adapter (unload)", **error}
    return operation


def openapi_document(version: str) -> bytes:
    """The document, as JSON bytes."""
    models = {m for _, _, _, *ms in ROUTES for m in ms if m is not None} | {ErrorResponse}
    pairs = [(m, "validation" if m.__name__.endswith("Request") else "serialization")
             for m in sorted(models, key=lambda m: m.__name__)]
    _, definitions = models_json_schema(pairs, ref_template=_REF)
    paths: dict[str, Any] = {}
    for path, method, summary, request, response, event in ROUTES:
        paths.setdefault(path, {})[method] = _operation(summary, request, response, event)
    document = {
        "openapi": "3.1.0",
        "info": {"title": "gridserve OpenAI-compatible API", "version": version or "0"},
        "paths": paths,
        "components": {"schemas": definitions.get("$defs", {})},
    }
    return json.dumps(document, separators=(",", ":")).encode()

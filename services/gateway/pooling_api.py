"""The pooling endpoints: ``POST /v1/embeddings`` (OpenAI), ``/score`` and ``/v1/score`` (vLLM),
``/rerank``, ``/v1/rerank`` and ``/v2/rerank`` (Jina / Cohere), ``/classify`` and ``/v1/classify``
(vLLM), and the typed ``Embed`` / ``Score`` RPCs.

Every input (or text pair) is one engine request; a request's inputs are sent together (the engine
batches them) and bounded by ``--max-prompts-per-request`` (their count) and
``--max-prompt-tokens-per-request`` (their tokens together); each input by ``max_model_len`` unless
``truncate_prompt_tokens`` is given (``pooling.py``). Scores: a cross-encoder (the task ``score``)
scores each pair tokenized as a pair, with its head's activation (sigmoid for one label) unless
``activation`` / ``use_activation`` is false; an embedding model scores the cosine similarity of the
two texts' embeddings. Rerank is score with one query, sorted, best first.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, Optional, Union

from gridserve.services.gateway.pooling import (
    PoolingInput,
    check_total_tokens,
    cosine,
    pair_up,
    to_base64,
    tokenize_inputs,
    tokenize_pairs,
)
from gridserve.services.gateway.pooling_protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from gridserve.services.gateway.protocol import _as_prompts
from gridserve.services.gateway.routes import HttpResponse, OpenAIRoutes, answers_errors, log_user
from gridserve.services.gateway.service import PooledOutput, gather_or_cancel
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.pooling import CLASSIFY, EMBED, SCORE, PoolingParams

JSON = "application/json"


class PoolingAPI:
    """The pooling routes of one gateway, beside its ``OpenAIRoutes`` (whose service, model name
    and error handling they share)."""

    def __init__(self, routes: OpenAIRoutes) -> None:
        self.routes = routes
        self.service = routes.service

    # ---- the shared core (REST and gRPC) --------------------------------------------------------
    async def _check_model(self, requested: Optional[str], task: str) -> None:
        """The request's ``model`` names the served model (an adapter name: 400; another: 404), and
        the model serves ``task``."""
        if await self.routes.adapter_for(requested) is not None:
            raise InvalidArgumentError("model", "LoRA adapters serve generation only; name the base model")
        self.service.model_info.check_task(self.routes.model, task)

    async def tokenize(self, inputs: list[Union[str, list[int]]], add_special_tokens: bool,
                       truncate: Optional[int], field_name: str) -> list[PoolingInput]:
        service = self.service
        prompts = await service.run_blocking(tokenize_inputs, service.tokenizer, inputs, add_special_tokens,
                                             service.max_model_len, service.input_processor.vocab_size, truncate,
                                             field_name)
        check_total_tokens(prompts, service.limits.max_prompt_tokens_per_request, field_name)
        return prompts

    async def run(self, prompts: Sequence[PoolingInput], params: PoolingParams, traceparent: str = "",
                  timeout: Optional[float] = None) -> list[PooledOutput]:
        """Every prompt as one engine request, all at once (one failing cancels the others)."""
        return await gather_or_cancel(self.service.pool(p, params, "", traceparent, None, timeout) for p in prompts)

    async def embed(self, inputs: list[Union[str, list[int]]], *, dimensions: Optional[int] = None,
                    normalize: Optional[bool] = None, truncate: Optional[int] = None, add_special_tokens: bool = True,
                    model: Optional[str] = None, traceparent: str = "", timeout: Optional[float] = None,
                    field_name: str = "input") -> list[PooledOutput]:
        await self._check_model(model, EMBED)
        params = PoolingParams(task=EMBED, dimensions=dimensions, normalize=normalize)
        self.service.model_info.verify(params, {})
        prompts = await self.tokenize(inputs, add_special_tokens, truncate, field_name)
        return await self.run(prompts, params, traceparent, timeout)

    async def score(self, text_1: Union[str, list[str]], text_2: Union[str, list[str]], *,
                    activation: Optional[bool] = None, truncate: Optional[int] = None, model: Optional[str] = None,
                    traceparent: str = "", timeout: Optional[float] = None) -> tuple[list[float], int]:
        """Each pair's score (``pair_up``) and the prompt tokens it took."""
        info = self.service.model_info
        pairs = pair_up(text_1, text_2)
        if len(pairs) > self.service.limits.max_prompts_per_request:
            raise InvalidArgumentError("text_2", f"{len(pairs)} pairs; at most "
                                                 f"{self.service.limits.max_prompts_per_request} allowed "
                                                 "(--max-prompts-per-request)")
        if info.pooling and SCORE not in info.supported_tasks and EMBED in info.supported_tasks:
            return await self._embedding_score(pairs, activation, truncate, model, traceparent, timeout)
        await self._check_model(model, SCORE)
        params = PoolingParams(task=SCORE, activation=activation)
        info.verify(params, {"activation": "activation"})
        service = self.service
        prompts = await service.run_blocking(tokenize_pairs, service.tokenizer, pairs, service.max_model_len,
                                             truncate, "text_2")
        check_total_tokens(prompts, service.limits.max_prompt_tokens_per_request, "text_2")
        outs = await self.run(prompts, params, traceparent, timeout)
        return [out.values[0] for out in outs], sum(out.num_prompt_tokens for out in outs)

    async def _embedding_score(self, pairs: list[tuple[str, str]], activation: Optional[bool],
                               truncate: Optional[int], model: Optional[str], traceparent: str,
                               timeout: Optional[float]) -> tuple[list[float], int]:
        """An embedding model's scores: the cosine similarity of each pair's embeddings (each distinct
        text embedded once)."""
        if activation is not None:
            raise InvalidArgumentError("activation", "applies to a cross-encoder's scores; this model scores by the "
                                                     "cosine similarity of embeddings")
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        outs = await self.embed(texts, truncate=truncate, model=model, traceparent=traceparent, timeout=timeout,
                                field_name="text_2")
        vectors = {t: out.values for t, out in zip(texts, outs)}
        return [cosine(vectors[a], vectors[b]) for a, b in pairs], sum(out.num_prompt_tokens for out in outs)

    async def classify(self, inputs: list[Union[str, list[int]]], *, activation: Optional[bool] = None,
                       truncate: Optional[int] = None, add_special_tokens: bool = True, model: Optional[str] = None,
                       traceparent: str = "", timeout: Optional[float] = None) -> list[PooledOutput]:
        await self._check_model(model, CLASSIFY)
        params = PoolingParams(task=CLASSIFY, activation=activation)
        self.service.model_info.verify(params, {"activation": "activation"})
        prompts = await self.tokenize(inputs, add_special_tokens, truncate, "input")
        return await self.run(prompts, params, traceparent, timeout)

    # ---- REST --------------------------------------------------------------------------------------
    @answers_errors
    async def embeddings(self, data: bytes, traceparent: str = "", timeout: Optional[float] = None) -> HttpResponse:
        request = self.routes.parse_body(EmbeddingRequest, data)
        outs = await self.embed(_as_prompts(request.input), dimensions=request.dimensions,
                                normalize=request.normalize, truncate=request.truncate_prompt_tokens,
                                add_special_tokens=request.add_special_tokens, model=request.model,
                                traceparent=traceparent, timeout=timeout)
        _log_user(request.user, outs)
        b64 = request.encoding_format == "base64"
        data_out = [EmbeddingData(index=i, embedding=to_base64(out.values) if b64 else out.values)
                    for i, out in enumerate(outs)]
        tokens = sum(out.num_prompt_tokens for out in outs)
        response = EmbeddingResponse(id=f"embd-{_id(outs)}", created=int(time.time()), model=self.routes.model,
                                     data=data_out, usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))
        return self._ok(response)

    @answers_errors
    async def score_route(self, data: bytes, traceparent: str = "", timeout: Optional[float] = None) -> HttpResponse:
        request = self.routes.parse_body(ScoreRequest, data)
        scores, tokens = await self.score(request.text_1, request.text_2, activation=request.wants_activation(),
                                          truncate=request.truncate_prompt_tokens, model=request.model,
                                          traceparent=traceparent, timeout=timeout)
        response = ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=self.routes.model,
                                 data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                                 usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))
        return self._ok(response)

    @answers_errors
    async def rerank(self, data: bytes, traceparent: str = "", timeout: Optional[float] = None) -> HttpResponse:
        request = self.routes.parse_body(RerankRequest, data)
        documents = request.document_texts()
        scores, tokens = await self.score(request.query, documents, activation=request.wants_activation(),
                                          truncate=request.truncate_prompt_tokens, model=request.model,
                                          traceparent=traceparent, timeout=timeout)
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        if request.top_n:
            order = order[:request.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                **({"document": RerankDocument(text=documents[i])} if request.return_documents else {}))
                   for i in order]
        response = RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=self.routes.model,
                                  usage=RerankUsage(total_tokens=tokens), results=results)
        return self._ok(response)

    @answers_errors
    async def classify_route(self, data: bytes, traceparent: str = "", timeout: Optional[float] = None) -> HttpResponse:
        request = self.routes.parse_body(ClassificationRequest, data)
        outs = await self.classify(_as_prompts(request.input), activation=request.wants_activation(),
                                   truncate=request.truncate_prompt_tokens,
                                   add_special_tokens=request.add_special_tokens, model=request.model,
                                   traceparent=traceparent, timeout=timeout)
        _log_user(request.user, outs)
        labels = self.service.model_info.labels()
        data_out = []
        for i, out in enumerate(outs):
            best = max(range(len(out.values)), key=out.values.__getitem__) if out.values else None
            label = None if best is None else labels.get(best, f"LABEL_{best}")
            data_out.append(ClassificationData(index=i, label=label, probs=out.values, num_classes=len(out.values)))
        tokens = sum(out.num_prompt_tokens for out in outs)
        response = ClassificationResponse(id=f"classify-{_id(outs)}", created=int(time.time()),
                                          model=self.routes.model, data=data_out,
                                          usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))
        return self._ok(response)

    def _ok(self, response: Any) -> HttpResponse:
        return HttpResponse(200, JSON, [response.dumps()])


def _id(outs: list[PooledOutput]) -> str:
    return outs[0].request_id if outs else uuid.uuid4().hex


def _log_user(user: Optional[str], outs: list[PooledOutput]) -> None:
    if outs:
        log_user(user, outs[0].request_id)

"""The pooling endpoints' bodies (``POST /v1/embeddings``, ``/score``, ``/rerank``, ``/classify``), declared
as ``protocol.py`` declares the generation ones: strict types, caps from ``RequestLimits``, unknown
top-level fields refused naming them. Shapes are OpenAI's (embeddings), vLLM's (score, classify) and
Jina's / Cohere's (rerank), with vLLM's extensions (``truncate_prompt_tokens``, ``normalize``,
``activation`` / ``use_activation``, ``add_special_tokens``).
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import MISSING, AfterValidator, ConfigDict, Field, ValidationInfo

from gridserve.services.gateway.protocol import (
    INT32_MAX,
    ClosedModel,
    OpenAIBaseModel,
    PromptType,
    ResponseModel,
    _check_prompt,
    limits_of,
)
from gridserve.shared.errors import InvalidArgumentError


def _truncation(value: Optional[int]) -> Optional[int]:
    if value is not None and value == 0:
        raise ValueError("must be -1 (max_model_len) or a positive number of tokens")
    return value


# vLLM's ``truncate_prompt_tokens``: keep the last n tokens of each input (-1: max_model_len)
Truncation = Annotated[Optional[Annotated[int, Field(ge=-1, le=INT32_MAX)]], AfterValidator(_truncation)]
Inputs = Annotated[PromptType, AfterValidator(_check_prompt)]


def _texts(value: Union[str, list[str]], info: ValidationInfo) -> Union[str, list[str]]:
    """One text or a non-empty list, within the prompt count and length caps."""
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise ValueError("expected a string or a non-empty list of strings")
    limits = limits_of(info)
    if len(texts) > limits.max_prompts_per_request:
        raise ValueError(f"at most {limits.max_prompts_per_request} texts allowed (--max-prompts-per-request), "
                         f"got {len(texts)}")
    longest = max(len(t) for t in texts)
    if longest > limits.max_content_chars:
        raise ValueError(f"a text of {longest} characters; at most {limits.max_content_chars} allowed "
                         "(--max-content-chars)")
    return value


Texts = Annotated[Union[str, list[str]], AfterValidator(_texts)]


class ActivationFields(OpenAIBaseModel):
    """A classifier's activation switch, under vLLM's two names (``use_activation`` is the newer)."""

    activation: Optional[bool] = None
    use_activation: Optional[bool] = None

    def wants_activation(self) -> Optional[bool]:
        if self.activation is not None and self.use_activation is not None and self.activation != self.use_activation:
            raise InvalidArgumentError("use_activation", "activation and use_activation disagree; send one")
        return self.use_activation if self.use_activation is not None else self.activation


# ---- requests --------------------------------------------------------------------------------
class EmbeddingRequest(ClosedModel):
    """OpenAI's ``POST /v1/embeddings``: one embedding per input (a string, strings, token ids or
    lists of token ids)."""

    model: Optional[str] = None
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[Annotated[int, Field(ge=1, le=INT32_MAX)]] = None
    user: Optional[str] = None  # who asks: logged with the request id
    truncate_prompt_tokens: Truncation = None
    normalize: Optional[bool] = None
    add_special_tokens: bool = True


class ScoreTexts(OpenAIBaseModel):
    """The typed ``Score`` RPC's texts, with the REST route's checks."""

    text_1: Texts
    text_2: Texts


class ScoreRequest(ClosedModel, ActivationFields):
    """vLLM's ``POST /score``: ``text_1`` and ``text_2`` pair up 1:1, 1:N (one ``text_1``) or N:N."""

    model_config = ConfigDict(extra="forbid")  # ClosedModel's (the mixin's would win)

    model: Optional[str] = None
    text_1: Texts
    text_2: Texts
    truncate_prompt_tokens: Truncation = None
    user: Optional[str] = None


class RerankDocumentIn(OpenAIBaseModel):
    """A document given as an object (Jina's ``{"text": ...}``; other keys are ignored)."""

    text: str


class RerankRequest(ClosedModel, ActivationFields):
    """Jina's / Cohere's ``POST /rerank``: the ``documents`` by relevance to ``query``, best first;
    ``top_n`` (0 or unset: all) of them."""

    model_config = ConfigDict(extra="forbid")  # ClosedModel's (the mixin's would win)

    model: Optional[str] = None
    query: Annotated[str, AfterValidator(_texts)]
    documents: Annotated[list[Union[str, RerankDocumentIn]], Field(min_length=1)]
    top_n: Optional[Annotated[int, Field(ge=0, le=INT32_MAX)]] = None
    return_documents: bool = True
    truncate_prompt_tokens: Truncation = None
    user: Optional[str] = None

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ClassificationRequest(ClosedModel, ActivationFields):
    """vLLM's ``POST /classify``: each input's class probabilities and label."""

    model_config = ConfigDict(extra="forbid")  # ClosedModel's (the mixin's would win)

    model: Optional[str] = None
    input: Inputs
    truncate_prompt_tokens: Truncation = None
    add_special_tokens: bool = True
    user: Optional[str] = None


# ---- responses -------------------------------------------------------------------------------
class PoolingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(ResponseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]  # floats, or base64 of little-endian float32 bytes


class EmbeddingResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreData(ResponseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(ResponseModel):
    text: str


class RerankResult(ResponseModel):
    index: int
    document: Union[RerankDocument, MISSING] = MISSING  # with return_documents (the default)
    relevance_score: float


class RerankUsage(ResponseModel):
    total_tokens: int


class RerankResponse(ResponseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassificationData(ResponseModel):
    index: int
    label: Optional[str]
    probs: list[float]
    num_classes: int


class ClassificationResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage

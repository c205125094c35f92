"""Per-request results: the engine's per-step output and the user-facing ``RequestOutput``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Union

from gridserve.shared.kv_transfer import KVTransferParams


class FinishReason(str, enum.Enum):
    """Why a request stopped, with OpenAI's / vLLM's spelling."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # the request failed on its own (``EngineCoreOutput.error`` says why)


@dataclass
class EngineCoreOutput:
    """New tokens of one request in one engine step (batched per step by the engine)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list = field(default_factory=list)  # list[TokenLogprobs], one per new token
    # Prompt logprobs for the prompt positions computed in this step (chunked prefill: in pieces).
    new_prompt_logprobs: list = field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    stop_reason: Union[int, str, None] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None  # with ``FinishReason.ERROR``: why the request failed
    # A pooling request's result: its embedding or its classifier's scores (float32 values).
    pooler_output: Optional[list[float]] = None
    # Disaggregated serving, a producer's final output of a prefilled request: where its KV waits.
    kv_transfer_params: Optional[KVTransferParams] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Logprob:
    """One candidate token at a position, as vLLM reports it."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[SampleLogprobs]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one request, with vLLM's field names."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: Optional[list] = None
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    """A pooling request's embedding (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """A classifier's class probabilities (or raw logits with ``activation=False``)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """One pair's similarity or relevance score."""

    score: float


@dataclass
class PoolingRequestOutput:
    """The result of one pooling request (``LLM.embed`` / ``classify`` / ``score``), vLLM's fields:
    ``outputs`` is an ``EmbeddingOutput``, ``ClassificationOutput`` or ``ScoringOutput``."""

    request_id: str
    outputs: Union[EmbeddingOutput, ClassificationOutput, ScoringOutput]
    prompt_token_ids: list[int]
    finished: bool = True

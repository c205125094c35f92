"""The data that crosses the engine <-> worker boundary each step.

The engine's scheduler produces a ``SchedulerOutput`` (which requests run this step, how many of
their tokens, in which KV blocks); the worker answers with a ``ModelRunnerOutput`` (the token each
request sampled, with logprobs when asked). Plain Python values only: these are serialised to
protobuf between processes and must never carry tensors or callables (an image's pixels travel
as raw float32 bytes, packed into a typed ``common.v1.Tensor`` on the wire).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from gridserve.shared.kv_transfer import KVSend, KVTransferParams
from gridserve.shared.lora import LoRARequest
from gridserve.shared.multimodal import ImageFeature
from gridserve.shared.pooling import PoolingParams
from gridserve.shared.sampling_params import SamplingParams


def per_group(block_ids) -> tuple[list[int], ...]:
    """Block ids as one list per KV cache group; a flat list is the only group's."""
    if isinstance(block_ids, tuple):
        return block_ids
    block_ids = list(block_ids)
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return tuple(list(ids) for ids in block_ids)
    return (block_ids,)


@dataclass
class NewRequestData:
    """A request the worker has not seen (or must rebuild after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # The request's blocks per KV cache group (``block_ids[g]``, in token order; 0 where a window
    # group freed one). A flat list is taken as the only group's.
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    # Non-empty when a preempted request resumes: its earlier output is recomputed as prompt.
    output_token_ids: list[int] = field(default_factory=list)
    # W3C traceparent of the engine's span of the request ("" when tracing is off).
    traceparent: str = ""
    # The prompt's images: pixels for the vision encoder and the positions their embeddings fill.
    mm_features: list[ImageFeature] = field(default_factory=list)
    # The LoRA adapter it runs on (None: the base model); the worker loads it on first use.
    lora_request: Optional[LoRARequest] = None
    # A pooling request (a pooling model): what it asks, and its tokens' segment ids (None: all 0).
    pooling_params: Optional[PoolingParams] = None
    token_type_ids: Optional[list[int]] = None
    # Disaggregated serving (a consumer): the producer's blocks to pull into the first blocks before
    # the step (``num_computed_tokens`` already counts their tokens).
    kv_load: Optional[KVTransferParams] = None

    def __post_init__(self) -> None:
        self.block_ids = per_group(self.block_ids)


@dataclass
class CachedRequestData:
    """A request already held by the worker: only what changed since the last step."""

    req_id: str
    new_block_ids: tuple[list[int], ...]  # blocks appended per KV cache group (a flat list: the only group's)
    num_computed_tokens: int
    # Tokens sampled since the worker last saw the request; sent only with pipeline parallelism
    # (the last stage samples, every stage needs them). Otherwise the worker appends its own samples.
    new_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.new_block_ids = per_group(self.new_block_ids)


@dataclass
class SchedulerOutput:
    """One forward pass: every scheduled request and the number of tokens it advances."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests finished, aborted or preempted since the last step: the worker drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding: draft tokens to verify after a request's next token (they count in
    # ``num_scheduled_tokens``: 1 + len(drafts)).
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Disaggregated serving (a producer): transfers the worker serves from now on, and the ones it
    # stops serving before this step writes any block.
    kv_sends: list[KVSend] = field(default_factory=list)
    kv_releases: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class TokenLogprobs:
    """Logprobs at one generated position: the sampled token first, then the top-N."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


@dataclass
class ModelRunnerOutput:
    """What a step produced: one sampled token per request that reached the end of its tokens.

    Requests still in the middle of a chunked prefill are absent from ``req_ids``.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Optional[TokenLogprobs]] = field(default_factory=list)
    # Prompt logprobs of the prompt positions computed this step, for requests that asked.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Requests that failed on their own in the worker (request id -> error): the engine ends each
    # one with finish reason ``error``; the rest of the batch is unaffected.
    failed: dict[str, str] = field(default_factory=dict)
    # Speculative decoding: the tokens a request got after its first one this step (the accepted
    # drafts' run, each the target's own sample), with their logprobs when asked...
    extra_token_ids: dict[str, list[int]] = field(default_factory=dict)
    extra_logprobs: dict[str, list[Optional[TokenLogprobs]]] = field(default_factory=dict)
    # ... and the drafts proposed for the request's next step.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Pooling requests' results (an embedding or a classifier's scores, float32), by request id.
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # Disaggregated serving: transfers fully pulled from this worker since the last step; requests
    # whose pull failed (left out of the step: the engine computes their prompt); bytes moved.
    kv_sent: list[str] = field(default_factory=list)
    kv_load_failed: dict[str, str] = field(default_factory=dict)
    kv_bytes_received: int = 0
    kv_bytes_sent: int = 0

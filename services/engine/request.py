"""The engine's view of one request: its tokens, progress, status and prefix-cache hashes."""

from __future__ import annotations

import enum
import time
from typing import Optional, Union

from gridserve.shared.kv_transfer import KVTransferParams
from gridserve.shared.lora import LoRARequest
from gridserve.shared.multimodal import ImageFeature
from gridserve.shared.outputs import FinishReason
from gridserve.shared.pooling import PoolingParams
from gridserve.shared.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # failed on its own in the worker (``Request.error`` says why)

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> Optional[FinishReason]:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """A request inside the engine.

    ``num_computed_tokens`` counts tokens whose KV is in the cache; each step the scheduler lets it
    catch up with ``num_tokens`` (prompt + output) under the token budget. ``block_hashes`` holds
    the prefix-cache hash of every *full* block of ``all_token_ids``, kept by the KV-cache manager.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: Optional[int] = None,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
        parent_request_id: Optional[str] = None,
        admit_always: bool = False,
        mm_features: Optional[list[ImageFeature]] = None,
        output_token_ids: Optional[list[int]] = None,
        lora_request: Optional[LoRARequest] = None,
        pooling_params: Optional[PoolingParams] = None,
        token_type_ids: Optional[list[int]] = None,
        priority: int = 0,
        kv_transfer_params: Optional[KVTransferParams] = None,
        prefill_only: bool = False,
    ) -> None:
        self.request_id = request_id
        # The id the client sees (the gateway's request id): logs and spans name the request by it.
        self.parent_request_id = parent_request_id or request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        # A continuation (a request resubmitted after its engine died): never refused by admission
        # control (``max_waiting_requests``) and queued ahead of new requests.
        self.admit_always = admit_always
        # Images in the prompt (pixels and token positions), in prompt order; empty for text.
        self.mm_features: list[ImageFeature] = list(mm_features or [])
        # A continuation (failover from a dead engine) arrives with the tokens already generated.
        self.output_token_ids: list[int] = list(output_token_ids or [])
        self.all_token_ids: list[int] = [*prompt_token_ids, *self.output_token_ids]
        # The LoRA adapter it runs on (None: the base model); resolved by the engine's table.
        self.lora_request = lora_request
        # A pooling request: its prompt runs once, whole, and it ends with its pooler output.
        self.pooling_params = pooling_params
        self.token_type_ids = token_type_ids
        # Its rank under --scheduling-policy priority: lower runs first (fcfs: always 0).
        self.priority = priority
        # Disaggregated serving: a consumer's producer blocks to pull instead of computing the prompt
        # (None once pulled, or after a failed pull: then the prompt is computed here) ...
        self.kv_load = kv_transfer_params
        # ... and a producer's request that runs its prompt only (one token) and keeps its blocks for a
        # consumer; ``kv_hold`` once it stopped for that, not by a stop rule of its own.
        self.prefill_only = prefill_only
        self.kv_hold = False
        self.kv_transfer_out: Optional[KVTransferParams] = None  # a held request's params (its final output)
        self.num_computed_tokens = 0
        # Tokens a step still in flight will sample: the next step may already compute them (the
        # worker holds their value), so the scheduler counts them as known but not yet here.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache, set once
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: Union[int, str, None] = None
        self.error: Optional[str] = None  # why it failed (status FINISHED_ERROR)
        self.block_hashes: list[bytes] = []
        # Speculative decoding: the drafts the worker proposed after this request's last token.
        self.spec_token_ids: list[int] = []
        # Timeline (time.monotonic()) for metrics, logs and traces; None until it happens.
        self.scheduled_time: Optional[float] = None  # first admitted to the running batch
        self.first_token_time: Optional[float] = None
        self.finished_time: Optional[float] = None
        # W3C traceparent of the engine's span of this request ("" when tracing is off); the
        # workers parent their spans of the request to it.
        self.traceparent = ""
        self.span: object = None  # the open engine span (tracing on), ended when the request finishes

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

"""The scheduler: decides, each step, which requests run and how many of their tokens.

There are no separate prefill and decode phases. Every request has ``num_computed_tokens`` (KV
already in the cache) and ``num_tokens`` (prompt + output so far); each step lets requests catch
up under a token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``). A long
prompt is therefore prefilled in chunks, interleaved with other requests' decodes. Running
requests go first, then waiting ones, each in the order of the ``SchedulingPolicy``
(``scheduling_policy.py``: FCFS, or by priority). When the KV cache runs out of blocks, the running
batch's last request (FCFS: the most recently admitted; priority: the worst) is preempted: its
blocks are freed and it rejoins the queue, to be recomputed later (its prefix may still hit the
cache). Under the priority policy a waiting request that finds no slot (``max_num_seqs``) or too few
blocks preempts the worst running request if that one is strictly worse; what the victim had
scheduled in this step is taken back.

Speculative decoding (``speculative_config``): a decoding request whose worker proposed drafts
runs its next token and the drafts in one step (``scheduled_spec_tokens``, within the token
budget, ``max_tokens`` and ``max_model_len``); the worker answers with the target's own samples up
to the first that differs from a draft. ``update_from_output`` appends them one by one (a stop
ends the run there), rolls ``num_computed_tokens`` back by the rejected drafts and gives their
blocks back. No drafts while ``disable_by_batch_size`` requests or more run. With a draft model
every allocation reserves ``k`` lookahead slots past the step's tokens, where the worker's draft
writes the K / V of the tokens it proposes from (never cached; trimmed with the rejected drafts).

Multi-LoRA: the running requests use at most ``max_loras`` distinct adapters; a waiting request on
another adapter is passed over (it keeps its place) until one of them drains.

Disaggregated prefill / decode (``--kv-role``, ``kv_transfers.py``): a producer's prefill-only
request ends after its first token and keeps its blocks, of every KV cache group, for a consumer
(an abort of it releases them at once); a consumer's request with ``kv_load`` is admitted with its
prompt counted as computed (pulled by the worker before the step, kept out of the prefix cache
until confirmed) and goes back to the queue to compute its prompt when the pull fails or the
producer's plan has other KV cache groups than this engine's.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Optional

from gridserve.services.engine.kv_cache_manager import KVCacheManager
from gridserve.services.engine.kv_transfers import KVTransfers
from gridserve.services.engine.request import Request, RequestStatus
from gridserve.services.engine.scheduling_policy import make_policy
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ResourceExhaustedError
from gridserve.shared.load import EngineLoad
from gridserve.shared.outputs import EngineCoreOutput, FinishReason
from gridserve.shared.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)

# Waiting requests a step may pass over (their adapter would exceed max_loras) before it stops looking.
_MAX_PASSED_OVER = 256


@dataclass
class SpecDecodeStats:
    """Speculative decoding's counters since start (vLLM's ``vllm:spec_decode_*``)."""

    num_speculative_tokens: int
    num_drafts: int = 0  # steps that verified drafts, per request
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted at draft position i

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


@dataclass
class StepStats:
    """What the steps since the last ``take_step_stats()`` did (metrics, request log lines, spans).
    Collected only once someone asks (the engine loop does; the offline engine does not)."""

    iteration_tokens: list[int] = field(default_factory=list)  # tokens scheduled per step
    finished: list[Request] = field(default_factory=list)


class Scheduler:
    """Continuous-batching scheduler with chunked prefill and preemption by recompute."""

    def __init__(self, config: GridserveConfig, kv_cache_manager: KVCacheManager) -> None:
        self.kv = kv_cache_manager
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens or 2048
        self.chunked_prefill = config.scheduler.enable_chunked_prefill
        self.max_model_len = config.max_model_len
        self.max_waiting_requests = config.scheduler.waiting_limit
        self.policy = make_policy(config.scheduler.scheduling_policy)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the worker should forget at the next step (finished, aborted or preempted).
        self._forget: set[str] = set()
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.step_stats: StepStats | None = None  # collected from the first take_step_stats()
        # With pipeline parallelism the last stage samples while earlier stages already run the next
        # batch, so a request is not scheduled again until its sample is back, and the engine sends
        # every stage the tokens it has not seen (request id -> tokens the workers hold).
        self.pipelined = config.parallel.pipeline_parallel_size > 1
        self._worker_tokens: dict[str, int] = {}
        self.spec = config.scheduler.speculative
        # Multi-LoRA: at most this many distinct adapters among the running requests (None: off).
        self.max_loras = config.lora.max_loras if config.lora.enable_lora else None
        self.spec_stats = SpecDecodeStats(self.spec.num_speculative_tokens if self.spec else 0)
        # Disaggregated prefill / decode (--kv-role): a producer's held transfers, both sides' counters.
        self.transfers = KVTransfers(config, self.kv.windows) if config.cache.kv_role else None
        self.num_lookahead = self.spec.num_lookahead_tokens if self.spec else 0

    # ---- admission and removal ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine")
        self.policy.check(request)
        if request.admit_always:
            self.requests[request.request_id] = request
            self.policy.queue_continuation(self.waiting, request)
            return
        if len(self.waiting) >= self.max_waiting_requests:
            raise ResourceExhaustedError(
                f"the engine's waiting queue is full ({len(self.waiting)} of --max-waiting-requests "
                f"{self.max_waiting_requests})")
        self.requests[request.request_id] = request
        self.policy.queue(self.waiting, request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Abort requests that are still alive; unknown or finished ids are ignored (idempotent). A
        producer's finished request whose blocks wait for a consumer releases them (P/D)."""
        request_ids = list(request_ids)
        if self.transfers is not None and self.transfers.held:
            self._free_transfers(self.transfers.release(list(request_ids)))
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            self._remove_from_queue(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            aborted.append(request_id)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def speculating(self) -> bool:
        """Whether the next step may verify drafts (a running request has some, and fewer than
        ``disable_by_batch_size`` run): the engine then runs it alone, no step in flight beside it,
        since its tokens are known only once it returns. Without drafts, steps overlap as usual."""
        return (self.spec is not None and 0 < len(self.running) < self.spec.disable_by_batch_size
                and any(r.spec_token_ids for r in self.running))

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        out = SchedulerOutput()
        self._speculate = self.speculating
        preempted = self._schedule_running(out, budget)
        budget -= out.total_num_scheduled_tokens
        if not preempted:
            self._schedule_waiting(out, budget)
        out.finished_req_ids = self._forget
        self._forget = set()
        if self.transfers is not None:  # P/D: expired transfers freed; workers told of sends / releases
            self._free_transfers(self.transfers.expire())
            self.transfers.fill(out)
        if self.step_stats is not None and out.total_num_scheduled_tokens:
            self.step_stats.iteration_tokens.append(out.total_num_scheduled_tokens)
        for request_id, n in out.num_scheduled_tokens.items():
            request = self.requests[request_id]
            request.num_computed_tokens += n
            if request.pooling_params is not None:
                continue  # pooled, not sampled: it ends with this step
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1  # this step samples its next token
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> bool:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.pooling_params is not None:  # ran whole when admitted; its output is on the way
                i += 1
                continue
            n = min(self._tokens_to_schedule(request), budget)
            if n <= 0:  # its last token is still being sampled by the step in flight
                i += 1
                continue
            drafts = self._drafts(request, n, budget)
            n += len(drafts)
            lookahead = self._lookahead(request.num_computed_tokens + n)
            new_blocks = self.kv.allocate_slots(request, n, num_lookahead_tokens=lookahead)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_blocks = self.kv.allocate_slots(request, n, num_lookahead_tokens=lookahead)
            if new_blocks is None:
                break
            out.scheduled_cached_reqs.append(
                CachedRequestData(request.request_id, new_blocks, request.num_computed_tokens,
                                  self._unsent_tokens(request))
            )
            if drafts:
                out.scheduled_spec_tokens[request.request_id] = drafts
            self._record(out, request, n)
            budget -= n
            i += 1
        return preempted

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in order while the budget, the sequence cap and the KV cache allow.
        With LoRA a request whose adapter would be one too many (``max_loras``) is passed over, not
        waited on: requests behind it on adapters already running (or the base model) go first."""
        loras = None if self.max_loras is None else self.running_loras()
        passed_over: list[Request] = []
        try:
            self._admit_waiting(out, budget, loras, passed_over)
        finally:
            self.waiting.extendleft(reversed(passed_over))  # back at the head, in their order

    def running_loras(self) -> set[int]:
        """The ids of the adapters the running requests use."""
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _admit_waiting(self, out: SchedulerOutput, budget: int, loras: Optional[set[int]],
                       passed_over: list[Request]) -> None:
        while self.waiting and budget > 0:
            if len(self.running) >= self.max_num_seqs and not self.policy.preemptive:
                break
            request = self.waiting[0]
            if self.pipelined and request.num_output_placeholders:
                break  # preempted while its sample is still in the pipeline: resume once it is back
            if request.request_id in self._forget:
                break  # preempted while this step was planned: it may resume from the next one
            if request.pooling_params is not None:
                if request.num_tokens > budget or len(self.running) >= self.max_num_seqs:
                    break  # a pooling input runs whole, in one step: it waits for a step with room
                self._admit_pooling(out, request)
                budget -= request.num_tokens
                continue
            lora = request.lora_request
            if loras is not None and lora is not None and lora.lora_int_id not in loras:
                if len(loras) >= self.max_loras:
                    if len(passed_over) >= _MAX_PASSED_OVER:
                        break  # bounded work per step: the rest wait for the next one
                    passed_over.append(self.waiting.popleft())
                    continue
            if len(self.running) >= self.max_num_seqs:  # the priority policy: take a worse one's slot
                freed = self._preempt_for(request, out, loras)
                if freed is None:
                    break
                budget += freed
            pulled = self._pulled_tokens(request)  # P/D: the prompt's KV comes from a producer
            if pulled:
                hit_blocks, num_hit = None, pulled
            elif request.sampling_params.prompt_logprobs is None:
                hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            else:  # every prompt position must be computed to report its logprob
                hit_blocks, num_hit = [], 0
            n = request.num_tokens - num_hit
            if n > budget and not self.chunked_prefill:
                break
            n = min(n, budget)
            lookahead = self._lookahead(num_hit + n)
            while self.kv.allocate_slots(request, n, hit_blocks, num_hit, lookahead) is None:
                freed = self._preempt_for(request, out, loras)  # the priority policy: a worse one's blocks
                if freed is None:
                    return
                budget += freed
            self.waiting.popleft()
            self.policy.run(self.running, request)
            if loras is not None and lora is not None:
                loras.add(lora.lora_int_id)
            if self.pipelined:
                self._worker_tokens[request.request_id] = request.num_tokens
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.scheduled_time is None:
                request.scheduled_time = time.monotonic()
            if request.num_cached_tokens < 0:  # prompt tokens (a continuation may hit its output too)
                request.num_cached_tokens = min(num_hit, request.num_prompt_tokens)
            out.scheduled_new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params,
                    block_ids=self.kv.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit,
                    output_token_ids=list(request.output_token_ids),
                    traceparent=request.traceparent,
                    mm_features=request.mm_features,
                    lora_request=request.lora_request,
                    kv_load=request.kv_load if pulled else None,
                )
            )
            self._record(out, request, n)
            budget -= n

    def _admit_pooling(self, out: SchedulerOutput, request: Request) -> None:
        """A pooling request runs its whole prompt in this step, with no KV blocks (nothing of it is
        kept after) and no prefix cache; it finishes when the step's pooler output comes back."""
        self.waiting.popleft()
        self.policy.run(self.running, request)
        request.status = RequestStatus.RUNNING
        if request.scheduled_time is None:
            request.scheduled_time = time.monotonic()
        request.num_cached_tokens = 0
        out.scheduled_new_reqs.append(NewRequestData(
            req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params, block_ids=([],), num_computed_tokens=0,
            traceparent=request.traceparent, pooling_params=request.pooling_params,
            token_type_ids=request.token_type_ids))
        self._record(out, request, request.num_tokens)

    def _drafts(self, request: Request, n: int, budget: int) -> list[int]:
        """The drafts to verify with a decoding request's next token this step (none while
        speculation is off, mid-prefill, or past the budget, ``max_tokens`` or ``max_model_len``).
        A request's drafts are used once."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts or not self._speculate or n != 1 or request.num_output_placeholders:
            return []
        room = min(budget - n, self.max_model_len - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return drafts[:max(room, 0)]

    def _lookahead(self, end: int) -> int:
        """Slots past a step's tokens (which end at position ``end``) for a draft model's proposals
        (the bonus token and ``k - 1`` drafts), within ``max_model_len``; 0 without a draft model."""
        return max(0, min(self.num_lookahead, self.max_model_len - end))

    def _tokens_to_schedule(self, request: Request) -> int:
        """Tokens whose KV is not computed yet, counting the in-flight step's sample.

        A request that will have reached ``max_tokens`` or ``max_model_len`` once the in-flight
        sample lands gets nothing more.
        """
        pending = request.num_output_placeholders
        if pending and self.pipelined:
            return 0  # its sample is still in the pipeline; the first stage does not have it yet
        if pending:
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None and request.num_output_tokens + pending >= max_tokens:
                return 0
            if request.num_tokens + pending >= self.max_model_len:
                return 0
        return request.num_tokens + pending - request.num_computed_tokens

    def _unsent_tokens(self, request: Request) -> list[int]:
        if not self.pipelined:
            return []
        sent = self._worker_tokens.get(request.request_id, request.num_tokens)
        self._worker_tokens[request.request_id] = request.num_tokens
        return request.all_token_ids[sent:]

    @staticmethod
    def _record(out: SchedulerOutput, request: Request, n: int) -> None:
        out.num_scheduled_tokens[request.request_id] = n
        out.total_num_scheduled_tokens += n

    def _preempt_for(self, request: Request, out: SchedulerOutput, loras: Optional[set[int]]) -> Optional[int]:
        """Preempt the running batch's last (worst) request for the waiting ``request`` when the
        policy lets ``request`` outrank it; what the victim had scheduled in this step is taken out
        of ``out``. Returns the tokens that go back to the budget, or None when nothing is preempted
        (FCFS never preempts for a waiting request; pooling requests neither take nor give a slot)."""
        if not self.policy.preemptive or not self.running or request.pooling_params is not None:
            return None
        victim = self.running[-1]
        if victim.pooling_params is not None or not self.policy.outranks(request, victim):
            return None
        self.running.pop()
        freed = self._unschedule(out, victim)
        self._preempt(victim)
        if loras is not None:  # its adapter may no longer run
            loras.intersection_update(self.running_loras())
        return freed

    @staticmethod
    def _unschedule(out: SchedulerOutput, request: Request) -> int:
        """Take ``request`` out of the step being planned; returns the tokens it had there."""
        n = out.num_scheduled_tokens.pop(request.request_id, 0)
        out.total_num_scheduled_tokens -= n
        out.scheduled_spec_tokens.pop(request.request_id, None)
        out.scheduled_cached_reqs = [c for c in out.scheduled_cached_reqs if c.req_id != request.request_id]
        out.scheduled_new_reqs = [r for r in out.scheduled_new_reqs if r.req_id != request.request_id]
        return n

    def _preempt(self, request: Request) -> None:
        logger.debug("preempting %s", request.request_id)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.requeue(self.waiting, request)
        self._forget.add(request.request_id)
        self._worker_tokens.pop(request.request_id, None)

    def requeue_all(self) -> int:
        """Every request back to the waiting queue, in order, with nothing computed: the workers
        were rebuilt and hold no KV (preemption by recompute for all); the prefix cache is emptied
        and the workers have nothing to forget. Samples of the lost steps are recomputed (a seeded
        row draws the same value: it depends only on the seed and the token index)."""
        for request in reversed(self.running):
            self._preempt(request)
        self.running = []
        for request in self.waiting:
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0
        self._forget = set()
        self._worker_tokens.clear()
        if self.transfers is not None:  # the workers' KV is gone: nothing held is worth pulling
            self._free_transfers(self.transfers.drop_all())
        self.kv.reset_prefix_cache()
        return len(self.waiting)

    # ---- results ---------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests."""
        if self.transfers is not None:
            self._transfer_results(sched, result)
        outputs = []
        prompt_logprobs = dict(result.prompt_logprobs)
        now = time.monotonic()
        speculated = bool(sched.scheduled_spec_tokens or result.extra_token_ids)
        for request_id, token, logprobs in zip(result.req_ids, result.sampled_token_ids, result.logprobs):
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue  # finished or aborted while the step ran: its sample is discarded
            request.num_output_placeholders = max(request.num_output_placeholders - 1, 0)
            tokens, token_logprobs, drafts = [token], [logprobs], None
            if speculated:  # a run of tokens: the accepted drafts' and the one after
                tokens += result.extra_token_ids.get(request_id, ())
                token_logprobs += result.extra_logprobs.get(request_id, ())
                token_logprobs += [None] * (len(tokens) - len(token_logprobs))
                drafts = sched.scheduled_spec_tokens.get(request_id)
            if drafts:  # the KV of rejected drafts is not the sequence's: recomputed from there
                self.spec_stats.record(len(drafts), len(tokens) - 1)
                request.num_computed_tokens -= len(drafts) - (len(tokens) - 1)
            if request.first_token_time is None:
                request.first_token_time = now
                self.num_prompt_tokens += request.num_prompt_tokens
            new_tokens, new_logprobs = [], []
            for token, logprobs in zip(tokens, token_logprobs):
                request.append_output_token_ids(token)
                new_tokens.append(token)
                if logprobs is not None:
                    new_logprobs.append(logprobs)
                status = self._stop_status(request, token)
                if status is not None:  # a stop inside an accepted run ends it there
                    self._remove_from_queue(request)
                    self._finish(request, status)
                    break
            else:
                if drafts:
                    self.kv.trim(request, request.num_tokens)
                if result.draft_token_ids:
                    request.spec_token_ids = result.draft_token_ids.get(request_id, [])
            self.num_generation_tokens += len(new_tokens)
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=new_tokens,
                    new_logprobs=new_logprobs,
                    new_prompt_logprobs=prompt_logprobs.pop(request_id, []),
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    kv_transfer_params=request.kv_transfer_out,
                )
            )
        outputs += self._pooled(result.pooler_output, now)
        outputs += self._fail_requests(result.failed)
        for request_id, entries in prompt_logprobs.items():  # prefill chunks that sampled nothing
            if request_id in self.requests:
                outputs.append(EngineCoreOutput(request_id, [], new_prompt_logprobs=entries))
        return outputs

    def _pooled(self, pooler_output: dict[str, list[float]], now: float) -> list[EngineCoreOutput]:
        """Finish the pooling requests whose results came back, each with its vector or scores."""
        outputs = []
        for request_id, values in pooler_output.items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            request.first_token_time = now
            self.num_prompt_tokens += request.num_prompt_tokens
            self._remove_from_queue(request)
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            outputs.append(EngineCoreOutput(request_id, [], finish_reason=request.status.finish_reason,
                                            pooler_output=values))
        return outputs

    def _fail_requests(self, failed: dict[str, str]) -> list[EngineCoreOutput]:
        """End the requests that failed on their own in the worker, with finish reason ``error``."""
        outputs = []
        for request_id, error in failed.items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            request.error = error
            self._remove_from_queue(request)
            self._finish(request, RequestStatus.FINISHED_ERROR)
            outputs.append(EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR, error=error))
        return outputs

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if request.num_output_tokens < params.min_tokens:
            return self._prefill_done(request)
        if not params.ignore_eos and token == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        return self._prefill_done(request)

    @staticmethod
    def _prefill_done(request: Request) -> Optional[RequestStatus]:
        """P/D: a producer's prefill-only request ends after its first token (no stop rule of its own
        ended it) and keeps its blocks for a consumer (``kv_hold``)."""
        if not request.prefill_only:
            return None
        request.kv_hold = True
        return RequestStatus.FINISHED_LENGTH_CAPPED

    def _remove_from_queue(self, request: Request) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:  # waiting, or preempted while a step that sampled for it was in flight
            self.waiting.remove(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.finished_time = time.monotonic()
        if self.step_stats is not None:
            self.step_stats.finished.append(request)
        if request.kv_hold and self.transfers is not None and status == RequestStatus.FINISHED_LENGTH_CAPPED:
            blocks = self.kv.get_block_ids(request.request_id)
            request.kv_transfer_out = self.transfers.hold(request, blocks)  # blocks stay referenced
        else:
            self.kv.free(request)
        self._forget.add(request.request_id)
        self._worker_tokens.pop(request.request_id, None)
        del self.requests[request.request_id]

    # ---- disaggregated prefill / decode -----------------------------------------------------
    @property
    def kv_transfers_waiting(self) -> bool:
        """A producer holds transfers (or owes its workers a release): the engine keeps stepping."""
        return self.transfers is not None and self.transfers.waiting

    def held_request_ids(self) -> set[str]:
        """The requests whose blocks a producer holds for a consumer (finished, still abortable)."""
        if self.transfers is None:
            return set()
        return {held.request.request_id for held in self.transfers.held.values()}

    def _pulled_tokens(self, request: Request) -> int:
        """A consumer's request whose prompt KV is pulled from a producer: the prompt's tokens (their
        blocks kept out of the prefix cache until the pull is confirmed); 0 otherwise."""
        params = request.kv_load
        if params is None or request.num_tokens <= params.num_tokens or request.sampling_params.prompt_logprobs:
            return 0
        num_groups = len(params.group_block_ids)
        if num_groups != self.kv.num_groups:  # e.g. one side --disable-hybrid-kv-cache-manager
            logger.warning("request %s: the producer's KV comes in %d KV cache group(s), this engine "
                           "plans %d: computing its prompt here", request.request_id, num_groups,
                           self.kv.num_groups)
            request.kv_load = None
            return 0
        self.kv.defer_caching(request.request_id)
        return params.num_tokens

    def _transfer_results(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Pulled transfers free their blocks; a consumer's pulls are confirmed, or a failed one's
        request goes back to the queue to compute its prompt here (its samples were withheld)."""
        stats = self.transfers.stats
        self._free_transfers(self.transfers.pulled(result.kv_sent, result.kv_bytes_sent))
        stats.bytes_received += result.kv_bytes_received
        for new in sched.scheduled_new_reqs:
            if new.kv_load is None:
                continue
            request = self.requests.get(new.req_id)
            if new.req_id not in result.kv_load_failed:
                stats.transfers_received += 1
                self.kv.confirm_caching(new.req_id)
                if request is not None:
                    request.kv_load = None
                continue
            stats.transfers_failed += 1
            if request is None or request.is_finished:
                continue
            request.kv_load = None
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self.kv.free(request)
                request.status = RequestStatus.PREEMPTED
                request.num_computed_tokens = 0
                request.num_output_placeholders = 0
                self.policy.requeue(self.waiting, request)
                self._forget.add(request.request_id)

    def _free_transfers(self, requests: list[Request]) -> None:
        for request in requests:
            self.kv.free(request)

    def stats(self) -> EngineLoad:
        """A snapshot of the load and cumulative counters: the one source of the engine's load
        report (``GetLoad``, the coordinator) and of its Prometheus metrics."""
        return EngineLoad(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            kv_free_blocks=self.kv.num_free_blocks,
            kv_total_blocks=self.kv.num_total_blocks,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            kv_cache_groups=tuple(self.kv.group_usage()),
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_accepted_per_pos=tuple(self.spec_stats.accepted_per_pos),
            kv_transfers=(None if self.transfers is None else
                          replace(self.transfers.stats, transfers_held=len(self.transfers.held))),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict:
        if self.max_loras is None:
            return {}
        def names(requests: Iterable[Request]) -> tuple[str, ...]:
            return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))
        return {"max_lora": self.max_loras, "running_lora_adapters": names(self.running),
                "waiting_lora_adapters": names(self.waiting)}

    def take_step_stats(self) -> StepStats:
        """The step stats gathered since the last call (collection starts with the first call)."""
        stats, self.step_stats = self.step_stats, StepStats()
        return stats or StepStats()

"""EngineCore: the busy loop's body. One ``step()`` = schedule -> execute -> update.

The core owns the scheduler and the KV-cache manager and drives the workers through an
``Executor``. It plans the KV cache from what the workers report: each layer's kind and bytes
(``get_kv_cache_spec``) and the memory they have (``determine_available_memory``); the plan (the
pool's size and the KV cache groups) goes back to every worker (``initialize_cache``). With
``--enable-lora`` it keeps the LoRA adapter table (``lora_adapters``). No torch here.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any, Optional

from gridserve.services.engine.executor import Executor
from gridserve.services.engine.kv_cache_manager import KVCacheManager
from gridserve.services.engine.lora_adapters import LoRAAdapters
from gridserve.services.engine.request import Request
from gridserve.services.engine.scheduler import Scheduler
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import FailedPreconditionError, InvalidArgumentError
from gridserve.shared.kv_cache_spec import KVCacheConfig, plan_kv_cache, single_group
from gridserve.shared.load import EngineLoad
from gridserve.shared.outputs import EngineCoreOutput
from gridserve.shared.pooling import embedding_size
from gridserve.shared.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

KV_POLL_S = 0.01  # P/D: how often an otherwise idle producer asks its workers which transfers were pulled


class EngineCore:
    """Schedules requests onto the workers and turns their samples into per-request outputs."""

    def __init__(self, config: GridserveConfig, executor: Optional[Executor] = None) -> None:
        self.config = config
        self.executor = executor or Executor.get_class(config)(config)
        self.kv_cache_config = self._initialize_kv_cache()
        self.kv_cache_manager = KVCacheManager(
            self.kv_cache_config.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
            self.kv_cache_config.groups,
        )
        self.scheduler = Scheduler(config, self.kv_cache_manager)
        # The LoRA adapters served (None: --enable-lora is off); --lora-modules load now.
        self.lora: Optional[LoRAAdapters] = None
        if config.lora.enable_lora:
            self.lora = LoRAAdapters(config.lora, self.executor)
            self.lora.load_modules()
        # Batches submitted and not yet updated from, oldest first. At rest it holds up to
        # ``max_concurrent_batches`` (one per pipeline stage); a step adds one before taking one.
        self.max_concurrent_batches = self.executor.max_concurrent_batches
        # Expert parallelism: every step submits exactly one batch (an empty one if need be), so the
        # engines' forward passes, whose MoE layers exchange tokens, pair up step by step.
        self.lockstep = config.parallel.expert_parallel_size > 1
        self._batches: deque[tuple[SchedulerOutput, Future]] = deque()

    def _initialize_kv_cache(self) -> KVCacheConfig:
        cache = self.config.cache
        if self.config.model.runner == "pooling":  # whole inputs, one step each: nothing to keep
            plan = single_group(2, cache.block_size)  # the null block and one (the pool needs two)
            self.executor.initialize_cache(plan)
            cache.num_blocks = plan.num_blocks
            logger.info("pooling model: no KV cache (each input runs whole, in one step)")
            return plan
        specs = self.executor.get_kv_cache_spec()
        available = self.executor.determine_available_memory()
        plan = plan_kv_cache(specs, available, cache.block_size, self.config.max_model_len,
                             hybrid=not cache.disable_hybrid_kv_cache_manager)
        self.executor.initialize_cache(plan)
        cache.num_blocks = plan.num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB), %d group(s): %s", plan.num_blocks,
                    cache.block_size, available / 2**20, len(plan.groups),
                    ", ".join(f"{g.name} x{len(g.layer_names)} layers" for g in plan.groups))
        return plan

    def add_request(self, request: Request) -> None:
        if self.executor.is_sleeping:
            raise FailedPreconditionError(
                f"the engine is asleep ({', '.join(self.sleeping_tags)}): wake it up first")
        if request.lora_request is not None and self.lora is None:
            raise InvalidArgumentError("lora_request", "this engine serves no LoRA adapters (start it with --enable-lora)")
        check_runner(self.config, request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._batches) or self.scheduler.has_unfinished_requests() or self.scheduler.kv_transfers_waiting

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and submit the next batch, then finish the oldest one; return its new tokens.

        Batches stay in flight: the next one is scheduled while the workers run the current ones, so
        the engine's Python work overlaps the forward pass, and with pipeline parallelism every
        stage has a batch (up to ``max_concurrent_batches``). With one stage a request's next token
        counts as a placeholder the worker already holds; with several, a request waits for its
        sample to return before it is scheduled again. Returns nothing while the queue fills.
        """
        submitted_work = submitted = False
        # A step that may verify drafts runs alone: the next one's drafts come with its result.
        max_in_flight = 0 if self.scheduler.speculating else self.max_concurrent_batches
        # P/D: while only held transfers wait, an empty step now and then asks the workers what was pulled.
        polling = not self.scheduler.has_unfinished_requests() and self.scheduler.kv_transfers_waiting
        if polling and not self._batches:
            time.sleep(KV_POLL_S)
        if (self.scheduler.has_unfinished_requests() or polling) and len(self._batches) <= max_in_flight:
            scheduler_output = self.scheduler.schedule()
            # An empty plan still goes out when it carries ids the workers must forget.
            if not scheduler_output.is_empty or scheduler_output.finished_req_ids or not self._batches:
                future = self.executor.execute_model(scheduler_output, non_block=True)
                self._batches.append((scheduler_output, future))
                submitted_work, submitted = not scheduler_output.is_empty, True
        if self.lockstep and not submitted:  # expert parallelism: one forward per step on every engine
            self.execute_dummy_batch()
        if not self._batches or (submitted_work and len(self._batches) <= max_in_flight):
            return []
        scheduler_output, future = self._batches.popleft()
        return self.scheduler.update_from_output(scheduler_output, future.result())

    def requeue_after_worker_loss(self) -> int:
        """The workers lost every request's KV: drop the batches in flight and send every running
        request back to the waiting queue to be recomputed from prompt + the tokens it has (the
        prefix cache is emptied too). Returns the number of requests that will resume."""
        self._batches.clear()
        return self.scheduler.requeue_all()

    def reinitialize_workers(self, timeout_s: float) -> None:
        """Rebuild the worker group (device, weights, a KV cache of the same number of blocks)."""
        self.executor.reinitialize(self.kv_cache_config, timeout_s)

    def execute_dummy_batch(self) -> None:
        """One empty step through the executor (an idle engine's part of an MoE wave)."""
        self.executor.execute_model(SchedulerOutput())

    def stats(self) -> EngineLoad:
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def sleep(self, level: int = 1) -> list[dict[str, int]]:
        """Release the workers' KV cache and weights; each worker's memory before and after."""
        if self.has_unfinished_requests():
            raise FailedPreconditionError("cannot sleep with requests in flight")
        self.kv_cache_manager.reset_prefix_cache()  # the cached blocks' contents are about to go
        return self.executor.sleep(level)

    def wake_up(self, tags: Optional[list[str]] = None) -> list[dict[str, int]]:
        """Restore the sleeping ``tags`` (all when None); requests wait until nothing sleeps."""
        return self.executor.wake_up(tags)

    @property
    def sleeping_tags(self) -> list[str]:
        return sorted(self.executor.sleeping_tags)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None,
                       timeout: Optional[float] = None, unique_reply_rank: Optional[int] = None) -> Any:
        """A worker method (a worker extension's, by name) on every worker."""
        return self.executor.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs,
                                            unique_reply_rank=unique_reply_rank)

    def shutdown(self) -> None:
        self.executor.shutdown()


def check_runner(config: GridserveConfig, request: Request) -> None:
    """A pooling model takes pooling requests only, a generative model generation only (each refusal
    says which runner serves the model); a pooling request's parameters and segment ids are checked
    against the model."""
    model = config.model
    if model.runner != "pooling":
        if request.pooling_params is not None:
            raise InvalidArgumentError("pooling_params", f"{model.model} generates text (runner generate): it "
                                       "serves no embeddings, scores or classifications")
        if request.token_type_ids:
            raise InvalidArgumentError("token_type_ids", "apply to pooling models only")
        return
    if request.pooling_params is None:
        raise InvalidArgumentError("sampling_params", f"{model.model} is a pooling model (runner pooling: "
                                   f"{', '.join(config.pooling_tasks)}): it generates no text")
    size = embedding_size(model.model_path, int(model.text_config.get("hidden_size", 0)))  # after Dense modules
    request.pooling_params.verify(config.pooling_tasks, size, model.hf_config)
    if request.num_prompt_tokens == 0:
        raise InvalidArgumentError("prompt_token_ids", "a pooling input needs at least one token")
    if request.num_prompt_tokens > config.max_model_len:
        raise InvalidArgumentError("prompt_token_ids", f"{request.num_prompt_tokens} tokens exceed the model's "
                                   f"limit of {config.max_model_len} (truncate_prompt_tokens shortens an input)")
    types = request.token_type_ids
    if types:
        vocab = int(model.hf_config.get("type_vocab_size", 0) or 0)
        if len(types) != request.num_prompt_tokens:
            raise InvalidArgumentError("token_type_ids", f"{len(types)} ids for {request.num_prompt_tokens} tokens")
        if vocab < 1 or any(not 0 <= t < vocab for t in types):
            raise InvalidArgumentError("token_type_ids", f"each must be in [0, {vocab}) for this model")

"""``LLM``: offline batched inference with vLLM's names (``generate``, ``chat``, ``SamplingParams``)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any, Optional, Union

from tqdm.auto import tqdm

from gridserve.launcher import Launcher
from gridserve.llm_engine import LLMEngine
from gridserve.services.gateway.processor import PromptType
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.outputs import RequestOutput
from gridserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ChatMessages = list[dict[str, Any]]


class LLM:
    """An engine for offline generation.

    Keyword arguments are vLLM's (``dtype``, ``seed``, ``max_model_len``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``block_size``, ``enable_prefix_caching``,
    ``enable_chunked_prefill``, ``kv_cache_memory_bytes``, ``gpu_memory_utilization``,
    ``tensor_parallel_size``, ``tokenizer``, ``device``, ...); an unknown one is an error.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = GridserveConfig.from_kwargs(model=model, **kwargs).finalize()
        self.tokenizer = _load_tokenizer(self.config.model.tokenizer_path)
        self._workers = _start_local_workers(self.config)
        try:
            self.llm_engine = LLMEngine(self.config, self.tokenizer)
        except BaseException:
            if self._workers is not None:
                self._workers.stop()
            raise

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts."""
        prompt_list = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompt_list))
        return self._run(prompt_list, params, use_tqdm)

    def chat(
        self,
        messages: Union[ChatMessages, Sequence[ChatMessages]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            {
                "prompt_token_ids": list(
                    self.tokenizer.apply_chat_template(
                        conv, add_generation_prompt=add_generation_prompt,
                        chat_template=chat_template, tokenize=True, return_dict=False,
                    )
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        results: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            leftover = [rid for rid in ids if rid not in results]
            if leftover:
                engine.abort_request(leftover)
        return [results[rid] for rid in ids]

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        self.llm_engine.core.sleep(level)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        self.llm_engine.core.wake_up(tags)

    def stats(self):
        """The scheduler's counters (queue lengths, KV usage, prefix-cache queries and hits)."""
        return self.llm_engine.core.stats()

    def shutdown(self) -> None:
        """Stop the engine and, with tensor / pipeline parallelism, the worker processes."""
        try:
            self.llm_engine.shutdown()
        finally:
            if self._workers is not None:
                self._workers.stop()
                self._workers = None


def _start_local_workers(config: GridserveConfig) -> Optional[Launcher]:
    """With ``tensor_parallel_size x pipeline_parallel_size > 1`` and no worker addresses given, start
    that many local worker services and point the engine at them (the ``grpc`` executor, as ``serve``)."""
    parallel = config.parallel
    if parallel.world_size == 1 or parallel.worker_addresses:
        if parallel.worker_addresses:
            parallel.executor_backend = "grpc"
        return None
    from gridserve.launcher import Launcher

    launcher = Launcher(config.model.model_path, [], tensor_parallel_size=parallel.tensor_parallel_size,
                        pipeline_parallel_size=parallel.pipeline_parallel_size, grace_s=5.0)
    parallel.worker_addresses = launcher.start_workers()
    parallel.executor_backend = "grpc"
    # The workers exit when the engine's streams close; this stops any that did not.
    weakref.finalize(launcher, launcher.stop)
    logger.info("started %d local workers: %s", parallel.world_size, ", ".join(parallel.worker_addresses))
    return launcher


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # a single prompt given as token ids
    if not prompts:
        raise InvalidArgumentError("prompts", "no prompts given")
    return prompts


def _per_prompt(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidArgumentError("sampling_params", f"got {len(params)} for {n} prompts")
    return params

"""``LLM``: offline batched inference with vLLM's names (``generate``, ``chat``, ``SamplingParams``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional, Union

from tqdm.auto import tqdm

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
        self.llm_engine = LLMEngine(self.config, self.tokenizer)

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
        self.llm_engine.shutdown()


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

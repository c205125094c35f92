"""``LLM``: offline batched inference with vLLM's names (``generate``, ``chat``, ``SamplingParams``)."""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union

from tqdm.auto import tqdm

from gridserve.launcher import Launcher
from gridserve.llm_engine import LLMEngine
from gridserve.services.gateway.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    candidates_of,
)
from gridserve.services.gateway.media_loader import MediaConfig, MediaLoader
from gridserve.services.gateway.multimodal import chat_images
from gridserve.services.gateway.processor import PromptType
from gridserve.services.gateway.protocol import INT32_MAX, INT32_MIN
from gridserve.shared.config import PRIORITY, GridserveConfig
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.lora import LoRARequest
from gridserve.shared.outputs import (
    ClassificationOutput,
    EmbeddingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
)
from gridserve.shared.pooling import CLASSIFY, EMBED, SCORE, PoolingParams
from gridserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ChatMessages = list[dict[str, Any]]


class LLM:
    """An engine for offline generation.

    Keyword arguments are vLLM's (``dtype``, ``seed``, ``max_model_len``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``block_size``, ``enable_prefix_caching``,
    ``enable_chunked_prefill``, ``kv_cache_memory_bytes``, ``gpu_memory_utilization``,
    ``tensor_parallel_size``, ``pipeline_parallel_size``, ``data_parallel_size``, ``tokenizer``,
    ``device``, ...); an unknown one is an error.

    With ``data_parallel_size=N`` there are N engines, each driving its own local worker processes
    (``PP x TP`` each); prompts are spread over them (fewest unfinished requests first) and the
    engines step in parallel threads (each waits on its workers, not on the GIL).
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = GridserveConfig.from_kwargs(model=model, **kwargs).finalize()
        self.tokenizer = _load_tokenizer(self.config.model.tokenizer_path)
        self._launchers: list[Launcher] = []
        self._media: Optional[MediaLoader] = None  # chat image URLs, loaded on first use
        self.engines: list[LLMEngine] = []
        try:
            for rank in range(self.config.parallel.data_parallel_size):
                config = copy.deepcopy(self.config)
                launcher = _start_local_workers(config, self.config.parallel.data_parallel_size)
                if launcher is not None:
                    self._launchers.append(launcher)
                self.engines.append(LLMEngine(config, self.tokenizer))
                logger.debug("engine %d ready", rank)
        except BaseException:
            self.shutdown()
            raise
        self.llm_engine = self.engines[0]

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given no sampling parameters (vLLM's): the model's
        generation config (its ``generation_config.json``: temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens as max_tokens) over ``SamplingParams``' defaults;
        ``generation_config="vllm"``: ``SamplingParams()``."""
        return SamplingParams(**self.config.model.default_sampling_params)

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
        priority: Optional[Sequence[int]] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        ``lora_request``: one adapter for every prompt, or one (or None: the base model) per prompt;
        needs ``enable_lora=True``. ``priority``: one integer per prompt (vLLM's), lower runs first;
        needs ``scheduling_policy="priority"``."""
        prompt_list = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompt_list), self.get_default_sampling_params)
        return self._run(prompt_list, params, use_tqdm, _per_prompt_lora(lora_request, len(prompt_list)),
                         _per_prompt_priority(priority, len(prompt_list), self.config.scheduler.scheduling_policy))

    def chat(
        self,
        messages: Union[ChatMessages, Sequence[ChatMessages]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
        lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate. Image parts
        (``image_url`` with a ``data:`` / ``http(s)`` URL, or ``image_pil``) go to a vision-language
        model with the conversation, as vLLM takes them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in conversations:
            rendered, images = chat_images(list(conv))
            ids = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                                     chat_template=chat_template, tokenize=True, return_dict=False)
            prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
            if images:
                prompt["multi_modal_data"] = {"image": [self._image(field, source) for field, source in images]}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search: per prompt, the ``beam_width`` best sequences, best score first
        (``sequences[i].tokens`` / ``.text`` are the continuation, not prompt + continuation as vLLM's).
        Each step runs one one-token request per live beam of every prompt, all in one batch (their
        prefixes come from the prefix cache); the rule is ``beam_search.BeamSearch``'s, transformers'."""
        prompt_list = _as_prompt_list(prompts)
        if any(isinstance(p, dict) and "multi_modal_data" in p for p in prompt_list):
            raise InvalidArgumentError("prompts", "beam search takes text or token-id prompts (no images)")
        params.check_width(self.config.model.max_logprobs)
        step = params.step_params()
        eos = self.config.model.eos_token_id
        eos = self.tokenizer.eos_token_id if eos is None else eos
        max_len = self.config.model.max_model_len

        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

        firsts = self._run(prompt_list, [step] * len(prompt_list), use_tqdm)
        searches = [BeamSearch(params, out.prompt_token_ids, () if eos is None else (eos,),
                               max_len - len(out.prompt_token_ids), decode) for out in firsts]
        for search, out in zip(searches, firsts):
            search.advance([candidates_of(out, params.beam_width)])
        while live := [s for s in searches if not s.done]:
            beams = [{"prompt_token_ids": p} for s in live for p in s.prompts()]
            outs = iter(self._run(beams, [step] * len(beams), use_tqdm=False))
            for search in live:
                search.advance([candidates_of(next(outs), params.beam_width) for _ in search.live])
        return [BeamSearchOutput(s.results(), s.prompt_token_ids) for s in searches]

    # ---- pooling models (runner "pooling": embeddings, classification, scores) -----------------
    def embed(self, prompts: Union[PromptType, Sequence[PromptType]], pooling_params: Optional[PoolingParams] = None,
              *, truncate_prompt_tokens: Optional[int] = None, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Each prompt's embedding (``outputs.embedding``), in order; ``pooling_params`` may set
        ``dimensions`` (Matryoshka models) and ``normalize``."""
        params = pooling_params or PoolingParams(task=EMBED)
        if params.task != EMBED:
            raise InvalidArgumentError("pooling_params.task", f"embed() embeds, got {params.task!r}")
        inputs = [(self._pooling_ids(p, truncate_prompt_tokens), None) for p in _as_prompt_list(prompts)]
        return [PoolingRequestOutput(rid, EmbeddingOutput(values), ids)
                for rid, ids, values in self._pool(inputs, params, use_tqdm)]

    def classify(self, prompts: Union[PromptType, Sequence[PromptType]], *, activation: Optional[bool] = None,
                 truncate_prompt_tokens: Optional[int] = None, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Each prompt's class probabilities (``outputs.probs``; raw logits with ``activation=False``)."""
        inputs = [(self._pooling_ids(p, truncate_prompt_tokens), None) for p in _as_prompt_list(prompts)]
        return [PoolingRequestOutput(rid, ClassificationOutput(values), ids)
                for rid, ids, values in self._pool(inputs, PoolingParams(task=CLASSIFY, activation=activation), use_tqdm)]

    def score(self, text_1: Union[str, Sequence[str]], text_2: Union[str, Sequence[str]], *,
              activation: Optional[bool] = None, truncate_prompt_tokens: Optional[int] = None,
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.score``: one score per pair, pairs 1:1, 1:N or N:N. A cross-encoder (task
        ``score``) reads each pair as one input (``tokenizer(text_1, text_2)``, with its segment ids);
        an embedding model scores the cosine similarity of the two texts' embeddings."""
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        if not firsts or not seconds:
            raise InvalidArgumentError("text_1" if not firsts else "text_2", "must not be empty")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise InvalidArgumentError("text_2", f"{len(seconds)} texts for {len(firsts)} in text_1 (1:N or N:N)")
        tasks = self.config.pooling_tasks
        if SCORE in tasks:
            inputs = [self._pair_ids(a, b, truncate_prompt_tokens) for a, b in zip(firsts, seconds)]
            pooled = self._pool(inputs, PoolingParams(task=SCORE, activation=activation), use_tqdm)
            return [PoolingRequestOutput(rid, ScoringOutput(values[0]), ids) for rid, ids, values in pooled]
        if EMBED not in tasks:
            raise InvalidArgumentError("model", f"{self.config.model.model} scores no pairs (it serves {', '.join(tasks)})")
        left = self.embed(firsts, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)
        right = self.embed(seconds, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)
        return [PoolingRequestOutput(f"{a.request_id}-{b.request_id}",
                                     ScoringOutput(_cosine(a.outputs.embedding, b.outputs.embedding)),
                                     a.prompt_token_ids + b.prompt_token_ids)
                for a, b in zip(left, right)]

    def _pooling_ids(self, prompt: PromptType, truncate: Optional[int]) -> list[int]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
        elif isinstance(prompt, str):
            ids = list(self.tokenizer(prompt)["input_ids"])
        else:
            raise InvalidArgumentError("prompts", "each must be a string or {\"prompt_token_ids\": [...]}")
        return _truncated(ids, truncate)

    def _pair_ids(self, first: str, second: str, truncate: Optional[int]) -> tuple[list[int], Optional[list[int]]]:
        encoded = self.tokenizer(first, second)
        ids, types = list(encoded["input_ids"]), encoded.get("token_type_ids")
        if types is not None and not any(types):
            types = None
        if truncate is not None and truncate < len(ids):
            ids, types = _truncated(ids, truncate), (None if types is None else list(types)[-truncate:])
        return ids, (list(types) if types is not None else None)

    def _pool(self, inputs: list[tuple[list[int], Optional[list[int]]]], params: PoolingParams,
              use_tqdm: bool) -> list[tuple[str, list[int], list[float]]]:
        """Run pooling requests over the engines; (request id, prompt, values) in input order."""
        if self.config.model.runner != "pooling":
            raise InvalidArgumentError("model", f"{self.config.model.model} generates text (runner generate): "
                                                "embed / classify / score need a pooling model")
        assigned: list[list[str]] = [[] for _ in self.engines]
        keys = []
        for ids, types in inputs:
            rank = min(range(len(self.engines)), key=lambda r: len(assigned[r]))
            assigned[rank].append(self.engines[rank].add_pooling_request(ids, params, types))
            keys.append((rank, assigned[rank][-1], ids))
        results: dict[tuple[int, str], Any] = {}
        try:
            with tqdm(total=len(keys), desc="Processed prompts", disable=not use_tqdm) as bar:
                for rank in range(len(self.engines)):
                    self._drive(rank, results, bar)
        finally:
            for rank, ids in enumerate(assigned):
                leftover = [rid for rid in ids if (rank, rid) not in results]
                if leftover:
                    self.engines[rank].abort_request(leftover)
        return [(rid, ids, results[(rank, rid)].pooler_output) for rank, rid, ids in keys]

    def _image(self, field: str, source: Any) -> Any:
        """A chat image part's image: a PIL image as is, a URL loaded (default media limits)."""
        if not isinstance(source, str):
            return source
        if self._media is None:
            # the caller's own process: any public host may be fetched (the server's gateways
            # fetch nothing remote unless --allowed-media-domains says so)
            self._media = MediaLoader(MediaConfig(allowed_media_domains=("*",)))
        return self._media.load(field, source)

    def _run(self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool,
             loras: Optional[list[Optional[LoRARequest]]] = None,
             priorities: Optional[list[int]] = None) -> list[RequestOutput]:
        assigned: list[list[str]] = [[] for _ in self.engines]
        keys = []
        for prompt, sp, lora, priority in zip(prompts, params, loras or [None] * len(prompts),
                                              priorities or [0] * len(prompts)):
            rank = min(range(len(self.engines)), key=lambda r: len(assigned[r]))
            assigned[rank].append(self.engines[rank].add_request(prompt, sp, lora_request=lora, priority=priority))
            keys.append((rank, assigned[rank][-1]))
        results: dict[tuple[int, str], RequestOutput] = {}
        try:
            with tqdm(total=len(keys), desc="Processed prompts", disable=not use_tqdm) as bar:
                if len(self.engines) == 1:
                    self._drive(0, results, bar)
                else:
                    with ThreadPoolExecutor(len(self.engines), thread_name_prefix="dp-engine") as pool:
                        for future in [pool.submit(self._drive, r, results, bar) for r in range(len(self.engines))]:
                            future.result()
        finally:
            for rank, ids in enumerate(assigned):
                leftover = [rid for rid in ids if (rank, rid) not in results]
                if leftover:
                    self.engines[rank].abort_request(leftover)
        return [results[key] for key in keys]

    def _drive(self, rank: int, results: dict, bar: tqdm) -> None:
        """Step engine ``rank`` until it has no unfinished request (one thread per engine)."""
        engine = self.engines[rank]
        while engine.has_unfinished_requests():
            for out in engine.step():
                results[(rank, out.request_id)] = out
                bar.update(1)

    def reset_prefix_cache(self) -> bool:
        return all([engine.core.reset_prefix_cache() for engine in self.engines])

    def sleep(self, level: int = 1) -> list[dict[str, int]]:
        """Level 1: offload the weights to host memory (on CPU they stay) and drop the KV cache;
        level 2: drop both. Each worker's memory before and after (``rss_*``, ``device_*`` bytes)."""
        return [report for engine in self.engines for report in engine.core.sleep(level)]

    def wake_up(self, tags: Optional[list[str]] = None) -> list[dict[str, int]]:
        """Restore ``tags`` ("weights", "kv_cache"; all when None). Generation waits until nothing
        sleeps (``sleeping_tags`` empty)."""
        return [report for engine in self.engines for report in engine.core.wake_up(tags)]

    @property
    def sleeping_tags(self) -> list[str]:
        return self.llm_engine.core.sleeping_tags

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict[str, Any]] = None,
                       timeout: Optional[float] = None, unique_reply_rank: Optional[int] = None) -> list[Any]:
        """Call a method of the worker extension (``worker_extension_cls``) on every worker of every
        engine, by name; torch tensors in the arguments and results travel as typed tensors."""
        from gridserve.services.worker.extension import to_torch, to_wire

        args, kwargs = tuple(to_wire(list(args))), to_wire(dict(kwargs or {}))
        results = [engine.core.collective_rpc(method, args, kwargs, timeout, unique_reply_rank)
                   for engine in self.engines]
        return to_torch(results if len(results) > 1 else results[0])

    def stats(self):
        """The first engine's scheduler counters (queue lengths, KV usage, prefix-cache queries and hits)."""
        return self.llm_engine.core.stats()

    def shutdown(self) -> None:
        """Stop the engines and, with tensor / pipeline / data parallelism, the worker processes."""
        try:
            for engine in self.engines:
                engine.shutdown()
        finally:
            for launcher in self._launchers:
                launcher.stop()
            self._launchers = []
            self.engines = []


def _start_local_workers(config: GridserveConfig, data_parallel_size: int = 1) -> Optional[Launcher]:
    """With ``tensor_parallel_size x pipeline_parallel_size > 1`` (or several DP engines) and no
    worker addresses given, start one engine's local worker services and point it at them (the
    ``grpc`` executor, as ``serve``); their CPU threads share the machine with the other engines'."""
    parallel = config.parallel
    if parallel.executor_backend == "ray":
        return None  # Ray places and starts the workers (RayExecutor)
    if (parallel.world_size == 1 and data_parallel_size == 1) or parallel.worker_addresses:
        if parallel.worker_addresses:
            parallel.executor_backend = "grpc"
        return None
    from gridserve.launcher import Launcher

    launcher = Launcher(config.model.model_path, [], tensor_parallel_size=parallel.tensor_parallel_size,
                        pipeline_parallel_size=parallel.pipeline_parallel_size,
                        data_parallel_size=data_parallel_size, grace_s=5.0, metrics=False)
    parallel.worker_addresses = launcher.start_workers()
    parallel.executor_backend = "grpc"
    # The workers exit when the engine's streams close; this stops any that did not.
    weakref.finalize(launcher, launcher.stop)
    logger.info("started %d local workers: %s", parallel.world_size, ", ".join(parallel.worker_addresses))
    return launcher


def _load_tokenizer(path: str) -> Any:
    """A tokenizer folder or hub id (AutoTokenizer), or the tokenizer embedded in a ``.gguf`` file."""
    from gridserve.services.worker.gguf_loader import load_hf_tokenizer

    return load_hf_tokenizer(path)


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # a single prompt given as token ids
    if not prompts:
        raise InvalidArgumentError("prompts", "no prompts given")
    return prompts


def _per_prompt(params: Any, n: int, default: Callable[[], SamplingParams]) -> list[SamplingParams]:
    if params is None:
        return [default()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidArgumentError("sampling_params", f"got {len(params)} for {n} prompts")
    return params


def _per_prompt_lora(lora: Any, n: int) -> Optional[list[Optional[LoRARequest]]]:
    """``generate``'s ``lora_request``: one for all prompts, or one per prompt."""
    if lora is None or isinstance(lora, LoRARequest):
        return None if lora is None else [lora] * n
    if not isinstance(lora, (list, tuple)):
        raise InvalidArgumentError("lora_request", f"must be a LoRARequest or a list of them, got {type(lora).__name__}")
    if len(lora) != n:
        raise InvalidArgumentError("lora_request", f"has {len(lora)} entries for {n} prompts")
    return list(lora)


def _per_prompt_priority(priority: Any, n: int, policy: str) -> Optional[list[int]]:
    """``generate``'s ``priority``: one integer per prompt (vLLM's), within int32; any but 0 needs
    the priority policy (checked before any prompt reaches the engine)."""
    if priority is None:
        return None
    if not isinstance(priority, (list, tuple)):
        raise InvalidArgumentError("priority", f"must be a list of integers, one per prompt, got {type(priority).__name__}")
    if len(priority) != n:
        raise InvalidArgumentError("priority", f"has {len(priority)} entries for {n} prompts")
    for value in priority:
        if isinstance(value, bool) or not isinstance(value, int) or not INT32_MIN <= value <= INT32_MAX:
            raise InvalidArgumentError("priority", f"each must be an integer in [{INT32_MIN}, {INT32_MAX}], "
                                                   f"got {value!r}")
    if policy != PRIORITY and any(priority):
        raise InvalidArgumentError("priority", f"must be 0 with scheduling_policy={policy!r} (build the LLM with "
                                               "scheduling_policy=\"priority\")")
    return list(priority)


def _truncated(ids: list[int], truncate: Optional[int]) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``truncate`` tokens (None: all)."""
    if truncate is None:
        return ids
    if isinstance(truncate, bool) or not isinstance(truncate, int) or truncate < 1:
        raise InvalidArgumentError("truncate_prompt_tokens", f"must be a positive integer, got {truncate!r}")
    return ids[-truncate:]


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5
    return dot / norm if norm else 0.0

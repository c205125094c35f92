"""Request processing on the gateway side of the engine.

``InputProcessor`` validates a prompt and its sampling parameters and tokenizes it; a prompt's
images (``{"multi_modal_data": {"image": ...}}``) go through the model's ``MultiModalProcessor``.
``OutputProcessor`` turns the engine's per-step token outputs into ``RequestOutput`` objects:
incremental detokenization, stop strings (which end a request the engine cannot see stopping),
logprobs with decoded tokens, and the fan-in of ``n > 1`` parallel samples.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from gridserve.services.gateway.detokenizer import IncrementalDetokenizer
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.multimodal import ImageFeature
from gridserve.shared.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    FinishReason,
    Logprob,
    RequestOutput,
)
from gridserve.shared.request_checks import check_request
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import TokenLogprobs

PromptType = Union[str, list[int], dict]


@dataclass
class ProcessedPrompt:
    prompt: Optional[str]
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    mm_features: list[ImageFeature] = field(default_factory=list)


class InputProcessor:
    """Validates and tokenizes prompts against the model's limits (``shared.request_checks``, the
    check the engine runs again); ``max_tokens`` defaults to, and is capped at, what the prompt
    leaves of ``max_model_len``."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int, max_logprobs: int = 20,
                 multimodal: Any = None) -> None:
        """``multimodal``: the model's ``MultiModalProcessor`` (None: a text-only model)."""
        self.tokenizer = tokenizer
        self.multimodal = multimodal
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedPrompt:
        text, token_ids = self._tokenize(prompt)
        token_ids, mm_features = self._images(prompt, token_ids, params)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens :]
        params = copy.copy(params)
        params.bad_words_token_ids = self._bad_words(params.bad_words)
        room = self.max_model_len - len(token_ids)
        if room > 0 and (params.max_tokens is None or params.max_tokens > room):
            params.max_tokens = room  # what the prompt leaves: the engine refuses more
        check_request(token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                      max_logprobs=self.max_logprobs, prompt_field="prompt")
        if params.structured_outputs is not None:
            from gridserve.shared.structured_output import validate_structured_outputs

            validate_structured_outputs(params.structured_outputs, self.tokenizer)
        return ProcessedPrompt(text, token_ids, params, mm_features)

    def _images(self, prompt: PromptType, token_ids: list[int], params: SamplingParams,
                ) -> tuple[list[int], list[ImageFeature]]:
        """The prompt with its image placeholders expanded, and its images preprocessed."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return token_ids, []
        unknown = sorted(set(data) - {"image"})
        if unknown:
            raise InvalidArgumentError(f"multi_modal_data.{unknown[0]}", "only images are supported")
        if self.multimodal is None:
            raise InvalidArgumentError("multi_modal_data.image", "this model takes text only (no vision encoder)")
        if params.truncate_prompt_tokens is not None:
            raise InvalidArgumentError("truncate_prompt_tokens", "cannot be combined with images")
        images = data["image"] if isinstance(data["image"], (list, tuple)) else [data["image"]]
        return self.multimodal.process(token_ids, list(images))

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, with and without a leading space (as vLLM does)."""
        found: list[list[int]] = []
        for word in words:
            for variant in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in found:
                    found.append(ids)
        return found

    def _tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(str(prompt["prompt"]))
            raise InvalidArgumentError("prompt", "a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return None, _token_list(prompt)
        raise InvalidArgumentError("prompt", f"expected str, token ids or dict, got {type(prompt).__name__}")


def _token_list(ids: Any) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidArgumentError("prompt_token_ids", "must be a list of integers")
    return list(ids)


def child_requests(request_id: str, params: SamplingParams) -> list[tuple[str, int, SamplingParams]]:
    """Fan a request out into ``n`` engine requests: ``(child_id, index, params)``.

    With ``n == 1`` the request is its own only child. Seeded children get ``seed + index`` so each
    is reproducible and they differ from one another.
    """
    if params.n == 1:
        return [(request_id, 0, params)]
    children = []
    for index in range(params.n):
        child = copy.copy(params)
        child.n = 1
        if params.seed is not None:
            child.seed = _wrap_int64(params.seed + index)
        children.append((f"{index}_{request_id}", index, child))
    return children


def _wrap_int64(value: int) -> int:
    """``value`` wrapped into the signed 64-bit range of the engine's ``seed`` field."""
    return (value + 2**63) % 2**64 - 2**63


class _SampleState:
    """One engine request (one of the ``n`` samples): its tokens, text and logprobs."""

    def __init__(self, index: int, params: SamplingParams, tokenizer: Any) -> None:
        self.index = index
        self.params = params
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, params.skip_special_tokens) if params.detokenize else None
        )
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[dict[int, Logprob]]] = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.text = ""
        self.finish_reason: Optional[str] = None
        self.stop_reason: Union[int, str, None] = None

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class _ParentState:
    """A user request: its prompt, its samples, and prompt logprobs."""

    request_id: str
    prompt: ProcessedPrompt
    samples: dict[str, _SampleState]
    prompt_logprobs: Optional[list] = None
    num_cached_tokens: int = 0
    done: set[str] = field(default_factory=set)

    def output(self) -> RequestOutput:
        completions = sorted((s.completion() for s in self.samples.values()), key=lambda c: c.index)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt.prompt,
            prompt_token_ids=self.prompt.prompt_token_ids,
            outputs=completions,
            finished=len(self.done) == len(self.samples),
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
        )


class OutputProcessor:
    """Collects engine outputs per request; reports requests a stop string has ended."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _ParentState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: ProcessedPrompt, children: list[tuple[str, int, SamplingParams]]) -> None:
        samples = {cid: _SampleState(index, params, self.tokenizer) for cid, index, params in children}
        wants_prompt_lp = prompt.sampling_params.prompt_logprobs is not None
        self.parents[request_id] = _ParentState(request_id, prompt, samples, [None] if wants_prompt_lp else None)
        for cid in samples:
            self.child_to_parent[cid] = request_id

    def current(self, request_id: str) -> Optional[RequestOutput]:
        """The request's output so far (cumulative, unfinished), or None when it is not here."""
        parent = self.parents.get(request_id)
        return parent.output() if parent else None

    def children_of(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.samples) if parent else []

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Return the finished ``RequestOutput``s and the engine ids to abort (stop strings)."""
        finished, to_abort = [], []
        for out in outputs:
            parent_id = self.child_to_parent.get(out.request_id)
            if parent_id is None:
                continue
            parent = self.parents[parent_id]
            sample = parent.samples[out.request_id]
            parent.num_cached_tokens = out.num_cached_tokens
            if parent.prompt_logprobs is not None and out.new_prompt_logprobs:
                parent.prompt_logprobs.extend(self._entry(lp) for lp in out.new_prompt_logprobs)
            if self._update(sample, out) and not out.finished:
                to_abort.append(out.request_id)
            if sample.finish_reason is not None:
                self._sample_done(parent, out.request_id, finished)
        return finished, to_abort

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for cid, sample in parent.samples.items():
            if sample.finish_reason is None:
                sample.finish_reason = FinishReason.ABORT.value
            parent.done.add(cid)
            self.child_to_parent.pop(cid, None)
        del self.parents[request_id]
        return parent.output()

    def _sample_done(self, parent: _ParentState, child_id: str, finished: list[RequestOutput]) -> None:
        parent.done.add(child_id)
        self.child_to_parent.pop(child_id, None)
        if len(parent.done) == len(parent.samples):
            finished.append(parent.output())
            del self.parents[parent.request_id]

    def _update(self, sample: _SampleState, out: EngineCoreOutput) -> bool:
        # The token that stopped the request (EOS or one of stop_token_ids) is not text, unless
        # include_stop_str_in_output (as vLLM): with special tokens kept it would show as "</s>".
        stop_token = (len(out.new_token_ids) - 1 if out.finish_reason is FinishReason.STOP
                      and not isinstance(out.stop_reason, str) and not sample.params.include_stop_str_in_output
                      else -1)
        for i, token in enumerate(out.new_token_ids):
            sample.token_ids.append(token)
            if sample.logprobs is not None and i < len(out.new_logprobs):
                lp = out.new_logprobs[i]
                sample.cumulative_logprob += lp.logprobs[0]
                sample.logprobs.append(self._entry(lp))
            if i == stop_token:
                continue
            if sample.detokenizer is not None and self._check_stop_strings(sample, sample.detokenizer.step(token)):
                return True
        if out.finish_reason is not None:
            sample.finish_reason = out.finish_reason.value
            sample.stop_reason = out.stop_reason
        return False

    @staticmethod
    def _check_stop_strings(sample: _SampleState, chunk: str) -> bool:
        sample.text += chunk
        if not sample.params.stop or not chunk:
            return False
        longest = max(len(s) for s in sample.params.stop)
        window_start = max(0, len(sample.text) - len(chunk) - longest + 1)
        for stop in sample.params.stop:
            at = sample.text.find(stop, window_start)
            if at >= 0:
                end = at + len(stop) if sample.params.include_stop_str_in_output else at
                sample.text = sample.text[:end]
                sample.finish_reason = FinishReason.STOP.value
                sample.stop_reason = stop
                return True
        return False

    def _entry(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        """vLLM's per-position dict: the chosen token (with its rank) and the top-N candidates."""
        chosen = lp.token_ids[0]
        entry = {chosen: Logprob(lp.logprobs[0], lp.sampled_rank, self.tokenizer.decode([chosen]))}
        for rank, (tok, val) in enumerate(zip(lp.token_ids[1:], lp.logprobs[1:]), start=1):
            entry.setdefault(tok, Logprob(val, rank, self.tokenizer.decode([tok])))
        return entry

"""Request processing on the gateway side of the engine.

``InputProcessor`` validates a prompt and its sampling parameters and tokenizes it.
``OutputProcessor`` turns the engine's per-step token outputs into ``RequestOutput`` objects:
incremental detokenization, stop strings (which end a request the engine cannot see stopping),
logprobs with decoded tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional, Union

from gridserve.services.gateway.detokenizer import IncrementalDetokenizer
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    FinishReason,
    Logprob,
    RequestOutput,
)
from gridserve.shared.sampling_params import SamplingParams

PromptType = Union[str, list[int], dict]


@dataclass
class ProcessedPrompt:
    prompt: Optional[str]
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


class InputProcessor:
    """Validates and tokenizes prompts against the model's limits."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedPrompt:
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise InvalidArgumentError("prompt", "the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise InvalidArgumentError(
                "prompt",
                f"the prompt has {len(token_ids)} tokens; max_model_len={self.max_model_len} leaves "
                "no room for output",
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgumentError("prompt_token_ids", f"token id {bad[0]} is outside [0, {self.vocab_size})")
        params = copy.copy(params)
        room = self.max_model_len - len(token_ids)
        if params.max_tokens is None or params.max_tokens > room:
            params.max_tokens = room
        return ProcessedPrompt(text, token_ids, params)

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


class _RequestState:
    """What the output processor tracks for one request."""

    def __init__(self, request_id: str, prompt: ProcessedPrompt, tokenizer: Any) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = prompt.sampling_params
        self.detokenizer = IncrementalDetokenizer(tokenizer, self.params.skip_special_tokens)
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[dict[int, Logprob]]] = [] if self.params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.text = ""
        self.finish_reason: Optional[str] = None
        self.stop_reason: Union[int, str, None] = None
        self.num_cached_tokens = 0


class OutputProcessor:
    """Collects engine outputs per request; reports requests a stop string has ended."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: ProcessedPrompt) -> None:
        self.states[request_id] = _RequestState(request_id, prompt, self.tokenizer)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Return the finished ``RequestOutput``s and the ids the engine must abort (stop strings)."""
        finished, to_abort = [], []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue
            stopped_by_string = self._update(state, out)
            if stopped_by_string and not out.finished:
                to_abort.append(out.request_id)
            if state.finish_reason is not None:
                finished.append(self._make_output(state))
                del self.states[out.request_id]
        return finished, to_abort

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        state.finish_reason = FinishReason.ABORT.value
        return self._make_output(state)

    def _update(self, state: _RequestState, out: EngineCoreOutput) -> bool:
        state.num_cached_tokens = out.num_cached_tokens
        for i, token in enumerate(out.new_token_ids):
            state.token_ids.append(token)
            chunk = state.detokenizer.step(token)
            if state.logprobs is not None and i < len(out.new_logprobs):
                self._add_logprobs(state, out.new_logprobs[i])
            if self._check_stop_strings(state, chunk):
                return True
        if out.finish_reason is not None:
            state.finish_reason = out.finish_reason.value
            state.stop_reason = out.stop_reason
        return False

    def _check_stop_strings(self, state: _RequestState, chunk: str) -> bool:
        state.text += chunk
        if not state.params.stop or not chunk:
            return False
        longest = max(len(s) for s in state.params.stop)
        window_start = max(0, len(state.text) - len(chunk) - longest + 1)
        for stop in state.params.stop:
            at = state.text.find(stop, window_start)
            if at >= 0:
                end = at + len(stop) if state.params.include_stop_str_in_output else at
                state.text = state.text[:end]
                state.finish_reason = FinishReason.STOP.value
                state.stop_reason = stop
                return True
        return False

    def _add_logprobs(self, state: _RequestState, lp) -> None:
        sampled, sampled_lp = lp.token_ids[0], lp.logprobs[0]
        state.cumulative_logprob += sampled_lp
        entry = {sampled: Logprob(sampled_lp, lp.sampled_rank, self._decode(sampled))}
        for rank, (tok, val) in enumerate(zip(lp.token_ids[1:], lp.logprobs[1:]), start=1):
            entry.setdefault(tok, Logprob(val, rank, self._decode(tok)))
        state.logprobs.append(entry)

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    @staticmethod
    def _make_output(state: _RequestState) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=state.text,
            token_ids=list(state.token_ids),
            cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None,
            logprobs=state.logprobs,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt.prompt,
            prompt_token_ids=state.prompt.prompt_token_ids,
            outputs=[completion],
            finished=state.finish_reason is not None,
            num_cached_tokens=state.num_cached_tokens,
        )

"""Beam search as vLLM serves it: a loop outside the engine, one token per live beam per step.

Each step asks the engine for ONE token of every live beam (its prompt plus the beam's tokens, a
prefix the prefix cache already holds, so a step costs about one decode) with ``logprobs`` =
2 x ``beam_width``: those top candidates of every beam hold the step's best 2 x width continuations
overall. ``BeamSearch`` then applies transformers' rule (``generate(num_beams=w, do_sample=False)``):

1. rank the step's candidates (beam + token) by cumulative logprob and keep the best 2 x width;
2. a candidate that ends its sequence (EOS unless ``ignore_eos``, a ``stop_token_ids`` token, a
   ``stop`` string, or the last token ``max_tokens`` allows) becomes a finished hypothesis only if it
   ranks in the best ``width``; its score is ``cum_logprob / len(tokens) ** length_penalty`` (the
   generated tokens, the EOS included), and the ``width`` best finished hypotheses are kept;
3. the best ``width`` candidates that did not end are the next step's live beams;
4. the search ends at ``max_tokens``, when no beam is live, or when the live beams cannot beat the
   worst of ``width`` finished hypotheses: ``early_stopping`` as transformers' (False: judged at the
   current length; "never": at ``max_tokens`` when ``length_penalty`` > 0, so never too early;
   True: as soon as ``width`` hypotheses finished).

The finished hypotheses, best score first, are the result. Two drivers share this rule: the
gateway's (``beam_search`` below, for REST ``use_beam_search``) and ``LLM.beam_search``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from gridserve.services.gateway.service import gather_or_cancel
from gridserve.shared.errors import DeadlineExceededError, InvalidArgumentError
from gridserve.shared.outputs import CompletionOutput, FinishReason, RequestOutput
from gridserve.shared.sampling_params import SamplingParams

if TYPE_CHECKING:
    from gridserve.services.gateway.service import GatewayService

logger = logging.getLogger(__name__)

EarlyStopping = Union[bool, str]


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` (and transformers' ``early_stopping``, its default False)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise InvalidArgumentError("beam_width", f"must be at least 1, got {self.beam_width}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgumentError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.temperature != 0:
            raise InvalidArgumentError("temperature", "beam search ranks by the model's logprobs: only 0, "
                                                      f"got {self.temperature}")
        if self.early_stopping not in (True, False, "never"):
            raise InvalidArgumentError("early_stopping", f'true, false or "never", got {self.early_stopping!r}')
        if any(not s for s in self.stop):
            raise InvalidArgumentError("stop", "stop strings must be non-empty")

    def check_width(self, max_logprobs: int, field_name: str = "beam_width") -> None:
        """Each step asks for 2 x width logprobs: beyond ``max_logprobs`` a refusal naming the field."""
        if 2 * self.beam_width > max_logprobs:
            raise InvalidArgumentError(field_name, f"beam search asks the engine for 2 x {self.beam_width} logprobs "
                                                   f"a step; at most {max_logprobs // 2} (max_logprobs "
                                                   f"{max_logprobs})")

    def as_sampling(self) -> SamplingParams:
        """What the REST responses read of a request's parameters (``n``: the sequences per prompt)."""
        return SamplingParams(n=self.beam_width, temperature=0.0, max_tokens=self.max_tokens)

    def step_params(self) -> SamplingParams:
        """One step of one beam: the arg-max token and the 2 x width best candidates' logprobs."""
        return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2 * self.beam_width,
                              skip_special_tokens=self.skip_special_tokens)


@dataclass
class BeamSearchSequence:
    """One hypothesis: its generated tokens (the EOS or stop token that ended it included), their
    logprobs, and its ``score`` (``cum_logprob / len(tokens) ** length_penalty``, the rank)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    score: float = 0.0
    text: Optional[str] = None  # filled when returned (or cut at a stop string)
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def extended(self, token: int, logprob: float) -> BeamSearchSequence:
        return BeamSearchSequence(self.tokens + [token], self.logprobs + [logprob], self.cum_logprob + logprob)


@dataclass
class BeamSearchOutput:
    """vLLM's: one prompt's best sequences, best first (``prompt_token_ids``: the prompt as run)."""

    sequences: list[BeamSearchSequence]
    prompt_token_ids: list[int] = field(default_factory=list)


Candidates = dict[int, float]  # a live beam's next tokens -> their logprobs
Detokenize = Callable[[list[int]], str]


class BeamSearch:
    """One prompt's beams: ``live`` (best cumulative logprob first) and ``finished`` (best score
    first). ``advance`` takes each live beam's candidates and applies one step of the rule."""

    def __init__(self, params: BeamSearchParams, prompt_token_ids: list[int], eos_token_ids: Collection[int],
                 max_new_tokens: int, detokenize: Detokenize) -> None:
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.ending_tokens = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.max_new_tokens = min(params.max_tokens, max_new_tokens)
        self.detokenize = detokenize
        self.live = [BeamSearchSequence()]
        self.finished: list[BeamSearchSequence] = []
        self.done = self.max_new_tokens < 1

    def prompts(self) -> list[list[int]]:
        """What each live beam asks the engine to continue."""
        return [self.prompt_token_ids + beam.tokens for beam in self.live]

    def advance(self, candidates: Sequence[Candidates]) -> None:
        """One step: ``candidates[i]`` are live beam ``i``'s next tokens with their logprobs."""
        width = self.params.beam_width
        ranked = sorted(((beam.cum_logprob + lp, i, token) for i, (beam, options) in
                         enumerate(zip(self.live, candidates)) for token, lp in options.items()),
                        key=lambda c: -c[0])[:2 * width]
        length = len(self.live[0].tokens) + 1
        live: list[BeamSearchSequence] = []
        for rank, (_, i, token) in enumerate(ranked):
            if rank >= width and len(live) == width:
                break
            beam = self.live[i].extended(token, candidates[i][token])
            if self._ended(beam, last=length >= self.max_new_tokens):
                if rank < width:
                    self._finish(beam)
            elif len(live) < width:
                live.append(beam)
        self.live = live
        self.done = length >= self.max_new_tokens or not live or not self._can_improve(length)

    def results(self, n: Optional[int] = None) -> list[BeamSearchSequence]:
        """The best ``n`` (all kept: ``beam_width``) finished hypotheses, best first, with their text."""
        best = self.finished[:n]
        for seq in best:
            if seq.text is None:
                seq.text = self._text(seq.tokens)
        return best

    def _ended(self, beam: BeamSearchSequence, last: bool) -> bool:
        token = beam.tokens[-1]
        if token in self.ending_tokens:
            beam.finish_reason = FinishReason.STOP.value
            beam.stop_reason = token if token in self.params.stop_token_ids else None
            return True
        if self.params.stop and self._stop_string(beam):
            return True
        if last:
            beam.finish_reason = FinishReason.LENGTH.value
        return last

    def _stop_string(self, beam: BeamSearchSequence) -> bool:
        """Whether ``beam``'s text now holds a stop string; it is cut there (or after it)."""
        text = self._text(beam.tokens)
        found = [(at, stop) for stop in self.params.stop if (at := text.find(stop)) >= 0]
        if not found:
            return False
        at, stop = min(found)
        beam.text = text[:at + len(stop)] if self.params.include_stop_str_in_output else text[:at]
        beam.finish_reason, beam.stop_reason = FinishReason.STOP.value, stop
        return True

    def _text(self, tokens: list[int]) -> str:
        return self.detokenize([t for t in tokens if t not in self.ending_tokens])

    def _finish(self, beam: BeamSearchSequence) -> None:
        beam.score = beam.cum_logprob / len(beam.tokens) ** self.params.length_penalty
        self.finished.append(beam)
        self.finished.sort(key=lambda s: -s.score)
        del self.finished[self.params.beam_width:]

    def _can_improve(self, length: int) -> bool:
        """transformers' stopping test: can the best live beam still beat the worst finished one?"""
        params = self.params
        if len(self.finished) < params.beam_width:
            return True
        if params.early_stopping is True:
            return False
        if params.early_stopping == "never" and params.length_penalty > 0:
            length = self.max_new_tokens
        best_possible = self.live[0].cum_logprob / length ** params.length_penalty
        return best_possible > self.finished[-1].score


def candidates_of(out: RequestOutput, width: int) -> Candidates:
    """A one-token request's 2 x ``width`` best next tokens with their logprobs."""
    position = out.outputs[0].logprobs[0]
    best = sorted(position.items(), key=lambda item: -item[1].logprob)[:2 * width]
    return {token: lp.logprob for token, lp in best}


def as_request_output(request_id: str, prompt: Optional[str], search: BeamSearch,
                      n: Optional[int] = None) -> RequestOutput:
    """The search's best ``n`` sequences as one request's samples (the REST responses' input)."""
    outputs = [CompletionOutput(i, seq.text, seq.tokens, seq.cum_logprob, None, seq.finish_reason, seq.stop_reason)
               for i, seq in enumerate(search.results(n))]
    return RequestOutput(request_id, prompt, search.prompt_token_ids, outputs, finished=True)


async def search_all(service: GatewayService, prompts: list[Any], params: BeamSearchParams, traceparent: str = "",
                     data_parallel_rank: Optional[int] = None, timeout: Optional[float] = None,
                     lora_name: Optional[str] = None, priority: int = 0,
                     cache_salt: Optional[str] = None) -> list[RequestOutput]:
    """A REST request's beam searches, one per prompt, side by side (``n`` = width sequences each,
    counted against ``--max-sequences-per-request``); ``lora_name``: the LoRA adapter they run on,
    ``priority`` their rank on a priority-scheduling engine, ``cache_salt`` their prefix-cache salt."""
    service.limits.open_request(len(prompts), params.beam_width)
    return await gather_or_cancel(beam_search(service, p, params, traceparent, data_parallel_rank, timeout, lora_name,
                                              priority, cache_salt) for p in prompts)


async def beam_search(service: GatewayService, prompt: Any, params: BeamSearchParams, traceparent: str = "",
                      data_parallel_rank: Optional[int] = None, timeout: Optional[float] = None,
                      lora_name: Optional[str] = None, priority: int = 0,
                      cache_salt: Optional[str] = None) -> RequestOutput:
    """One prompt's beam search through the gateway's engines: each step, one one-token request per
    live beam, all at once. ``timeout`` (or ``--request-timeout``) bounds the whole search."""
    if isinstance(prompt, dict) and "multi_modal_data" in prompt:
        raise InvalidArgumentError("use_beam_search", "beam search takes text-only prompts (no images)")
    loop = asyncio.get_running_loop()
    limit = min([t for t in (timeout, service.limits.request_timeout or None) if t is not None], default=None)
    deadline = None if limit is None else loop.time() + limit
    step = params.step_params()
    adapter: dict[str, Any] = {"lora_name": lora_name} if lora_name else {}
    if priority:
        adapter["priority"] = priority
    if cache_salt is not None:
        adapter["cache_salt"] = cache_salt

    async def one_token(beam_prompt: Any) -> RequestOutput:
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            raise DeadlineExceededError(f"the beam search took longer than {limit:g} s")
        return await service.complete(beam_prompt, step, "", traceparent, data_parallel_rank, left, **adapter)

    first = await one_token(prompt)
    eos = service.tokenizer.eos_token_id
    search = BeamSearch(params, first.prompt_token_ids, () if eos is None else (eos,),
                        service.max_model_len - len(first.prompt_token_ids),
                        lambda ids: service.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens))
    outs = [first]
    while True:
        await service.run_blocking(search.advance, [candidates_of(o, params.beam_width) for o in outs])
        if search.done:
            break
        outs = await gather_or_cancel(one_token({"prompt_token_ids": p}) for p in search.prompts())
    await service.run_blocking(search.results)
    prompt_text = prompt if isinstance(prompt, str) else None
    return as_request_output(first.request_id or f"beam-{uuid.uuid4().hex}", prompt_text, search)



"""``SamplingParams``: how to pick tokens and when to stop, with vLLM's names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from gridserve.shared.errors import InvalidArgumentError

_GREEDY_EPS = 1e-5


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, a regex, one of several choices or a grammar.

    Exactly one of ``json``, ``json_object``, ``regex``, ``choice`` or ``grammar`` is set.
    ``json`` is a JSON schema (a dict or its JSON text); ``grammar`` is an EBNF (GBNF) grammar.
    """

    json: Optional[Union[dict, str]] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None

    def __post_init__(self) -> None:
        chosen = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            chosen.append("json_object")
        if len(chosen) != 1:
            raise InvalidArgumentError(
                "sampling_params.structured_outputs",
                f"set exactly one of json, json_object, regex, choice, grammar (got {chosen or 'none'})",
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidArgumentError("sampling_params.structured_outputs.choice", "must be non-empty strings")

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters, with vLLM's names, defaults and semantics."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    bad_words: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    truncate_prompt_tokens: Optional[int] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Filled by the gateway: ``bad_words`` tokenized (with and without a leading space).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"sampling_params.{name}", why)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        # NaN passes every range check below (all comparisons with it are false): refuse it first.
        for name in _FLOAT_FIELDS:
            if not math.isfinite(getattr(self, name)):
                raise bad(name, f"must be a finite number, got {getattr(self, name)}")
        if self.logit_bias and not all(math.isfinite(v) for v in self.logit_bias.values()):
            raise bad("logit_bias", "values must be finite numbers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        if self.temperature < 0:
            raise bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be -1 or 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise bad(name, f"must be non-negative, got {value}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise bad("truncate_prompt_tokens", f"must be at least 1, got {self.truncate_prompt_tokens}")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise bad("allowed_token_ids", "must not be empty")
        if not self.detokenize and self.stop:
            raise bad("stop", "stop strings need detokenize=True")

    @property
    def greedy(self) -> bool:
        """True when the request takes the arg-max token at every step."""
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

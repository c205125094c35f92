"""``SamplingParams``: how to pick tokens and when to stop, with vLLM's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from gridserve.shared.errors import InvalidArgumentError

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters (a subset of vLLM's, same semantics)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"sampling_params.{name}", why)

        if self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        if self.n != 1:
            raise bad("n", "n > 1 is not supported yet")
        if self.temperature < 0:
            raise bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be 0 or -1 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", f"must be non-negative, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        """True when the request takes the arg-max token at every step."""
        return self.temperature < _GREEDY_EPS

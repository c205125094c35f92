"""``check_request``: the engine's own check of what a gateway sends, before it reaches the scheduler.

The gateway validates every request too, but the engine does not trust its callers: both run the
one shared check (``gridserve.shared.request_checks``), here with this engine's limits. Each
failure is ``InvalidArgumentError`` naming the field (INVALID_ARGUMENT for the caller); the engine
goes on serving. Sampling values themselves are range checked when ``SamplingParams`` is built
from the message.
"""

from __future__ import annotations

from gridserve.shared import request_checks
from gridserve.shared.config import GridserveConfig
from gridserve.shared.sampling_params import SamplingParams


def check_request(config: GridserveConfig, prompt_token_ids: list[int], params: SamplingParams) -> None:
    """``shared.request_checks.check_request`` against ``config.model``'s vocabulary and limits."""
    model = config.model
    request_checks.check_request(prompt_token_ids, params, vocab_size=model.vocab_size,
                                 max_model_len=model.max_model_len or 0, max_logprobs=model.max_logprobs)


def check_prompt_ids(config: GridserveConfig, prompt_token_ids: list[int]) -> None:
    """A pooling request's prompt: token ids in the vocabulary (its length: ``core.check_runner``)."""
    request_checks.in_vocab("prompt_token_ids", prompt_token_ids, config.model.vocab_size)

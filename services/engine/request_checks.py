"""``check_request``: the engine's own check of what a gateway sends, before it reaches the scheduler.

The gateway validates every request too, but the engine does not trust its callers: a token id
outside the vocabulary would index past the embedding table on the workers, a prompt longer than
``max_model_len`` past the KV cache. Each failure is ``InvalidArgumentError`` naming the field
(INVALID_ARGUMENT for the caller); the engine goes on serving. Sampling values themselves are range
checked when ``SamplingParams`` is built from the message.
"""

from __future__ import annotations

from collections.abc import Iterable

from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.sampling_params import SamplingParams


def check_request(config: GridserveConfig, prompt_token_ids: list[int], params: SamplingParams) -> None:
    model = config.model
    vocab = model.vocab_size
    max_len = model.max_model_len or 0
    if not prompt_token_ids:
        raise InvalidArgumentError("prompt_token_ids", "must not be empty")
    if max_len and len(prompt_token_ids) >= max_len:
        raise InvalidArgumentError("prompt_token_ids", f"{len(prompt_token_ids)} tokens leave no room for "
                                                       f"output within max_model_len={max_len}")
    if max_len and params.max_tokens is not None and len(prompt_token_ids) + params.max_tokens > max_len:
        raise InvalidArgumentError("sampling_params.max_tokens",
                                   f"{params.max_tokens} after a {len(prompt_token_ids)}-token prompt exceeds "
                                   f"max_model_len={max_len}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > model.max_logprobs:
            raise InvalidArgumentError(f"sampling_params.{name}",
                                       f"{value} exceeds max_logprobs={model.max_logprobs}")
    if vocab <= 0:
        return
    _in_vocab("prompt_token_ids", prompt_token_ids, vocab)
    _in_vocab("sampling_params.stop_token_ids", params.stop_token_ids, vocab)
    _in_vocab("sampling_params.allowed_token_ids", params.allowed_token_ids or (), vocab)
    _in_vocab("sampling_params.logit_bias", (params.logit_bias or {}).keys(), vocab)
    for word in params.bad_words_token_ids:
        _in_vocab("sampling_params.bad_words_token_ids", word, vocab)


def _in_vocab(field: str, ids: Iterable[int], vocab: int) -> None:
    for token in ids:
        if not 0 <= token < vocab:
            raise InvalidArgumentError(field, f"token id {token} is outside the vocabulary [0, {vocab})")

"""``check_request``: one request's token ids and sampling values against the model's limits.

The gateway calls it on every request it tokenized, and the engine again on every request a
gateway sends (the engine trusts no caller: a token id outside the vocabulary would index past the
embedding table on the workers, a prompt of ``max_model_len`` tokens past the KV cache). Both pass
the limits as numbers (the gateway has them from the engine's ``GetInfo``, not a
``GridserveConfig``). Each failure is ``InvalidArgumentError`` naming the field (INVALID_ARGUMENT /
HTTP 400 for the caller). Values ``SamplingParams`` checks on its own (ranges, ``min_tokens <=
max_tokens``) are not checked again here.
"""

from __future__ import annotations

from collections.abc import Iterable

from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.sampling_params import SamplingParams

# vLLM's ``cache_salt``: a non-empty string mixed into the first prefix-cache block's hash.
MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(salt: str) -> None:
    """A request's ``cache_salt``: 1 to ``MAX_CACHE_SALT_CHARS`` characters."""
    if not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise InvalidArgumentError("cache_salt", f"must be 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}")


def check_request(prompt_token_ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
                  max_logprobs: int, prompt_field: str = "prompt_token_ids") -> None:
    """Raise ``InvalidArgumentError`` unless the prompt is non-empty and leaves room for output
    within ``max_model_len``, ``min_tokens`` / ``max_tokens`` fit in that room, ``logprobs`` /
    ``prompt_logprobs`` are at most ``max_logprobs``, and every token id (prompt, stop, allowed,
    logit-bias and bad-word ids) is an int in ``[0, vocab_size)``.

    ``vocab_size`` / ``max_model_len`` of 0: unknown, not checked. ``prompt_field``: the field an
    empty or too long prompt is reported as (the gateway's callers sent a ``prompt``; a prompt's
    bad token ids are always ``prompt_token_ids``).
    """
    if not prompt_token_ids:
        raise InvalidArgumentError(prompt_field, "the prompt is empty")
    if max_model_len:
        _check_lengths(len(prompt_token_ids), params, max_model_len, prompt_field)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise InvalidArgumentError(f"sampling_params.{name}", f"{value} exceeds max_logprobs={max_logprobs}")
    if vocab_size <= 0:
        return
    in_vocab("prompt_token_ids", prompt_token_ids, vocab_size)
    in_vocab("sampling_params.stop_token_ids", params.stop_token_ids, vocab_size)
    in_vocab("sampling_params.allowed_token_ids", params.allowed_token_ids or (), vocab_size)
    in_vocab("sampling_params.logit_bias", (params.logit_bias or {}).keys(), vocab_size)
    for word in params.bad_words_token_ids:
        in_vocab("sampling_params.bad_words_token_ids", word, vocab_size)


def _check_lengths(prompt_len: int, params: SamplingParams, max_model_len: int, prompt_field: str) -> None:
    room = max_model_len - prompt_len
    if room <= 0:
        raise InvalidArgumentError(prompt_field, f"the prompt has {prompt_len} tokens; max_model_len={max_model_len} "
                                                 "leaves no room for output")
    if params.min_tokens > room:
        raise InvalidArgumentError("sampling_params.min_tokens",
                                   f"{params.min_tokens} exceeds the {room} tokens the {prompt_len}-token prompt "
                                   f"leaves within max_model_len={max_model_len}")
    if params.max_tokens is not None and params.max_tokens > room:
        raise InvalidArgumentError("sampling_params.max_tokens",
                                   f"{params.max_tokens} after a {prompt_len}-token prompt exceeds "
                                   f"max_model_len={max_model_len}")


def in_vocab(field: str, ids: Iterable[int], vocab_size: int) -> None:
    for token in ids:
        if not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidArgumentError(field, f"token id {token} is outside the vocabulary [0, {vocab_size})")

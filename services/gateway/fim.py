"""Fill in the middle: a completions request's ``suffix``, for tokenizers that have FIM tokens.

A code model trained for infilling reads ``<prefix> PROMPT <suffix> SUFFIX <middle>`` and writes
what goes between (the prefix-suffix-middle order all of these use). The tokens differ by family;
a tokenizer with none of these triples cannot infill, and ``suffix`` is refused naming the field.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from gridserve.shared.errors import InvalidArgumentError

# (prefix, suffix, middle) tokens, by family
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),  # CodeLlama
)


def fim_token_ids(tokenizer: Any) -> Optional[tuple[int, int, int]]:
    """The tokenizer's (prefix, suffix, middle) token ids, or None when it has no FIM tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    for names in FIM_TOKENS:
        ids = [backend.token_to_id(name) for name in names]
        if all(i is not None for i in ids):
            return ids[0], ids[1], ids[2]
    return None


def fill_in_the_middle(tokenizer: Any, prompt: Union[str, list[int]], suffix: str) -> list[int]:
    """The infilling prompt's token ids for ``prompt`` (text or token ids) before ``suffix``."""
    ids = fim_token_ids(tokenizer)
    if ids is None:
        raise InvalidArgumentError("suffix", "the model's tokenizer has no fill-in-the-middle tokens "
                                   "(e.g. <|fim_prefix|>), so it cannot complete between a prompt and a suffix")
    prefix_token, suffix_token, middle_token = ids
    head = tokenizer.encode("", add_special_tokens=True)  # BOS, for the tokenizers that add one
    before = tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
    after = tokenizer.encode(suffix, add_special_tokens=False)
    return [*head, prefix_token, *before, suffix_token, *after, middle_token]

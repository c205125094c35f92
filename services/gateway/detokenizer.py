"""Incremental detokenization with the ``tokenizers`` library's ``DecodeStream``.

Text is emitted only once it is valid UTF-8: a character split over several byte-level tokens
appears when its last byte arrives.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, chunk by chunk."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._backend = backend_tokenizer(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""

    def step(self, token_id: int) -> str:
        """Feed one token; return the text it completes (possibly empty)."""
        chunk = self._stream.step(self._backend, token_id) or ""
        self.text += chunk
        return chunk


def backend_tokenizer(tokenizer: Any):
    """The ``tokenizers.Tokenizer`` behind a transformers fast tokenizer (or the object itself)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__} is not backed by a `tokenizers` fast tokenizer")
    return backend

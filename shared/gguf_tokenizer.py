"""A GGUF file's embedded tokenizer as a Hugging Face fast tokenizer (``tokenizers``; no torch).

llama.cpp stores the vocabulary in ``tokenizer.ggml.*``: the model (``gpt2``: byte-level BPE with
``merges``; ``llama``: SentencePiece BPE, merges implied by the tokens' ``scores``), the
pre-tokenizer's name (``pre``), the tokens with their types (normal, control,
user-defined, ...), the special token ids and whether a BOS / EOS is added, plus the chat template
(``tokenizer.chat_template``). ``tokenizer_from_gguf`` rebuilds the equivalent ``tokenizers.Tokenizer``
and a ``tokenizer_config.json``-like dict (special tokens, chat template) for the gateway's
``GatewayTokenizer`` and, in the roles that have transformers, a ``PreTrainedTokenizerFast``.
A model or pre-tokenizer not known here is a ``ConfigError`` naming the file and the field.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gridserve.shared.errors import ConfigError
from gridserve.shared.gguf_config import read_gguf

# llama.cpp's token types (llama_token_type / gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# ``tokenizer.ggml.model``: byte-level BPE (GPT-2 style) and SentencePiece BPE (llama / Mistral).
TOKENIZER_MODELS = ("gpt2", "llama")
# llama.cpp's byte-level BPE pre-tokenizer names gridserve reproduces (``tokenizer.ggml.pre``).
BPE_PRE_TOKENIZERS = ("default", "gpt2", "smollm", "qwen2")
# Qwen2's split (its tokenizer.json / transformers' Qwen2Tokenizer): one digit at a time, letters
# with one leading non-letter, punctuation runs with their newlines.
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


@dataclass
class GgufTokenizer:
    """The converted tokenizer: the ``tokenizers`` object and a tokenizer_config.json-like dict."""

    tokenizer: Any  # tokenizers.Tokenizer
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def chat_template(self) -> Optional[str]:
        return self.config.get("chat_template")

    def special_tokens(self) -> dict[str, str]:
        """``bos_token`` / ``eos_token`` / ``unk_token`` / ``pad_token`` that the file names."""
        return {k: self.config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                if self.config.get(k)}


def tokenizer_from_gguf(path: str) -> GgufTokenizer:
    """Convert the tokenizer embedded in the GGUF file at ``path`` (cached until the file changes)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError("tokenizer", f"GGUF file {path!r} does not exist")
    stat = file.stat()
    return _convert(str(file.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _convert(path: str, size: int, mtime_ns: int) -> GgufTokenizer:
    gguf_file = read_gguf(path)

    def get(key: str, default: Any = None) -> Any:
        return gguf_file.get(f"tokenizer.ggml.{key}", default)

    model = get("model")
    if model is None:
        raise ConfigError("tokenizer", f"{path!r} has no embedded tokenizer (tokenizer.ggml.model); "
                                       "pass --tokenizer with a Hugging Face tokenizer folder")
    if model not in TOKENIZER_MODELS:
        raise ConfigError("tokenizer", f"{path!r}: tokenizer.ggml.model {model!r} is not supported "
                                       f"(supported: {', '.join(TOKENIZER_MODELS)}); pass --tokenizer "
                                       "with a Hugging Face tokenizer folder")
    tokens: list[str] = get("tokens") or []
    types: list[int] = get("token_type") or [NORMAL] * len(tokens)
    if not tokens or len(types) != len(tokens):
        raise ConfigError("tokenizer", f"{path!r}: tokenizer.ggml.tokens / token_type are missing or "
                                       "of different lengths")

    def token(key: str) -> Optional[str]:
        index = get(key)
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    if model == "gpt2":
        tokenizer = _byte_level_bpe(path, tokens, _merge_pairs(path, get("merges") or []), get("pre", "default"))
    else:  # "llama": SentencePiece BPE
        scores = get("scores")
        merges = get("merges")
        if merges is None and (scores is None or len(scores) != len(tokens)):
            raise ConfigError("tokenizer", f"{path!r}: a 'llama' tokenizer needs tokenizer.ggml.scores "
                                           "(one per token) or tokenizer.ggml.merges")
        pairs = _merge_pairs(path, merges) if merges is not None else _merges_from_scores(tokens, scores)
        tokenizer = _sentencepiece_bpe(tokens, pairs, token("unknown_token_id"),
                                       bool(get("add_space_prefix", True)))
    _add_special_tokens(tokenizer, tokens, types)
    bos, eos = token("bos_token_id"), token("eos_token_id")
    # llama.cpp adds a BOS to a SentencePiece vocabulary unless the file says not to.
    add_bos = bool(get("add_bos_token", model == "llama"))
    add_eos = bool(get("add_eos_token", False))
    _post_processor(tokenizer, bos if add_bos else None, eos if add_eos else None)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "chat_template": gguf_file.get("tokenizer.chat_template"),
    }
    context = gguf_file.get(f"{gguf_file.get('general.architecture')}.context_length")
    if context is not None:
        config["model_max_length"] = int(context)
    return GgufTokenizer(tokenizer, config)


def _merge_pairs(path: str, merges: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ConfigError("tokenizer", f"{path!r}: tokenizer.ggml.merges entry {merge!r} is not 'a b'")
        pairs.append((left, right))
    return pairs


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """A SentencePiece BPE vocabulary's merges, implied by its scores (llama.cpp merges the pair
    whose joined token scores highest): every split of every token into two vocabulary tokens,
    ranked by the joined token's score (then longer left / right part first); ties keep vocabulary
    order (the pieces' ids). transformers derives the same list."""
    ids = {text: i for i, text in enumerate(tokens)}
    candidates = []
    for i, (text, score) in enumerate(zip(tokens, scores)):
        if ids.get(text) != i:
            continue  # a duplicate spelling: the last one is the token
        local = [(text[:k], text[k:]) for k in range(1, len(text)) if text[:k] in ids and text[k:] in ids]
        local.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        candidates.extend((float(score), pair) for pair in local)
    # A stable sort on descending keys, as the merges' tie order matters.
    candidates.sort(key=lambda c: (c[0], len(c[1][0]), len(c[1][1])), reverse=True)
    return [pair for _, pair in candidates]


def _sentencepiece_bpe(tokens: list[str], pairs: list[tuple[str, str]], unk: Optional[str],
                       add_space_prefix: bool) -> Any:
    """llama's SentencePiece BPE: spaces as U+2581, a leading one added to the text's start, bytes
    missing from the vocabulary as ``<0xNN>`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {text: i for i, text in enumerate(tokens)}  # a duplicate spelling: the last id (llama.cpp)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True,
                                     byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _byte_level_bpe(path: str, tokens: list[str], pairs: list[tuple[str, str]], pre: str) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    if pre not in BPE_PRE_TOKENIZERS:
        raise ConfigError("tokenizer", f"{path!r}: tokenizer.ggml.pre {pre!r} is not supported "
                                       f"(supported: {', '.join(BPE_PRE_TOKENIZERS)}); pass --tokenizer "
                                       "with a Hugging Face tokenizer folder")
    vocab = {text: i for i, text in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # llama.cpp: one digit at a time, then GPT-2's split
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre == "qwen2":  # NFC, Qwen2's split, bytes mapped without a second split
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:  # "gpt2" / "default": GPT-2's split
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _add_special_tokens(tokenizer: Any, tokens: list[str], types: list[int]) -> None:
    """Control / unknown tokens become special added tokens, user-defined ones plain added tokens
    (matched whole before the BPE, as in llama.cpp)."""
    from tokenizers import AddedToken

    special = [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types)
               if kind in (CONTROL, UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, types)
            if kind == USER_DEFINED]
    if special:
        tokenizer.add_special_tokens(special)
    if user:
        tokenizer.add_tokens(user)


def _post_processor(tokenizer: Any, bos: Optional[str], eos: Optional[str]) -> None:
    from tokenizers import processors

    if bos is None and eos is None:
        return
    prefix = [bos] if bos else []
    suffix = [eos] if eos else []
    single = " ".join(prefix + ["$A"] + suffix)
    pair = " ".join(prefix + ["$A"] + suffix + prefix + ["$B:1"] + suffix)
    ids = [(t, tokenizer.token_to_id(t)) for t in dict.fromkeys(prefix + suffix)]
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)


"""The request sets of ``gridserve bench serve``: random prompts of chosen lengths, a JSON file, or
``prefix-repetition`` (many users sharing a few long system prompts: cache-aware routing's workload).

A random prompt is a list of token ids drawn from a :class:`Vocabulary`. With the model's
tokenizer (``TokenizerVocabulary``) the ids are the model's own, so a completions request can send
them as they are (``prompt`` as a token-id list: exact lengths) or as their decoded text (chat, or
a server that takes only text; the length is then close, not exact). Without a tokenizer,
``WordVocabulary`` draws common short words that most tokenizers encode as one token each, so a
prompt of ``n`` words is about ``n`` tokens; the server's ``usage`` gives the real count.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol, Union

logger = logging.getLogger(__name__)

Prompt = Union[str, list[int]]

DATASETS = ("random", "file", "prefix-repetition")

_WORDS = (
    "the of and to in is for that with as on by this it be are from or an not at all one can "
    "has was will if else def return self import None True False class print value data list name "
    "type file path error line code time int str len key new set get run test start end next item "
    "size text case read write open close step model token batch cache block page"
).split()


@dataclass(frozen=True)
class BenchRequest:
    """One request of the set: its prompt, prompt length in tokens and wanted output length."""

    prompt: Prompt
    prompt_len: int
    output_len: int


class Vocabulary(Protocol):
    """Where random prompts come from: ids to draw from and the text they stand for."""

    #: True when the ids are the model's token ids (they may be sent as a token-id prompt).
    model_ids: bool

    def ids(self) -> list[int]: ...

    def to_text(self, ids: list[int]) -> str: ...

    def count(self, text: str) -> int: ...


class TokenizerVocabulary:
    """The model's tokenizer (``tokenizer.json``, or a ``.gguf`` file's): every id but the special / added ones."""

    model_ids = True

    def __init__(self, path: Union[str, Path]) -> None:
        from tokenizers import Tokenizer

        file = Path(path)
        if file.suffix == ".gguf":  # the tokenizer embedded in a GGUF checkpoint
            from gridserve.shared.gguf_tokenizer import tokenizer_from_gguf

            self._tokenizer = tokenizer_from_gguf(str(file)).tokenizer
        else:
            self._tokenizer = Tokenizer.from_file(str(file / "tokenizer.json" if file.is_dir() else file))
        special = set(self._tokenizer.get_added_tokens_decoder())
        self._ids = [i for i in range(self._tokenizer.get_vocab_size()) if i not in special]

    def ids(self) -> list[int]:
        return self._ids

    def to_text(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


class WordVocabulary:
    """No tokenizer: short common words, each about one token in most tokenizers."""

    model_ids = False

    def ids(self) -> list[int]:
        return list(range(len(_WORDS)))

    def to_text(self, ids: list[int]) -> str:
        return " ".join(_WORDS[i] for i in ids)

    def count(self, text: str) -> int:
        return len(text.split())


def find_tokenizer(*candidates: Optional[str]) -> Optional[Path]:
    """The first candidate that is a local ``tokenizer.json`` or a folder holding one."""
    for candidate in candidates:
        if not candidate:
            continue
        path = Path(candidate).expanduser()
        if path.is_file() and path.name == "tokenizer.json":
            return path
        if (path / "tokenizer.json").is_file():
            return path / "tokenizer.json"
    return None


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """The inclusive range of lengths around ``length``: ``[L * (1 - r), L * (1 + r)]``, rounded
    to integers, at least 1 (vLLM's ``--random-range-ratio``)."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    return max(1, round(length * (1 - range_ratio))), max(1, round(length * (1 + range_ratio)))


def random_requests(
    num_prompts: int,
    vocabulary: Vocabulary,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    output_range_ratio: Optional[float] = None,
    as_text: bool = False,
) -> list[BenchRequest]:
    """``num_prompts`` random prompts: a shared prefix of ``prefix_len`` ids, then a random part
    whose length is uniform in :func:`length_range`; output lengths likewise (with
    ``output_range_ratio``, default ``range_ratio``). The same arguments give the same set.

    Prompts are token-id lists when the vocabulary holds the model's ids and ``as_text`` is false,
    else text (``prompt_len`` is then the number of ids drawn, an estimate).
    """
    out_ratio = range_ratio if output_range_ratio is None else output_range_ratio
    return uniform_requests(num_prompts, vocabulary, length_range(input_len, range_ratio),
                            length_range(output_len, out_ratio), prefix_len, seed, as_text)


def uniform_requests(
    num_prompts: int,
    vocabulary: Vocabulary,
    input_lens: tuple[int, int],
    output_lens: tuple[int, int],
    prefix_len: int = 0,
    seed: int = 0,
    as_text: bool = False,
) -> list[BenchRequest]:
    """``num_prompts`` random prompts whose random part's length is uniform in the inclusive range
    ``input_lens`` (after a shared prefix of ``prefix_len`` ids), output lengths uniform in
    ``output_lens``; :func:`random_requests` with the ranges given as they are."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {prefix_len}")
    for name, (lo, hi) in (("input", input_lens), ("output", output_lens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} lengths: expected 1 <= min <= max, got {lo}-{hi}")
    rng = random.Random(seed)
    pool = vocabulary.ids()
    prefix = rng.choices(pool, k=prefix_len)
    requests = []
    for _ in range(num_prompts):
        ids = prefix + rng.choices(pool, k=rng.randint(*input_lens))
        prompt: Prompt = ids if vocabulary.model_ids and not as_text else vocabulary.to_text(ids)
        requests.append(BenchRequest(prompt, len(ids), rng.randint(*output_lens)))
    return requests


def file_requests(
    path: Union[str, Path],
    vocabulary: Vocabulary,
    default_output_len: int,
    num_prompts: Optional[int] = None,
    as_text: bool = False,
) -> list[BenchRequest]:
    """Requests from a JSON file: a list of prompt strings, or of objects with ``prompt`` (a string
    or token ids) and an optional ``output_len`` (default ``default_output_len``). The first
    ``num_prompts`` are taken (all when ``None``); token-id prompts become text when ``as_text``."""
    try:
        items = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--dataset-path {path}: cannot read a JSON list of prompts ({exc})") from None
    if not isinstance(items, list) or not items:
        raise ValueError(f"--dataset-path {path}: expected a non-empty JSON list of prompts")
    requests = []
    for i, item in enumerate(items[:num_prompts]):
        entry = {"prompt": item} if isinstance(item, str) else item
        prompt = entry.get("prompt") if isinstance(entry, dict) else None
        output_len = entry.get("output_len", default_output_len) if isinstance(entry, dict) else None
        if not _valid_prompt(prompt) or not isinstance(output_len, int) or output_len < 1:
            raise ValueError(f"--dataset-path {path}: item {i}: expected a prompt string or "
                             "{\"prompt\": string or token ids, \"output_len\"?: int >= 1}")
        if isinstance(prompt, list) and as_text:
            if not vocabulary.model_ids:
                raise ValueError(f"--dataset-path {path}: item {i}: a token-id prompt sent as text "
                                 "needs the model's tokenizer (--tokenizer)")
            prompt = vocabulary.to_text(prompt)
            prompt_len = len(entry["prompt"])
        else:
            prompt_len = len(prompt) if isinstance(prompt, list) else vocabulary.count(prompt)
        requests.append(BenchRequest(prompt, prompt_len, output_len))
    if num_prompts is not None and len(requests) < num_prompts:
        logger.warning("--dataset-path %s has %d prompts, fewer than --num-prompts %d",
                       path, len(requests), num_prompts)
    return requests


def _valid_prompt(prompt: object) -> bool:
    if isinstance(prompt, str):
        return bool(prompt)
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def prefix_repetition_requests(
    num_prompts: int,
    vocabulary: Vocabulary,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
    as_text: bool = False,
) -> list[BenchRequest]:
    """``num_prompts`` requests of many users sharing a few system prompts: ``num_prefixes`` random
    prefixes of ``prefix_len`` ids, each the start of an equal share of the requests (the first
    ones get one more when it does not divide), then a random suffix of ``suffix_len`` ids per
    request (the user's own part); ``output_len`` tokens each. The requests come in a seeded random
    order, so every prefix recurs throughout the run."""
    for flag, value in (("--num-prompts", num_prompts), ("--prefix-repetition-prefix-len", prefix_len),
                        ("--prefix-repetition-num-prefixes", num_prefixes),
                        ("--prefix-repetition-output-len", output_len)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if suffix_len < 0:
        raise ValueError(f"--prefix-repetition-suffix-len must be >= 0, got {suffix_len}")
    rng = random.Random(seed)
    pool = vocabulary.ids()
    prefixes = [rng.choices(pool, k=prefix_len) for _ in range(num_prefixes)]
    owners = [i % num_prefixes for i in range(num_prompts)]
    rng.shuffle(owners)
    requests = []
    for owner in owners:
        ids = prefixes[owner] + rng.choices(pool, k=suffix_len)
        prompt: Prompt = ids if vocabulary.model_ids and not as_text else vocabulary.to_text(ids)
        requests.append(BenchRequest(prompt, len(ids), output_len))
    return requests


def add_dataset_arguments(group: argparse._ArgumentGroup) -> None:
    """``--dataset`` and the ``prefix-repetition`` set's options (``gridserve bench serve``)."""
    group.add_argument("--dataset", default="random", choices=DATASETS,
                       help="'file' needs --dataset-path (given alone, it implies 'file'); 'prefix-repetition': "
                            "a few shared system prompts, each followed by a user's own suffix")
    group.add_argument("--prefix-repetition-prefix-len", type=int, default=256,
                       help="prefix-repetition: tokens of each shared prefix")
    group.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                       help="prefix-repetition: tokens of each request's own suffix")
    group.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                       help="prefix-repetition: distinct prefixes the requests share (evenly)")
    group.add_argument("--prefix-repetition-output-len", type=int, default=128,
                       help="prefix-repetition: output tokens per request")


def prefix_repetition_from_args(args: argparse.Namespace, vocabulary: Vocabulary, seed: int,
                                as_text: bool) -> list[BenchRequest]:
    """The ``prefix-repetition`` set the options of :func:`add_dataset_arguments` describe."""
    return prefix_repetition_requests(args.num_prompts, vocabulary, args.prefix_repetition_prefix_len,
                                      args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
                                      args.prefix_repetition_output_len, seed, as_text)

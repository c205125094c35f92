"""Structured output specs compiled to llguidance grammars (torch-free: the gateway uses it too).

A :class:`~gridserve.shared.sampling_params.StructuredOutputsParams` becomes one llguidance
grammar string: a JSON schema (``json``), any JSON object (``json_object``), a regex, a choice
among literal strings, or an EBNF grammar (llama.cpp GBNF or Lark syntax). Compiling is cached per
distinct spec, and so is validation against a tokenizer, so repeated specs cost nothing.

Bounds: the gateway caps a spec's size (``--max-structured-output-chars``); compiling and
validating it runs under llguidance's resource limits (``GRAMMAR_LIMITS``: grammar symbols, lexer
states, lexer "fuel" spent building the regex ASTs), so no spec of that size compiles for long; a
spec past them is refused (400 naming ``structured_outputs.<kind>``). The lexer is built lazily,
and each step's mask is bounded by the per-step fuel of the same limits.

A constraint can start after a free prefix (``after_prefix``): a reasoning model's thinking, which
the gateway describes as Lark rules; the result is one Lark grammar (``grammar``) in which the
constraint is nested (``%json`` / ``%lark``), so structured output and forced tool calls apply
from the end of the reasoning on, with nothing for the worker to know about reasoning.

JSON is generated without free whitespace, with ``json.dumps``'s separators (``", "`` and
``": "``): free whitespace lets a model wander forever. A schema may override this with llguidance's
``"x-guidance"`` key (e.g. ``{"whitespace_flexible": true}``).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from functools import lru_cache
from typing import Any, Optional

import llguidance

from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FIELD = "sampling_params.structured_outputs"
_CACHE_SIZE = 256
# llguidance's resource limits, written out (its defaults): what bounds a grammar's compile time.
GRAMMAR_LIMITS = llguidance.LLParserLimits(
    max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
    max_lexer_states=250_000, max_grammar_size=500_000, verbose_errors=False)

_tokenizer_lock = threading.Lock()
# (id(tokenizer), n_vocab, eos) -> (tokenizer, its LLTokenizer); holding the tokenizer keeps its id unique
_TokKey = tuple[int, Optional[int], Optional[int]]
_ll_tokenizers: dict[_TokKey, tuple[Any, llguidance.LLTokenizer]] = {}


def spec_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """A hashable key for a spec, ``(kind, text)``; JSON keys keep their order (generation follows it)."""
    kind = params.kind
    if kind == "json_object":
        return kind, ""
    value = getattr(params, kind)
    if isinstance(value, str):
        return kind, value
    if kind in ("json", "choice"):
        try:
            return kind, json.dumps(value if kind == "json" else list(value))
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"{_FIELD}.{kind}", f"not JSON-serializable: {e}") from None
    raise InvalidArgumentError(f"{_FIELD}.{kind}", f"must be a string, got {type(value).__name__}")


def compile_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``params`` (cached). Raises ``InvalidArgumentError`` on a bad spec."""
    return _compile(*spec_key(params))


@lru_cache(maxsize=_CACHE_SIZE)
def _compile(kind: str, text: str) -> str:
    try:
        return _to_grammar(kind, text)
    except InvalidArgumentError:
        raise
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{_FIELD}.{kind}", str(e)) from None


def _to_grammar(kind: str, text: str) -> str:
    field = f"{_FIELD}.{kind}"
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=JSON_DEFAULTS
        )
    if kind == "json":
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise InvalidArgumentError(field, f"not valid JSON: {e}") from None
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise InvalidArgumentError(
                field, f"a JSON schema is an object, got {type(schema).__name__}"
            )
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        choices = json.loads(text)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices)
        )
    if kind == "grammar":
        return llguidance.grammar_from("grammar", text)  # GBNF is converted to Lark
    raise InvalidArgumentError(_FIELD, f"unknown kind {kind!r}")


def after_prefix(params: StructuredOutputsParams, prefix_rules: str) -> StructuredOutputsParams:
    """``params``' constraint preceded by the Lark rule ``reasoning_prefix`` that ``prefix_rules``
    defines: ``start: reasoning_prefix body`` with the constraint nested as ``body``."""
    lark = "\n".join(["start: reasoning_prefix body", prefix_rules, "body: " + _nested(compile_grammar(params))])
    return StructuredOutputsParams(grammar=lark)


def _nested(grammar: str) -> str:
    """A compiled grammar as a nested Lark grammar (``%json {...}`` or ``%lark {...}``)."""
    try:
        top = json.loads(grammar)
    except ValueError:
        return "%lark {\n" + grammar + "\n}"  # already Lark text
    (entry,) = top["grammars"]
    if entry.get("json_schema") is not None:
        return "%json " + json.dumps(entry["json_schema"])
    return "%lark {\n" + entry["lark_grammar"] + "\n}"


def ll_tokenizer(
    tokenizer: Any, n_vocab: Optional[int] = None, eos_token_id: Optional[int] = None
) -> llguidance.LLTokenizer:
    """The llguidance view of a Hugging Face fast tokenizer (or a ``tokenizers.Tokenizer``), cached.

    ``n_vocab`` widens the vocabulary to the model's logits (the extra ids are never allowed);
    ``eos_token_id`` overrides the tokenizer's EOS. Building it walks the whole vocabulary
    (~40 ms for 4k tokens, ~0.45 s for 32k), so it is done once per tokenizer.
    """
    key = (id(tokenizer), n_vocab, eos_token_id)
    with _tokenizer_lock:
        hit = _ll_tokenizers.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not hasattr(backend, "to_str"):
            raise TypeError(
                f"structured outputs need a fast (Rust) tokenizer, got {type(tokenizer).__name__}"
            )
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        eos = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
        result = llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)
        _ll_tokenizers[key] = (tokenizer, result)
        logger.debug("built the llguidance tokenizer (vocab %d, eos %s)", result.vocab_size, eos)
        return result


def validate_structured_outputs(params: StructuredOutputsParams, tokenizer: Any = None) -> None:
    """Check that ``params`` compiles (against ``tokenizer`` when given, else tokenizer-free).

    Raises ``InvalidArgumentError`` naming ``sampling_params.structured_outputs.<kind>`` with
    llguidance's reason for an invalid JSON schema, regex or grammar.
    """
    grammar = compile_grammar(params)
    ll_tok = None
    if tokenizer is not None:
        try:
            ll_tok = ll_tokenizer(tokenizer)
        except TypeError as e:
            logger.warning("validating structured outputs without the tokenizer: %s", e)
    error = _validate(grammar, ll_tok)
    if error:
        raise InvalidArgumentError(f"{_FIELD}.{params.kind}", error)


@lru_cache(maxsize=_CACHE_SIZE)
def _validate(grammar: str, ll_tok: Optional[llguidance.LLTokenizer]) -> str:
    """llguidance's error message for ``grammar``, or ``""`` when it is valid."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tok, limits=GRAMMAR_LIMITS)
    if is_error:
        return messages[0].strip() if messages else "invalid grammar"
    for warning in messages:
        logger.debug("structured outputs grammar warning: %s", warning)
    return ""

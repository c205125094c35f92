"""Structured-output specs of the largest size the gateway accepts (``max_structured_output_chars``)
compile and validate quickly or are refused naming the field: llguidance's resource limits
(``GRAMMAR_LIMITS``) bound the work, whatever the spec."""

from __future__ import annotations

import json
import time

import pytest
from tokenizers import Tokenizer

from gridserve.services.gateway.limits import RequestLimits
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.sampling_params import StructuredOutputsParams
from gridserve.shared.structured_output import GRAMMAR_LIMITS, validate_structured_outputs

CAP = RequestLimits().max_structured_output_chars
SECONDS = 3.0  # each takes well under a second here; the bound is what matters


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HOSTILE = {
    "regex-alternation": {"regex": "(" + "|".join(f"w{i}x{i}" for i in range(5500)) + ")"},
    "regex-counted-repetition": {"regex": "((a|b){1,1000}[0-9]{1,1000}){1,1000}"},
    "regex-dfa-blowup": {"regex": "(a|b)*a(a|b){60}"},
    "grammar-nested-repetition": {"grammar": 'start: x{1000}\nx: y{1000}\ny: z{1000}\nz: "a" | "b"\n'},
    "grammar-3000-rules": {"grammar": "start: " + " ".join(f"x{i}" for i in range(2500)) + "\n"
                           + "\n".join(f'x{i}: "a"{{1,50}}' for i in range(2500))},
    "grammar-ambiguous": {"grammar": 'start: x*\nx: "a" | "a" "a" | x x\n'},
    "json-many-properties": {"json": {"type": "object", "required": [f"p{i}" for i in range(1000)],
                                      "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,50}"}
                                                     for i in range(1000)}}},
    "json-anyof": {"json": {"anyOf": [{"type": "string", "pattern": f"a{{{i},{i + 5}}}b"} for i in range(1, 1400)]}},
    "json-deep-nesting": {"json": _nested(400)},
    "json-huge-counts": {"json": {"type": "array", "minItems": 10**9, "items": {"type": "string", "maxLength": 10**9}}},
}


@pytest.fixture(scope="module")
def tokenizer(llama_tiny):
    return Tokenizer.from_file(str(llama_tiny / "tokenizer.json"))


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_spec_at_the_size_cap_compiles_quickly_or_is_refused_naming_the_field(tokenizer, name):
    spec = HOSTILE[name]
    assert len(json.dumps(next(iter(spec.values())))) <= CAP, "within the gateway's size cap"
    start = time.monotonic()
    try:
        validate_structured_outputs(StructuredOutputsParams(**spec), tokenizer)
    except InvalidArgumentError as exc:
        assert exc.field == f"sampling_params.structured_outputs.{next(iter(spec))}", exc
    assert time.monotonic() - start < SECONDS


def test_deep_nesting_is_refused_naming_the_field(tokenizer):
    with pytest.raises(InvalidArgumentError) as err:
        validate_structured_outputs(StructuredOutputsParams(json=_nested(400)), tokenizer)
    assert err.value.field == "sampling_params.structured_outputs.json"


def test_the_limits_are_llguidances_written_out():
    assert (GRAMMAR_LIMITS.max_grammar_size, GRAMMAR_LIMITS.initial_lexer_fuel) == (500_000, 1_000_000)

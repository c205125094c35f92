"""Structured outputs end to end on the random-weight tiny Llama: the grammar alone must force validity."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from gridserve import LLM, SamplingParams
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.sampling_params import StructuredOutputsParams
from gridserve.shared.structured_output import validate_structured_outputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "kind": {"enum": ["home", "work"]},
            },
            "required": ["city", "zip", "kind"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
PROMPT = "Describe a user as JSON:"


@pytest.fixture(scope="module")
def llm(llama_tiny):
    engine = LLM(model=str(llama_tiny), kv_cache_memory_bytes=32 << 20)
    yield engine
    engine.shutdown()


def _structured(max_tokens: int = 64, **spec) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**spec)
    )


def test_json_schema_seeded_generations_validate(llm):
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=160,
            structured_outputs=StructuredOutputsParams(json=SCHEMA),
        )
        for seed in range(50)
    ]
    outputs = llm.generate([PROMPT] * 50, params, use_tqdm=False)
    texts = set()
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), SCHEMA)
        texts.add(completion.text)
    assert len(texts) > 40  # the seeds really sample


def test_regex_choice_json_object_and_grammar(llm):
    regex = r"[A-Z][a-z]{2,5}-[0-9]{3}"
    choices = ["red", "green", "blue", "héllo wörld"]
    grammar = (
        'root ::= "(" expr ")"\nexpr ::= num (op num){0,3}\nop ::= "+" | "*"\nnum ::= [1-9][0-9]?'
    )
    params = [
        _structured(regex=regex),
        _structured(choice=choices),
        _structured(json_object=True, max_tokens=128),
        _structured(grammar=grammar),
        *[
            SamplingParams(
                temperature=1.0,
                seed=s,
                max_tokens=32,
                structured_outputs=StructuredOutputsParams(**spec),
            )
            for s in range(4)
            for spec in ({"regex": regex}, {"choice": choices}, {"grammar": grammar})
        ],
    ]
    outputs = [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params, use_tqdm=False)]
    for out, p in zip(outputs, params):
        spec = p.structured_outputs
        assert out.finish_reason == "stop", (spec, out)
        if spec.regex is not None:
            assert re.fullmatch(regex, out.text), out.text
        elif spec.choice is not None:
            assert out.text in choices
        elif spec.json_object:
            assert isinstance(json.loads(out.text), dict)
        else:
            assert re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?){0,3}\)", out.text), out.text


def test_mixed_batch_matches_solo(llm):
    params = [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=1.0, seed=7, max_tokens=12),
        SamplingParams(
            temperature=1.0,
            seed=3,
            max_tokens=160,
            structured_outputs=StructuredOutputsParams(json=SCHEMA),
        ),
        _structured(choice=["alpha", "beta", "gamma"]),
        SamplingParams(
            temperature=0.8,
            top_p=0.9,
            seed=11,
            max_tokens=24,
            structured_outputs=StructuredOutputsParams(regex=r"[a-z ]{4,20}\."),
        ),
    ]
    prompts = [PROMPT, "Once upon a time", PROMPT, "Pick one:", "Say something"]
    batch = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for prompt, p, together in zip(prompts, params, batch):
        alone = llm.generate([prompt], [p], use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == together.token_ids, p


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"json": {"type": "objekt"}}, "json"),
        ({"json": "{not json"}, "json"),
        ({"json": {"type": "string", "minLength": 5, "maxLength": 2}}, "json"),
        ({"regex": "a(b"}, "regex"),
        ({"grammar": "root ::= missing_rule"}, "grammar"),
    ],
)
def test_invalid_spec_is_a_clear_error(llm, spec, field):
    params = StructuredOutputsParams(**spec)
    with pytest.raises(InvalidArgumentError) as err:
        validate_structured_outputs(params, llm.get_tokenizer())
    assert err.value.field == f"sampling_params.structured_outputs.{field}"
    with pytest.raises(InvalidArgumentError) as err:
        llm.generate([PROMPT], SamplingParams(structured_outputs=params), use_tqdm=False)
    assert err.value.field == f"sampling_params.structured_outputs.{field}"
    # the engine still serves requests afterwards
    assert (
        llm.generate([PROMPT], _structured(choice=["ok"]), use_tqdm=False)[0].outputs[0].text
        == "ok"
    )


def test_preempted_requests_resume_their_grammar(llm, llama_tiny):
    """4 blocks of 16 tokens hold one 11-token prompt + ~35-token answer: requests get preempted,
    resume with their earlier output replayed into a fresh matcher, and still match a roomy run."""
    small_schema = {
        "type": "object",
        "properties": {
            "kind": {"enum": ["home", "work"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 2,
                "maxItems": 4,
            },
        },
        "required": ["kind", "n", "tags"],
        "additionalProperties": False,
    }
    config = GridserveConfig.from_kwargs(model=str(llama_tiny)).finalize()
    per_block = config.model.kv_bytes_per_token() * 16
    small = LLM(model=str(llama_tiny), max_model_len=64, kv_cache_memory_bytes=per_block * 5)
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(json=small_schema),
        )
        for seed in range(3)
    ]
    prompts = [PROMPT] * len(params)
    try:
        got = [o.outputs[0] for o in small.generate(prompts, params, use_tqdm=False)]
        assert small.stats().num_preemptions > 0
    finally:
        small.shutdown()
    want = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == "stop"
        jsonschema.validate(json.loads(g.text), small_schema)


def test_manager_masks_structured_rows_only(llm):
    import torch

    from gridserve.services.worker.structured_output import StructuredOutputManager

    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    vocab = len(tokenizer)
    manager = StructuredOutputManager(tokenizer, vocab)
    manager.add_request("a", StructuredOutputsParams(choice=["yes", "no"]))
    # resumed after preemption with "1" already generated: only digits (then EOS) may follow
    manager.add_request("c", StructuredOutputsParams(regex="[0-9]{2}"), tokenizer.encode("1"))
    logits = torch.zeros(3, vocab + 64)  # the model's logits may be wider than the tokenizer
    manager.apply_bitmask(logits, ["a", "b", "c"])
    assert torch.equal(logits[1], torch.zeros(vocab + 64))  # no grammar: untouched
    assert torch.isinf(logits[[0, 2], vocab:]).all()
    allowed_c = torch.isfinite(logits[2]).nonzero().flatten().tolist()
    assert sorted(tokenizer.decode([t]) for t in allowed_c) == [str(d) for d in range(10)]
    manager.accept_tokens(["a", "b", "c"], [tokenizer.encode("yes")[0], 5, allowed_c[0]])
    logits = torch.zeros(2, vocab)
    manager.apply_bitmask(logits, ["c", "a"])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [eos]  # "c" is complete
    manager.remove("a")
    manager.remove("c")
    assert not manager.has_requests

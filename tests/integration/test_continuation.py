"""A continuation (what a gateway sends when an engine died mid-request) generates exactly the
tokens a fault-free run would have: the tokens already generated arrive as *output*, so
``max_tokens``, ``min_tokens``, penalties and the seeded sampling index all count them.

Runs the tiny Llama in-process (``LLM``'s engine core), adding engine ``Request``s directly.
"""

from __future__ import annotations

import pytest

from gridserve import LLM
from gridserve.services.engine.request import Request
from gridserve.shared.sampling_params import SamplingParams

PROMPT = [5, 17, 300, 42, 901, 7]
MAX_TOKENS = 14


@pytest.fixture(scope="module")
def core(llama_tiny):
    llm = LLM(model=str(llama_tiny), kv_cache_memory_bytes=32 << 20, max_model_len=256)
    yield llm.llm_engine.core
    llm.llm_engine.shutdown()


def _run(core, requests: list[Request]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for request in requests:
        core.add_request(request)
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            # usage's cached tokens are prompt tokens, even when a continuation hits its output
            assert out.num_cached_tokens <= len(PROMPT if out.request_id != "other" else [9, 8, 7])
    return tokens


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True),
    "penalties": SamplingParams(temperature=0.8, seed=99, max_tokens=MAX_TOKENS, ignore_eos=True,
                                presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.3),
}


@pytest.mark.parametrize("kind", sorted(PARAMS))
@pytest.mark.parametrize("cut", [0, 1, 5, MAX_TOKENS - 1])
def test_a_continuation_generates_what_the_fault_free_run_did(core, kind, cut):
    params = PARAMS[kind]
    full = _run(core, [Request("full", PROMPT, params)])["full"]
    assert len(full) == MAX_TOKENS
    # alongside another request, so the continuation is not alone in its batch
    other = Request("other", [9, 8, 7], SamplingParams(temperature=1.0, seed=5, max_tokens=MAX_TOKENS))
    cont = Request("cont", PROMPT, params, output_token_ids=full[:cut])
    cont.admit_always = True
    got = _run(core, [other, cont])["cont"]
    assert full[:cut] + got == full, (kind, cut)


def test_min_tokens_counts_the_tokens_already_generated(core):
    eos = core.config.model.eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=4)
    full = _run(core, [Request("full", PROMPT, params, eos_token_id=eos)])["full"]
    cont = _run(core, [Request("cont", PROMPT, params, eos_token_id=eos, output_token_ids=full[:3])])["cont"]
    assert full[:3] + cont == full

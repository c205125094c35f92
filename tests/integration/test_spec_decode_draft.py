"""Speculative decoding with a draft model (issue 36, ``{"model": PATH}``), end to end on tiny
random checkpoints:

* greedy outputs identical with and without a 1-layer random draft on three architectures (Llama,
  OPT, and Gemma 2 on the hybrid KV cache, where the draft's layer joins a full-attention group),
  32 prompts, chunked prefill on;
* the target as its own draft accepts every draft; the random one few, with the same outputs;
* a KV cache small enough to preempt, and prompts sharing prefixes (prefix-cache hits): same outputs;
* sampling: an unseeded request's drafts are drawn from the draft's distribution and verified by
  rejection sampling — the target as its own draft accepts nearly all of them; a seeded request
  (point-mass drafts) gives exactly the tokens of decoding without speculation, alone and in a
  batch; top-k 1 gives the greedy tokens and ``allowed_token_ids`` hold;
* penalties (repetition; frequency + presence) and bad words with the target as its own draft:
  its unpenalised proposals are sometimes rejected, and the tokens are those without speculation,
  greedy and seeded;
* aborts leak no block (the draft's lookahead slots included);
* a JSON-schema request: the grammar's mask at each draft position keeps its output unchanged;
* a draft of another vocabulary is refused at start, naming the field;
* tensor parallelism (TP=2, the whole draft on the driver): TP=1's greedy tokens (slow).
"""

from __future__ import annotations

import pytest

from gridserve import LLM, SamplingParams
from gridserve.shared.errors import ConfigError
from gridserve.shared.sampling_params import StructuredOutputsParams
from tests.zoo import zoo_checkpoint

from .test_llm_matches_hf import _prompts
from .test_spec_decode import (
    KV_BYTES,
    NGRAM,
    PENALTIES,
    _abort_every_other_midway,
    _assert_no_leak,
    _greedy,
    _Oracle,
    _penalised,
    _three_architectures_baseline,
    _tokens,
)

K = 4


def _draft() -> str:
    """A 1-layer random Llama of the tiny checkpoints' vocabulary (its KV page is Gemma 2's)."""
    return str(zoo_checkpoint("spec-draft-1layer", "LlamaConfig", hidden_size=64, intermediate_size=128,
                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                              max_position_embeddings=512, tie_word_embeddings=False))


def _spec(model: str, **extra) -> dict:
    return {"model": model, "num_speculative_tokens": K, "disable_by_batch_size": 64, **extra}


def _rate(llm: LLM) -> float:
    stats = llm.stats()
    assert stats.spec_num_draft_tokens > 0, "no drafts were verified"
    return stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens


@pytest.mark.parametrize("name", ["llama", "opt", "gemma2"])
def test_greedy_outputs_are_identical_with_a_draft_model_on_three_architectures(name, llama_tiny, opt_tiny):
    path, prompts, expected = _three_architectures_baseline(name, llama_tiny, opt_tiny, seed=83)
    # the target as its own draft too, where its layers are all full attention (a draft's must be)
    for draft in (_draft(), path) if name != "gemma2" else (_draft(),):
        spec = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=64,
                   speculative_config=_spec(draft))
        alone = [_tokens(spec, [p], _greedy())[0] for p in prompts[:4]]
        together = _tokens(spec, prompts, _greedy())
        assert alone == expected[:4] and together == expected, draft
        if draft == path:  # the target as its own draft: every draft is the target's greedy token
            assert _rate(spec) == 1.0
        else:
            assert _rate(spec) < 0.5
        _assert_no_leak(spec)


def test_preemption_and_prefix_cache_hits_keep_outputs_with_a_draft_model(llama_tiny):
    """A cache of 40 blocks for 12 requests preempts; prompts share a 40-token prefix (hits)."""
    shared = _prompts(1, 40, 40, seed=89)[0]
    prompts = [shared + p for p in _prompts(12, 5, 30, seed=97)]
    path = str(llama_tiny)
    plain = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=64)
    expected = _tokens(plain, prompts, _greedy(32))
    block_bytes = 16 * 4 * (2 * 2 * 16 * 4)  # 16 tokens, 4 layers (2 + the draft's 2), K + V of 2 x 16 fp32
    spec = LLM(model=path, max_num_batched_tokens=64, max_model_len=256, speculative_config=_spec(path),
               kv_cache_memory_bytes=40 * block_bytes)
    core = spec.llm_engine.core
    assert core.kv_cache_manager.num_total_blocks <= 40
    assert _tokens(spec, prompts, _greedy(32)) == expected
    assert core.scheduler.num_preemptions > 0
    assert core.kv_cache_manager.prefix_cache_hits > 0
    assert _rate(spec) == 1.0
    _assert_no_leak(spec)


def _sampled(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_seeded_sampling_with_a_draft_model_gives_the_tokens_of_plain_decoding(llama_tiny):
    """A seeded request's drafts are point masses verified by exact match against the target's own
    counter-based draw: its tokens are those of decoding without speculation, alone or in a batch."""
    prompts = _prompts(6, 10, 40, seed=101)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=200 + i, max_tokens=24, min_tokens=24)
              for i in range(len(prompts))]
    path = str(llama_tiny)
    expected = _sampled(LLM(model=path, kv_cache_memory_bytes=KV_BYTES), prompts, params)
    spec = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, speculative_config=_spec(path))
    assert _sampled(spec, prompts, params) == expected
    assert [_sampled(spec, [p], [q])[0] for p, q in zip(prompts, params)] == expected
    assert spec.stats().spec_num_accepted_tokens > 0
    _assert_no_leak(spec)


def test_unseeded_sampled_drafts_of_the_target_itself_are_nearly_all_accepted(llama_tiny):
    """Drafts drawn from ``q`` = the target's own distribution: min(1, p / q) accepts them (up to
    rounding and min_tokens' EOS ban)."""
    prompts = _prompts(6, 10, 40, seed=131)
    path = str(llama_tiny)
    spec = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, speculative_config=_spec(path))
    outs = _sampled(spec, prompts, [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, min_tokens=24)]
                    * len(prompts))
    assert all(len(o) == 24 for o in outs)
    assert _rate(spec) > 0.9
    _assert_no_leak(spec)


def test_sampling_requests_with_a_draft_model_keep_their_constraints(llama_tiny):
    prompts = _prompts(4, 10, 40, seed=109)
    path = str(llama_tiny)
    plain = LLM(model=path, kv_cache_memory_bytes=KV_BYTES)
    expected = _tokens(plain, prompts, _greedy())
    spec = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, speculative_config=_spec(_draft()))
    # top-k 1: the target's distribution is a point mass on its argmax, whatever the draft proposes
    assert _sampled(spec, prompts, [SamplingParams(temperature=0.8, top_k=1, max_tokens=24, min_tokens=24)]
                    * len(prompts)) == expected
    allowed = list(range(100, 140))
    outs = _sampled(spec, prompts, [SamplingParams(temperature=1.0, top_p=0.9, allowed_token_ids=allowed,
                                                   max_tokens=24, min_tokens=24)] * len(prompts))
    assert all(len(o) == 24 and set(o) <= set(allowed) for o in outs)
    assert spec.stats().spec_num_draft_tokens > 0
    _assert_no_leak(spec)


@pytest.mark.parametrize("kind", ["repetition", "frequency-presence", "bad-words"])
def test_greedy_outputs_with_penalties_or_bad_words_are_identical_with_the_target_as_its_own_draft(
        kind, llama_tiny):
    """The draft proposes the target's unpenalised argmax; each draft row is penalised (and banned)
    over the output and the drafts before it, so some proposals are rejected and none changes the
    tokens. Every token is free (no allowed ids: the draft does not apply them)."""
    prompts = _prompts(6, 10, 40, seed=151)
    path = str(llama_tiny)
    plain = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=64)
    params = _penalised(kind, plain, prompts, allowed=None)
    expected = _tokens(plain, prompts, params)
    spec = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=64,
               speculative_config=_spec(path))
    assert _tokens(spec, prompts, params) == expected
    assert 0.3 < _rate(spec) < 1.0
    _assert_no_leak(spec)


def test_seeded_sampling_with_penalties_and_a_draft_model_gives_the_tokens_of_plain_decoding(llama_tiny):
    prompts = _prompts(6, 10, 40, seed=153)
    params = [SamplingParams(temperature=0.8, seed=400 + i, max_tokens=32, min_tokens=32,
                             **PENALTIES["repetition"], **PENALTIES["frequency-presence"])
              for i in range(len(prompts))]
    path = str(llama_tiny)
    expected = _sampled(LLM(model=path, kv_cache_memory_bytes=KV_BYTES), prompts, params)
    spec = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, speculative_config=_spec(path))
    assert _sampled(spec, prompts, params) == expected
    assert spec.stats().spec_num_accepted_tokens > 0
    _assert_no_leak(spec)


def test_aborting_requests_with_a_draft_model_leaks_no_block(llama_tiny):
    prompts = _prompts(6, 10, 60, seed=103)
    path = str(llama_tiny)
    plain = LLM(model=path, kv_cache_memory_bytes=KV_BYTES)
    expected = _tokens(plain, prompts, _greedy(40))
    spec = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, speculative_config=_spec(_draft()))
    _abort_every_other_midway(spec, prompts, _greedy(40), expected)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                                    "maxItems": 3}},
          "required": ["name", "tags"], "additionalProperties": False}


def _json_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=StructuredOutputsParams(json=SCHEMA))


@pytest.mark.parametrize("method", ["draft-model", "oracle"])
def test_json_schema_requests_give_the_same_output_with_speculation(method, llama_tiny):
    """The draft model proposes unmasked tokens (cut at the first one the grammar refuses); the
    oracle proposes the structured output itself, so several drafts per step pass the grammar and
    each draft row must be masked by the grammar after the drafts before it."""
    path = str(llama_tiny)
    prompts = _prompts(3, 8, 20, seed=107)
    plain = LLM(model=path, kv_cache_memory_bytes=KV_BYTES)
    expected = _tokens(plain, prompts, _json_params())
    config = _spec(path) if method == "draft-model" else NGRAM
    spec = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, speculative_config=config)
    if method == "oracle":
        _Oracle(spec, {tuple(p): e for p, e in zip(prompts, expected)})
    got = _tokens(spec, prompts, _json_params())
    assert got == expected
    stats = spec.stats()
    assert stats.spec_num_accepted_tokens > 0
    if method == "oracle":
        assert stats.spec_accepted_per_pos[2] > 0  # runs of drafts went through the per-position masks
    _assert_no_leak(spec)


def test_a_draft_model_of_another_vocabulary_is_refused_at_start(llama_tiny):
    other = zoo_checkpoint("spec-draft-vocab", "LlamaConfig", vocab_size=512, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           max_position_embeddings=512)
    with pytest.raises(ConfigError) as err:
        LLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES, speculative_config={"model": str(other)})
    assert err.value.field == "speculative_config.model" and "vocabulary" in str(err.value)


@pytest.mark.slow
def test_tensor_parallel_workers_with_a_draft_model_give_one_workers_greedy_tokens(llama_tiny):
    prompts = _prompts(6, 10, 60, seed=113)
    path = str(llama_tiny)
    plain = LLM(model=path, kv_cache_memory_bytes=KV_BYTES)
    expected = _tokens(plain, prompts, _greedy())
    for draft in (path, _draft()):
        spec = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, tensor_parallel_size=2,
                   speculative_config=_spec(draft))
        try:
            got = [_tokens(spec, [p], _greedy())[0] for p in prompts] + _tokens(spec, prompts, _greedy())
            # TP's own near-ties aside (its sums run in another order), TP=1's tokens
            assert sum(a == b for a, b in zip(got, expected + expected)) >= 2 * len(prompts) - 1, draft
            assert (_rate(spec) > 0.9) if draft == path else (_rate(spec) < 0.5)
            _assert_no_leak(spec)
        finally:
            spec.shutdown()

"""The offline engine is token-exact with Hugging Face transformers on the same checkpoint."""

from __future__ import annotations

import random

import pytest

from gridserve import LLM, SamplingParams
from gridserve.shared.config import GridserveConfig

from .hf_reference import hf_greedy, hf_top_logprobs

MAX_TOKENS = 16


def _prompts(count: int, min_len: int, max_len: int, seed: int = 0, vocab: int = 4096) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def _greedy(n: int = MAX_TOKENS) -> SamplingParams:
    # min_tokens == max_tokens: EOS is masked until the end, exactly like HF's min_new_tokens.
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


def _generate_ids(llm: LLM, prompts: list[list[int]], n: int = MAX_TOKENS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(n), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_matches_hf(path: str, prompts: list[list[int]], got: list[list[int]], n: int = MAX_TOKENS) -> None:
    for i, (prompt, ids) in enumerate(zip(prompts, got)):
        assert ids == hf_greedy(path, prompt, n), f"prompt {i} (len {len(prompt)}) diverges from HF"


def _assert_no_leak(llm: LLM) -> None:
    kv = llm.llm_engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks


@pytest.fixture(params=["llama_tiny", "opt_tiny"])
def checkpoint(request) -> str:
    return str(request.getfixturevalue(request.param))


def test_single_text_prompt_matches_hf_greedy(checkpoint):
    llm = LLM(model=checkpoint, kv_cache_memory_bytes=32 << 20)
    prompt = "def fibonacci(n):\n    return"
    out = llm.generate(prompt, _greedy(), use_tqdm=False)[0]
    prompt_ids = llm.get_tokenizer().encode(prompt)
    assert out.prompt == prompt and out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == hf_greedy(checkpoint, prompt_ids, MAX_TOKENS)
    assert out.outputs[0].finish_reason == "length" and out.finished
    assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids)
    _assert_no_leak(llm)


@pytest.mark.parametrize("arch", ["llama_tiny", "opt_tiny", "qwen2_tiny", "mistral_tiny"])
def test_sixteen_mixed_length_prompts_in_one_call_match_hf(arch, request):
    path = str(request.getfixturevalue(arch))
    llm = LLM(model=path, kv_cache_memory_bytes=32 << 20)
    prompts = _prompts(16, 1, 200, seed=1)
    _assert_matches_hf(path, prompts, _generate_ids(llm, prompts))
    _assert_no_leak(llm)


def test_shared_long_prefix_hits_prefix_cache_and_matches_hf(llama_tiny):
    path = str(llama_tiny)
    llm = LLM(model=path, kv_cache_memory_bytes=32 << 20)
    prefix = _prompts(1, 160, 160, seed=2)[0]
    first = [prefix + [7, 8, 9]]
    _assert_matches_hf(path, first, _generate_ids(llm, first))
    before = llm.stats().prefix_cache_hits
    rest = [prefix + tail for tail in ([10], [11, 12, 13], [14] * 20)]
    got = _generate_ids(llm, rest)
    hits = llm.stats().prefix_cache_hits - before
    assert hits >= 3 * 160 // 16 * 16, "each follower should reuse the 10 full prefix blocks"
    _assert_matches_hf(path, rest, got)
    outs = llm.generate([{"prompt_token_ids": rest[0]}], _greedy(), use_tqdm=False)
    assert outs[0].num_cached_tokens == 160
    _assert_no_leak(llm)


def test_chunked_prefill_under_small_token_budget_matches_hf(checkpoint):
    llm = LLM(model=checkpoint, kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=24)
    prompts = _prompts(6, 40, 150, seed=3)
    _assert_matches_hf(checkpoint, prompts, _generate_ids(llm, prompts))
    _assert_no_leak(llm)


def test_preemption_with_a_tiny_kv_cache_matches_hf(checkpoint):
    # 20 blocks of 16 tokens: enough for one max-length request, far too few for all at once.
    per_block = GridserveConfig.from_kwargs(model=checkpoint).finalize().model.kv_bytes_per_token() * 16
    llm = LLM(model=checkpoint, max_model_len=256, kv_cache_memory_bytes=per_block * 20)
    prompts = _prompts(8, 60, 120, seed=4)
    got = _generate_ids(llm, prompts, 24)
    assert llm.stats().num_preemptions > 0
    _assert_matches_hf(checkpoint, prompts, got, 24)
    _assert_no_leak(llm)


def test_top_logprobs_of_first_tokens_match_hf_within_1e_4(checkpoint):
    llm = LLM(model=checkpoint, kv_cache_memory_bytes=32 << 20)
    prompt = _prompts(1, 30, 30, seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, logprobs=5)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    reference = hf_top_logprobs(checkpoint, prompt, out.token_ids, 5)
    assert len(out.logprobs) == 4
    for position, (token, entry, (ref_ids, ref_vals)) in enumerate(zip(out.token_ids, out.logprobs, reference)):
        assert token in entry and entry[token].rank == 1, "greedy token is the rank-1 candidate"
        top = sorted(entry.items(), key=lambda kv: kv[1].rank)
        assert [tok for tok, _ in top] == ref_ids, f"position {position}"
        for (_, lp), ref in zip(top, ref_vals):
            assert abs(lp.logprob - ref) < 1e-4
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))

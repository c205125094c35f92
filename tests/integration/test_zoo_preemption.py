"""Preemption on zoo models whose attention is not plain causal: a KV cache far too small for the
batch evicts running requests, which later recompute their prompt and the tokens they had (their
blocks again from the prefix cache or from scratch) and must still give transformers' greedy tokens
and logprobs: Gemma 2 (a 24-token window on alternate layers under 60-120-token prompts, attention
and final soft caps) and Bloom (ALiBi, whose biases depend on each key's absolute position)."""

from __future__ import annotations

import pytest

from gridserve import LLM
from gridserve.shared.config import GridserveConfig
from tests.zoo import zoo_checkpoint

from .test_llm_matches_hf import _assert_no_leak, _prompts
from .test_zoo_gpt_family import CHECKPOINTS as GPT_FAMILY
from .test_zoo_llama_family import _assert_matches_hf
from .test_zoo_llama_family import checkpoint as llama_family


def _path(name: str) -> str:
    if name == "gemma2":
        return llama_family(name)
    config_class, config = GPT_FAMILY[name]
    return str(zoo_checkpoint(f"gpt-family-{name}", config_class, **config))


@pytest.mark.parametrize("name", ["gemma2", "bloom"])
def test_preempted_requests_of_a_window_or_alibi_model_resume_with_transformers_tokens(name):
    path = _path(name)
    # 20 blocks of 16 tokens: one request of up to 136 tokens fits, eight at once do not. Gemma 2's
    # window layers free what their window passed (its two KV cache groups share slots, so a block
    # costs half the bytes): it gets the room of 11 and 64-token prefill chunks, so that running
    # requests outgrow the pool (a request holds 9 + 2 of the 21 blocks once its prompt is in)
    per_block = GridserveConfig.from_kwargs(model=path).finalize().model.kv_bytes_per_token() * 16
    if name == "gemma2":
        llm = LLM(model=path, max_model_len=160, kv_cache_memory_bytes=per_block * 11, max_num_batched_tokens=64)
    else:
        llm = LLM(model=path, max_model_len=256, kv_cache_memory_bytes=per_block * 20)
    try:
        _assert_matches_hf(path, llm, _prompts(8, 60, 120, seed=4))
        assert llm.stats().num_preemptions > 0
        _assert_no_leak(llm)
    finally:
        llm.shutdown()

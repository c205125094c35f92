"""KV cache groups end to end (issue 31's acceptance): a Gemma-2-shaped model (window 16 on every
other layer) and a Gemma-3-shaped one (five window layers per full one) on the hybrid allocator.

* the window group holds at most the window + one block per request once prompts are in (read
  from the engine's load snapshot, as metrics and ``/v1/status`` show it) while the full group holds
  every token, and the tokens equal transformers';
* the same ``kv_cache_memory_bytes`` decodes more long requests at once than with every layer
  planned full (``disable_hybrid_kv_cache_manager``): the ratios are printed and bounded below;
* a prefix longer than the window hits in every group, the window group taking only the blocks the
  new request's window sees; outputs exact;
* preemption under a tight cache: every request completes exactly, no block leaked in any group.
"""

from __future__ import annotations

import functools
import math

import pytest

from gridserve import LLM, SamplingParams
from gridserve.shared.kv_cache_spec import num_skipped_blocks
from tests.zoo import zoo_checkpoint

from .test_llm_matches_hf import _prompts
from .test_zoo_llama_family import _hf_teacher_forced

WINDOW = 16
BLOCK = 16
_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 512, "sliding_window": WINDOW, "tie_word_embeddings": True}


@functools.cache
def gemma2() -> str:
    """Gemma 2's layout: window layers 0 and 2, full layers 1 and 3 (two groups of two)."""
    return str(zoo_checkpoint("kv-groups-gemma2", "Gemma2Config", norm_offset=1.0, num_hidden_layers=4,
                              query_pre_attn_scalar=16, attn_logit_softcapping=30.0, **_SIZES))


@functools.cache
def gemma3() -> str:
    """Gemma 3's 5:1 layout on six layers (six groups of one: five window, one full)."""
    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 100_000.0}}
    return str(zoo_checkpoint("kv-groups-gemma3", "Gemma3TextConfig", norm_offset=1.0, num_hidden_layers=6,
                              query_pre_attn_scalar=16, layer_types=layer_types, rope_parameters=rope, **_SIZES))


def _kv_bytes(path: str, full_requests: int, tokens: int) -> int:
    """Memory for ``full_requests`` requests of ``tokens`` when every layer keeps every token."""
    from gridserve.shared.config import GridserveConfig

    per_block = GridserveConfig.from_kwargs(model=path).finalize().model.kv_bytes_per_token() * BLOCK
    return per_block * (full_requests * math.ceil(tokens / BLOCK) + 1)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, logprobs=1)


def _run(llm: LLM, prompts: list[list[int]], n: int, watch=None) -> list[list[int]]:
    """Every prompt through the engine step by step; ``watch(core)`` after each step."""
    engine = llm.llm_engine
    ids = [engine.add_request({"prompt_token_ids": p}, _greedy(n)) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if watch is not None:
            watch(engine.core)
    return [done[i] for i in ids]


def _assert_exact(path: str, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    for i, (prompt, got) in enumerate(zip(prompts, outputs)):
        greedy, _ = _hf_teacher_forced(path, prompt, got)
        assert got == greedy, f"prompt {i} (len {len(prompt)}) diverges from transformers"


def _assert_no_leak(llm: LLM) -> None:
    kv = llm.llm_engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks
    assert all(n == 0 for _, n in kv.group_usage()), kv.group_usage()


def test_the_window_group_holds_the_window_and_the_full_group_every_token_exactly():
    path = gemma2()
    llm = LLM(model=path, kv_cache_memory_bytes=32 << 20, block_size=BLOCK)
    groups = llm.llm_engine.core.kv_cache_config.groups
    assert [(g.name, len(g.layer_names)) for g in groups] == [(f"sliding_window_{WINDOW}", 2), ("full", 2)]
    prompts = _prompts(4, 200, 200, seed=31)
    peaks = {"window": 0, "full": 0}

    def watch(core) -> None:
        load = core.stats()
        running = core.scheduler.running
        if not running or any(r.num_computed_tokens <= r.num_prompt_tokens for r in running):
            return  # a prefill step holds every block it writes, until the next step frees them
        usage = dict(load.kv_cache_groups)
        window, full = usage[f"sliding_window_{WINDOW}"], usage["full"]
        assert window <= len(running) * (math.ceil(WINDOW / BLOCK) + 1), (window, len(running))
        assert full >= sum(math.ceil(r.num_computed_tokens / BLOCK) for r in running)
        peaks["window"], peaks["full"] = max(peaks["window"], window), max(peaks["full"], full)

    outputs = _run(llm, prompts, 16, watch)
    assert peaks["window"] > 0 and peaks["full"] >= 4 * math.ceil(200 / BLOCK)
    print(f"\npeak blocks with 4 requests of 200 + 16 tokens: window group {peaks['window']}, "
          f"full group {peaks['full']}")
    _assert_exact(path, prompts, outputs)
    _assert_no_leak(llm)


OUT = 64


def _max_running(path: str, hybrid: bool) -> tuple[int, list[list[int]]]:
    llm = LLM(model=path, kv_cache_memory_bytes=_kv_bytes(path, 4, 200 + OUT), block_size=BLOCK, max_model_len=320,
              max_num_batched_tokens=64, disable_hybrid_kv_cache_manager=not hybrid)
    peak = [0]

    def watch(core) -> None:  # requests decoding at once: each holds its whole context
        peak[0] = max(peak[0], sum(r.num_computed_tokens > r.num_prompt_tokens for r in core.scheduler.running))

    outputs = _run(llm, _prompts(24, 200, 200, seed=37), OUT, watch)
    _assert_no_leak(llm)
    return peak[0], outputs


@pytest.mark.parametrize(("model", "at_least"), [(gemma2, 1.5), (gemma3, 2.8)])
def test_the_same_memory_runs_more_long_requests_at_once_than_with_every_layer_full(model, at_least):
    path = model()
    full, full_out = _max_running(path, hybrid=False)
    hybrid, hybrid_out = _max_running(path, hybrid=True)
    ratio = hybrid / full
    print(f"\n{path.rsplit('/', 1)[-1]}: {hybrid} requests of 200 + {OUT} tokens at once on the hybrid allocator, "
          f"{full} with every layer full: {ratio:.2f}x")
    assert full >= 4 and ratio >= at_least
    assert hybrid_out == full_out  # the same tokens either way


def test_a_prefix_longer_than_the_window_hits_only_the_window_s_blocks_in_the_window_group():
    path = gemma2()
    llm = LLM(model=path, kv_cache_memory_bytes=32 << 20, block_size=BLOCK)
    core = llm.llm_engine.core
    prefix = _prompts(1, 150, 150, seed=41)[0]
    first = prefix + [9, 10, 11]
    _assert_exact(path, [first], _run(llm, [first], 8))
    second = prefix + [12] * 20
    hits_before = core.stats().prefix_cache_hits
    engine = llm.llm_engine
    engine.add_request({"prompt_token_ids": second}, _greedy(8))
    engine.step()  # admitted: its blocks are set
    hit = core.stats().prefix_cache_hits - hits_before
    assert hit == (150 // BLOCK) * BLOCK  # nine full blocks of the prefix
    (request,) = core.scheduler.running
    window_ids, full_ids = core.kv_cache_manager.get_block_ids(request.request_id)
    skipped = num_skipped_blocks(WINDOW, hit, BLOCK)
    assert skipped == 8 and window_ids[:skipped] == [0] * skipped  # never touched: outside the window
    assert 0 not in full_ids
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    _assert_exact(path, [second], [tokens])
    _assert_no_leak(llm)


def test_preemption_under_a_tight_cache_completes_every_request_exactly_and_leaks_nothing():
    path = gemma2()
    llm = LLM(model=path, kv_cache_memory_bytes=_kv_bytes(path, 2, 216), block_size=BLOCK, max_model_len=256,
              max_num_batched_tokens=128)
    prompts = _prompts(10, 100, 200, seed=43)
    outputs = _run(llm, prompts, 16)
    assert llm.llm_engine.core.stats().num_preemptions > 0
    assert all(len(o) == 16 for o in outputs)
    _assert_exact(path, prompts, outputs)
    _assert_no_leak(llm)

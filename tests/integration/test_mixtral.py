"""Mixtral (sparse MoE) is token-exact with Hugging Face transformers on the recipe's tiny checkpoint,
loads both expert layouts, shards its experts across TP ranks, and the recipe builds it reproducibly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gridserve import LLM, SamplingParams
from gridserve.demo.recipe import MARKER, build_checkpoint, ensure_tokenizer
from gridserve.services.worker.loader import load_model
from gridserve.services.worker.models.mixtral import MixtralSparseMoeBlock
from gridserve.services.worker.parallel_state import ParallelState, set_parallel_state
from gridserve.shared.config import GridserveConfig
from gridserve.shared.parallel import RankLayout

from .hf_reference import hf_top_logprobs
from .test_llm_matches_hf import (
    _assert_matches_hf,
    _assert_no_leak,
    _generate_ids,
    _greedy,
    _prompts,
)

KV_BYTES = 32 << 20


@pytest.fixture(scope="module")
def path(mixtral_tiny) -> str:
    return str(mixtral_tiny)


@pytest.fixture
def rank_of(request):
    """Load the model as one rank of a ``tp x pp`` group, without its peers (loading needs none)."""

    def build(checkpoint, rank: int = 0, tp: int = 1, pp: int = 1):
        config = GridserveConfig.from_kwargs(model=str(checkpoint), tensor_parallel_size=tp,
                                             pipeline_parallel_size=pp).finalize()
        set_parallel_state(ParallelState(RankLayout(rank, tp, pp)))
        return load_model(config, torch.device("cpu"))

    request.addfinalizer(lambda: set_parallel_state(ParallelState.single()))
    return build


def test_every_layer_is_a_sparse_moe_block(rank_of, path):
    model = rank_of(path)
    blocks = [layer.mlp for layer in model.model.layers]
    assert len(blocks) == 2 and all(isinstance(b, MixtralSparseMoeBlock) for b in blocks)
    assert blocks[0].experts.gate_up_proj.shape == (4, 2 * 128, 64) and blocks[0].top_k == 2


def test_single_text_prompt_matches_hf_greedy(path):
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES)
    prompt = "def fibonacci(n):\n    return"
    prompt_ids = llm.get_tokenizer().encode(prompt)
    out = llm.generate(prompt, _greedy(), use_tqdm=False)[0]
    _assert_matches_hf(path, [prompt_ids], [out.outputs[0].token_ids])
    _assert_no_leak(llm)


def test_sixteen_mixed_length_prompts_in_one_batch_match_hf(path):
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES)
    prompts = _prompts(16, 1, 200, seed=1)
    _assert_matches_hf(path, prompts, _generate_ids(llm, prompts))
    _assert_no_leak(llm)


def test_prefix_cache_hit_matches_hf(path):
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES)
    prefix = _prompts(1, 96, 96, seed=2)[0]
    first = [prefix + [7, 8, 9]]
    _assert_matches_hf(path, first, _generate_ids(llm, first))
    before = llm.stats().prefix_cache_hits
    rest = [prefix + [10], prefix + [11, 12, 13]]
    got = _generate_ids(llm, rest)
    assert llm.stats().prefix_cache_hits - before >= 2 * 96
    _assert_matches_hf(path, rest, got)
    _assert_no_leak(llm)


def test_chunked_prefill_under_small_token_budget_matches_hf(path):
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=24)
    prompts = _prompts(4, 40, 150, seed=3)
    _assert_matches_hf(path, prompts, _generate_ids(llm, prompts))
    _assert_no_leak(llm)


def test_top_logprobs_of_first_tokens_match_hf_within_1e_4(path):
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES)
    prompt = _prompts(1, 30, 30, seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, logprobs=5)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    reference = hf_top_logprobs(path, prompt, out.token_ids, 5)
    for position, (entry, (ref_ids, ref_vals)) in enumerate(zip(out.logprobs, reference)):
        top = sorted(entry.items(), key=lambda kv: kv[1].rank)
        assert [tok for tok, _ in top] == ref_ids, f"position {position}"
        for (_, lp), ref in zip(top, ref_vals):
            assert abs(lp.logprob - ref) < 1e-4


def _stacked_copy(src: Path, dst: Path) -> Path:
    """The checkpoint re-saved with transformers 5's in-memory expert layout (stacked, ``mlp.``)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    legacy = load_file(str(src / "model.safetensors"))
    out = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in legacy.items() if ".experts." not in k}
    config = json.loads((src / "config.json").read_text())
    for layer in range(config["num_hidden_layers"]):
        experts = range(config["num_local_experts"])
        prefix = f"model.layers.{layer}.block_sparse_moe.experts"
        w = {p: torch.stack([legacy[f"{prefix}.{e}.{p}.weight"] for e in experts]) for p in ("w1", "w2", "w3")}
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([w["w1"], w["w3"]], dim=1)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = w["w2"]
    save_file(out, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("tp", [1, 2])
def test_stacked_expert_layout_loads_the_same_weights(rank_of, path, tmp_path, tp):
    stacked = _stacked_copy(Path(path), tmp_path / "stacked")
    for rank in range(tp):
        a = rank_of(path, rank, tp=tp).state_dict()
        b = rank_of(stacked, rank, tp=tp).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_each_tp_rank_reads_only_its_half_of_every_expert(rank_of, path):
    whole = rank_of(path)
    for rank in range(2):
        part = rank_of(path, rank, tp=2)
        experts = part.model.layers[0].mlp.experts
        assert experts.gate_up_proj.numel() == whole.model.layers[0].mlp.experts.gate_up_proj.numel() // 2
        report = part.load_report
        expert_reads = [n for n in report.read if ".experts." in n]
        assert len(expert_reads) == 2 * 4 * 3
        assert report.max_fraction(expert_reads) == 0.5
        assert report.fraction("model.layers.0.block_sparse_moe.gate.weight") == 1.0  # router replicated


def test_a_pipeline_stage_reads_only_its_own_experts(rank_of, path):
    last = rank_of(path, 1, pp=2)
    read = set(last.load_report.read)
    assert any("layers.1.block_sparse_moe.experts" in n for n in read)
    assert not any(".layers.0." in n for n in read)


def test_a_sliding_window_matches_hf_past_the_window_with_chunked_prefill_and_a_cached_prefix():
    """Mixtral's window applies to every layer, as Mistral's: prompts longer than it, a shared
    prefix past it served from the prefix cache, and chunks of 32 tokens all match transformers."""
    from tests.zoo import zoo_checkpoint

    window = zoo_checkpoint("mixtral-window", "MixtralConfig", hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=512, num_local_experts=4, num_experts_per_tok=2,
                            sliding_window=24, tie_word_embeddings=False)
    llm = LLM(model=str(window), kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=32)
    prefix = _prompts(1, 60, 60, seed=5)[0]
    prompts = [prefix + tail for tail in ([7], [8, 9], [10, 11, 12])] + _prompts(4, 30, 90, seed=6)
    _assert_matches_hf(str(window), prompts[:1], _generate_ids(llm, prompts[:1]))
    _assert_matches_hf(str(window), prompts[1:], _generate_ids(llm, prompts[1:]))
    assert llm.stats().prefix_cache_hits > 0
    _assert_no_leak(llm)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_parallel_layouts_match_hf_greedy(path, tp, pp):
    llm = LLM(path, kv_cache_memory_bytes=8 << 20, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        prompts = _prompts(4, 5, 60, seed=6)
        _assert_matches_hf(path, prompts, _generate_ids(llm, prompts, 8), 8)
    finally:
        llm.shutdown()


def test_recipe_builds_byte_identical_checkpoints(tmp_path, path):
    tok_dir = ensure_tokenizer(4096)
    a = build_checkpoint(tmp_path / "a", "mixtral", "tiny", tokenizer_dir=tok_dir)
    b = build_checkpoint(tmp_path / "b", "mixtral", "tiny", tokenizer_dir=tok_dir)

    def files(folder: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != MARKER}

    assert "model.safetensors" in files(a) and files(a) == files(b) == files(Path(path))
    config = json.loads((a / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["sliding_window"] is None
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)

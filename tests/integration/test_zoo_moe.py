"""Qwen2-MoE and Qwen3-MoE are token-exact with Hugging Face transformers on tiny random checkpoints
built with transformers' own classes, load both expert layouts, and build the layer kinds and the
router their configs ask for.

Each checkpoint sets its architecture's options away from the neutral value: Qwen2-MoE with a shared
expert, Q/K/V biases, one dense layer (``mlp_only_layers``) and the router's weights left as they
are (``norm_topk_prob`` false); Qwen3-MoE with per-head Q/K norms, renormalised weights, and the
experts count as transformers 5 writes it (``num_local_experts``). ``initializer_range`` is raised so
the experts and the router (initialised from it, not rescaled by the zoo) matter to every logit.
Greedy tokens must equal transformers' on 8 prompts x 16 tokens under a 32-token step budget
(chunked prefill), the chosen tokens' logprobs within 1e-4 of a direct transformers forward, and a
shared prefix served from the prefix cache must give the same; a Qwen2-MoE with windows on some
layers (prompts up to 4x the window) too.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from gridserve import LLM
from gridserve.services.worker.fused_moe import FusedMoE
from gridserve.services.worker.loader import load_model
from gridserve.services.worker.models.llama import LlamaMLP
from gridserve.services.worker.models.qwen_moe import QwenMoeSparseBlock
from gridserve.services.worker.parallel_state import ParallelState, set_parallel_state
from gridserve.shared.config import GridserveConfig
from gridserve.shared.parallel import RankLayout
from tests.zoo import zoo_checkpoint

from .test_llm_matches_hf import _assert_no_leak, _prompts
from .test_zoo_llama_family import _assert_matches_hf

KV_BYTES = 32 << 20
_BASE = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 512, "tie_word_embeddings": False,
         "num_experts": 8, "initializer_range": 0.2}
ZOO = {
    "qwen2_moe": ("Qwen2MoeConfig", {**_BASE, "num_hidden_layers": 3, "mlp_only_layers": [1], "num_experts_per_tok": 2,
                                     "shared_expert_intermediate_size": 48, "norm_topk_prob": False}),
    "qwen3_moe": ("Qwen3MoeConfig", {**_BASE, "num_hidden_layers": 2, "num_experts_per_tok": 3,
                                     "norm_topk_prob": True}),
    # windows of 24 tokens on the layers transformers' layer types mark (0 and 2), none on layer 1
    "qwen2_moe_window": ("Qwen2MoeConfig", {**_BASE, "num_hidden_layers": 3, "num_experts_per_tok": 2,
                                            "shared_expert_intermediate_size": 48, "use_sliding_window": True,
                                            "sliding_window": 24, "max_window_layers": 3}),
}


@functools.cache
def checkpoint(name: str) -> str:
    config_class, config = ZOO[name]
    return str(zoo_checkpoint(f"moe-{name}", config_class, **config))


def _load(path, rank: int = 0, tp: int = 1, pp: int = 1) -> torch.nn.Module:
    """The model as one rank of a ``tp x pp`` group, without its peers (loading needs none)."""
    config = GridserveConfig.from_kwargs(model=str(path), tensor_parallel_size=tp,
                                         pipeline_parallel_size=pp).finalize()
    set_parallel_state(ParallelState(RankLayout(rank, tp, pp)))
    try:
        return load_model(config, torch.device("cpu"))
    finally:
        set_parallel_state(ParallelState.single())


@pytest.mark.parametrize("name", list(ZOO))
def test_greedy_tokens_and_logprobs_match_hf_with_chunked_prefill(name):
    path = checkpoint(name)
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=32)
    _assert_matches_hf(path, llm, _prompts(8, 1, 100, seed=11))
    _assert_no_leak(llm)


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_a_prefix_served_from_the_cache_gives_hfs_tokens(name):
    path = checkpoint(name)
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=32)
    prefix = _prompts(1, 64, 64, seed=5)[0]
    _assert_matches_hf(path, llm, [prefix + [7]])
    before = llm.stats().prefix_cache_hits
    _assert_matches_hf(path, llm, [prefix + [8, 9], prefix + [10, 11, 12]])
    assert llm.stats().prefix_cache_hits - before >= 2 * 64
    _assert_no_leak(llm)


def test_each_layer_has_the_block_its_config_asks_for():
    qwen2 = _load(checkpoint("qwen2_moe")).model.layers
    assert [type(layer.mlp) for layer in qwen2][1] is LlamaMLP  # mlp_only_layers: [1]
    sparse = [qwen2[0].mlp, qwen2[2].mlp]
    assert all(isinstance(b, QwenMoeSparseBlock) and b.has_shared_expert and not b.renormalize for b in sparse)
    assert sparse[0].experts.gate_up_proj.shape == (8, 2 * 32, 64) and sparse[0].top_k == 2
    qwen3 = _load(checkpoint("qwen3_moe")).model.layers
    blocks = [layer.mlp for layer in qwen3]
    assert all(isinstance(b, QwenMoeSparseBlock) and not b.has_shared_expert and b.renormalize for b in blocks)
    assert isinstance(blocks[0].experts, FusedMoE) and blocks[0].experts.num_experts == 8  # num_local_experts


def _stacked_copy(src: Path, dst: Path) -> Path:
    """The checkpoint re-saved with transformers 5's in-memory expert layout (stacked)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    per_expert = load_file(str(src / "model.safetensors"))
    out = {k: v for k, v in per_expert.items() if ".mlp.experts." not in k}
    config = json.loads((src / "config.json").read_text())
    experts = range(config.get("num_experts") or config["num_local_experts"])
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        if f"{prefix}.0.gate_proj.weight" not in per_expert:
            continue
        w = {p: torch.stack([per_expert[f"{prefix}.{e}.{p}.weight"] for e in experts])
             for p in ("gate_proj", "up_proj", "down_proj")}
        out[f"{prefix}.gate_up_proj"] = torch.cat([w["gate_proj"], w["up_proj"]], dim=1)
        out[f"{prefix}.down_proj"] = w["down_proj"]
    save_file(out, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_the_stacked_expert_layout_loads_the_same_weights(name, tp, tmp_path):
    path = Path(checkpoint(name))
    stacked = _stacked_copy(path, tmp_path / "stacked")
    for rank in range(tp):
        a = _load(path, rank, tp=tp).state_dict()
        b = _load(stacked, rank, tp=tp).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_each_tp_rank_reads_only_its_half_of_every_expert_and_of_the_shared_expert():
    path = checkpoint("qwen2_moe")
    for rank in range(2):
        report = _load(path, rank, tp=2).load_report
        experts = [n for n in report.read if ".mlp.experts." in n]
        shared = [n for n in report.read if ".shared_expert." in n]
        assert len(experts) == 2 * 8 * 3 and len(shared) == 2 * 3
        assert report.max_fraction(experts + shared) == 0.5
        assert report.fraction("model.layers.0.mlp.gate.weight") == 1.0  # the router, replicated
        assert report.fraction("model.layers.0.mlp.shared_expert_gate.weight") == 1.0


def test_a_pipeline_stage_reads_only_its_own_experts():
    read = set(_load(checkpoint("qwen3_moe"), 1, pp=2).load_report.read)
    assert any("layers.1.mlp.experts" in n for n in read)
    assert not any(".layers.0." in n for n in read)

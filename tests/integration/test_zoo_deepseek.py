"""DeepSeek-V2 and DeepSeek-V3 (multi-head latent attention, routed MoE with shared experts) are
token-exact with Hugging Face transformers on tiny random checkpoints, and cache one latent per token.

DeepSeek-V2: ``q_proj`` (no ``q_lora_rank``), softmax router with ``group_limited_greedy`` (2 groups,
1 kept), one dense layer (``first_k_dense_replace``), 2 shared experts, ``routed_scaling_factor``.
DeepSeek-V3: ``q_a_proj`` / ``q_b_proj`` (``q_lora_rank``), sigmoid ``noaux_tc`` router with a
non-zero ``e_score_correction_bias`` (written into the checkpoint after transformers builds it:
transformers initialises it to zero), renormalised weights, YaRN RoPE with ``mscale`` /
``mscale_all_dim`` (so the softmax scale is corrected), and a multi-token-prediction layer's tensors
in the checkpoint (skipped at load). Greedy tokens equal transformers' on 8 prompts x 16 tokens under
a 32-token step budget (chunked prefill), logprobs within 1e-4, and a prefix from the cache too.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from gridserve import LLM
from gridserve.services.worker.mla_attention import MLAAttention
from gridserve.services.worker.models.deepseek import DeepseekMoE, DeepseekV3MoE
from gridserve.services.worker.models.llama import LlamaMLP
from gridserve.services.worker.parallel_state import ParallelState
from gridserve.shared.parallel import RankLayout
from tests.zoo import edited_checkpoint, zoo_checkpoint

from .test_llm_matches_hf import _assert_no_leak, _prompts
from .test_zoo_llama_family import _assert_matches_hf
from .test_zoo_moe import _load

KV_BYTES = 32 << 20
_BASE = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
         "v_head_dim": 16, "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
         "max_position_embeddings": 512, "tie_word_embeddings": False, "initializer_range": 0.2,
         "num_hidden_layers": 3}
ZOO = {
    # one group of 4 kept: the top 2 experts overall are often not both in it (with 2 of 4 groups
    # kept and top 2, group-limited routing would choose as plain top-k does)
    "deepseek_v2": ("DeepseekV2Config", {**_BASE, "q_lora_rank": None, "topk_method": "group_limited_greedy",
                                         "n_group": 2, "topk_group": 1,
                                         "num_experts_per_tok": 2, "n_shared_experts": 2,
                                         "routed_scaling_factor": 1.5}),
    "deepseek_v3": ("DeepseekV3Config", {**_BASE, "q_lora_rank": 24, "num_experts_per_tok": 3, "n_shared_experts": 1,
                                         "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                                         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                             "original_max_position_embeddings": 128,
                                                             "mscale": 1.0, "mscale_all_dim": 1.0}}),
}
V3_MTP_LAYER = 3  # num_hidden_layers: where a checkpoint's multi-token-prediction layer sits


@functools.cache
def checkpoint(name: str) -> str:
    config_class, config = ZOO[name]
    path = zoo_checkpoint(f"mla-{name}", config_class, **config)
    return str(path if name != "deepseek_v3" else _with_bias_and_mtp(path))


def _with_bias_and_mtp(src: Path) -> Path:
    """A copy whose routers have a random correction bias and which holds an MTP layer's tensors."""

    def edit(tensors: dict, config: dict) -> None:
        gen = torch.Generator().manual_seed(3)
        for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
            tensors[name] = torch.rand(tensors[name].shape, generator=gen) * 0.5  # reorders the choice
        tensors[f"model.layers.{V3_MTP_LAYER}.eh_proj.weight"] = torch.zeros(64, 128)
        tensors[f"model.layers.{V3_MTP_LAYER}.self_attn.kv_b_proj.weight"] = torch.zeros(128, 32)
        config["num_nextn_predict_layers"] = 1

    return edited_checkpoint(src, "-bias-mtp", edit)


@pytest.mark.parametrize("name", list(ZOO))
def test_greedy_tokens_and_logprobs_match_hf_with_chunked_prefill(name):
    path = checkpoint(name)
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=32)
    _assert_matches_hf(path, llm, _prompts(8, 1, 100, seed=11))
    _assert_no_leak(llm)


@pytest.mark.parametrize("name", list(ZOO))
def test_a_prefix_served_from_the_latent_cache_gives_hfs_tokens(name):
    path = checkpoint(name)
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=32)
    prefix = _prompts(1, 64, 64, seed=5)[0]
    _assert_matches_hf(path, llm, [prefix + [7]])
    before = llm.stats().prefix_cache_hits
    _assert_matches_hf(path, llm, [prefix + [8, 9], prefix + [10, 11, 12]])
    assert llm.stats().prefix_cache_hits - before >= 2 * 64
    _assert_no_leak(llm)


@pytest.mark.parametrize("name", list(ZOO))
def test_the_cache_holds_one_latent_per_token_in_one_mla_group(name):
    path = checkpoint(name)
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES)
    plan = llm.llm_engine.core.kv_cache_config
    config = ZOO[name][1]
    latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    layers, dtype_bytes = config["num_hidden_layers"], 4
    assert [g.name for g in plan.groups] == ["mla"] and len(plan.groups[0].layer_names) == layers
    assert plan.bytes_per_block == plan.block_size * latent * layers * dtype_bytes
    heads = config["num_attention_heads"]
    expanded = heads * (config["qk_nope_head_dim"] + config["qk_rope_head_dim"] + config["v_head_dim"])
    assert expanded / latent == 160 / 40  # 4x smaller than K and V of every head


def test_each_layer_has_the_blocks_its_config_asks_for():
    v2 = _load(checkpoint("deepseek_v2")).model.layers
    assert type(v2[0].mlp) is LlamaMLP and all(type(layer.mlp) is DeepseekMoE for layer in v2[1:])
    gate = v2[1].mlp.gate
    assert (gate.n_group, gate.topk_group, gate.top_k, gate.renormalize, gate.scaling) == (2, 1, 2, False, 1.5)
    assert v2[1].mlp.shared_experts.gate_up_proj.weight.shape == (2 * 64, 64)  # 2 shared x 32
    assert hasattr(v2[0].self_attn, "q_proj") and not hasattr(v2[0].self_attn, "q_a_proj")
    assert isinstance(v2[0].self_attn.attn, MLAAttention)
    v3 = _load(checkpoint("deepseek_v3")).model.layers
    assert all(type(layer.mlp) is DeepseekV3MoE for layer in v3[1:])
    gate = v3[2].mlp.gate
    assert (gate.n_group, gate.topk_group, gate.top_k, gate.renormalize) == (4, 2, 3, True)
    assert gate.e_score_correction_bias.abs().sum() > 0  # the checkpoint's bias, loaded
    assert hasattr(v3[0].self_attn, "q_a_proj") and not hasattr(v3[0].self_attn, "q_proj")
    assert v3[0].self_attn.attn.scale != (16 + 8) ** -0.5  # YaRN's mscale_all_dim correction


def test_mtp_layers_are_skipped_and_named_in_the_log(caplog):
    with caplog.at_level(logging.INFO):
        model = _load(checkpoint("deepseek_v3"))
    assert len(model.model.layers) == 3
    assert any("multi-token-prediction" in r.getMessage() and f"[{V3_MTP_LAYER}]" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("name", list(ZOO))
def test_tp_ranks_split_heads_and_keep_the_whole_latent(name):
    full = _load(checkpoint(name)).state_dict()
    for rank in range(2):
        mine = _load(checkpoint(name), rank, tp=2).state_dict()
        kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
        rows = full[kv_b].shape[0] // 2
        assert torch.equal(mine[kv_b], full[kv_b][rank * rows : (rank + 1) * rows])
        kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
        assert torch.equal(mine[kv_a], full[kv_a])


@pytest.mark.parametrize("name", list(ZOO))
def test_tensor_and_pipeline_parallel_2_give_the_single_models_logits(name):
    from .test_zoo_split import ThreadRank, _Exchange, _logits
    from .test_zoo_split import _load as load_split

    path = checkpoint(name)
    single = _logits(load_split(path, ParallelState.single()))
    exchange = _Exchange(2)
    ranks = [load_split(path, ThreadRank(RankLayout(rank, 2, 1), exchange=exchange), tensor_parallel_size=2)
             for rank in (0, 1)]
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(_logits, ranks)
    assert second is None
    torch.testing.assert_close(first, single, rtol=1e-4, atol=1e-4)
    stages = [load_split(path, ParallelState(RankLayout(rank, 1, 2)), pipeline_parallel_size=2) for rank in (0, 1)]
    torch.testing.assert_close(_logits(stages[1], _logits(stages[0])), single, rtol=1e-4, atol=1e-4)

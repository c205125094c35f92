"""gpt-oss is token-exact with Hugging Face transformers on a tiny random checkpoint: attention sinks,
window layers (16 tokens) alternating with full ones, Q/K/V/O biases, YaRN RoPE, and a MoE whose
router has a bias, keeps the top-2 logits of 4 experts and softmaxes them, and whose experts are
clamped SwiGLUs with biases stored interleaved (``gate_up_proj[..., ::2]`` / ``[..., 1::2]``).

The sinks are written into a copy of the checkpoint with spread-out random values (transformers'
init leaves them small), and ``swiglu_limit`` is low enough that the clamps bite. Greedy tokens
must equal transformers' on 8 prompts x 16 tokens (prompts up to 6x the window) under a 32-token
step budget (chunked prefill), logprobs within 1e-4 of a direct transformers forward, and a prefix
served from the prefix cache must give the same. The engine plans a window KV cache group and a
full one; a window layer reads no block before its window. Split in two (TP = 2: each rank its heads,
their sinks and half of every expert; PP = 2), the model gives the single model's logits.
"""

from __future__ import annotations

import functools
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from gridserve import LLM
from gridserve.kernels.attention_backend import AttentionMetadata
from gridserve.services.worker.loader import load_model
from gridserve.services.worker.parallel_state import ParallelState
from gridserve.services.worker.sink_attention import SinkAttention
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.parallel import RankLayout, Shard
from tests.zoo import edited_checkpoint, zoo_checkpoint

from .test_llm_matches_hf import _assert_no_leak, _prompts
from .test_zoo_llama_family import _assert_matches_hf
from .test_zoo_split import ThreadRank, _Exchange, _load, _logits

KV_BYTES = 32 << 20
WINDOW = 16
CONFIG = {"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
          "sliding_window": WINDOW, "max_position_embeddings": 512, "tie_word_embeddings": False,
          "initializer_range": 0.2, "swiglu_limit": 1.5,
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                              "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False}}


@functools.cache
def checkpoint() -> str:
    return str(_with_sinks(zoo_checkpoint("gpt-oss", "GptOssConfig", **CONFIG)))


def _with_sinks(src: Path) -> Path:
    """A copy whose attention sinks are spread out (std 1.5), so every softmax feels them."""

    def edit(tensors: dict, config: dict) -> None:
        gen = torch.Generator().manual_seed(5)
        for name in [n for n in tensors if n.endswith(".sinks")]:
            tensors[name] = torch.randn(tensors[name].shape, generator=gen) * 1.5

    return edited_checkpoint(src, "-sinks", edit)


def test_greedy_tokens_and_logprobs_match_hf_with_chunked_prefill():
    path = checkpoint()
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=32)
    _assert_matches_hf(path, llm, _prompts(8, 1, 100, seed=11))
    _assert_no_leak(llm)


def test_a_prefix_served_from_the_cache_gives_hfs_tokens():
    path = checkpoint()
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=32)
    prefix = _prompts(1, 64, 64, seed=5)[0]  # 4 blocks of 16, well past the window
    _assert_matches_hf(path, llm, [prefix + [7]])
    before = llm.stats().prefix_cache_hits
    _assert_matches_hf(path, llm, [prefix + [8, 9], prefix + [10, 11, 12] * 7])
    assert llm.stats().prefix_cache_hits - before >= 2 * 64
    _assert_no_leak(llm)


def test_the_kv_plan_has_a_window_group_and_a_full_group():
    llm = LLM(model=checkpoint(), kv_cache_memory_bytes=KV_BYTES)
    groups = llm.llm_engine.core.kv_cache_config.groups
    assert sorted((g.name, len(g.layer_names)) for g in groups) == [("full", 2), (f"sliding_window_{WINDOW}", 2)]
    model = llm.llm_engine.core.executor.worker.runner.model
    assert [a.sliding_window for a in model.attention_layers()] == [WINDOW, None, WINDOW, None]
    assert all(isinstance(a, SinkAttention) for a in model.attention_layers())


def test_an_mxfp4_checkpoint_is_refused_naming_the_quantization(tmp_path):
    dst = tmp_path / "mxfp4"
    shutil.copytree(checkpoint(), dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="mxfp4"):
        GridserveConfig.from_kwargs(model=str(dst)).finalize()
    # and the model itself, should a config reach it unchecked
    config = GridserveConfig.from_kwargs(model=checkpoint()).finalize()
    config.model.hf_config["quantization_config"] = {"quant_method": "mxfp4"}
    with pytest.raises(ConfigError, match="mxfp4") as refused:
        load_model(config, torch.device("cpu"))
    assert refused.value.field == "model.hf_config.quantization_config"


# ---- SinkAttention alone ------------------------------------------------------------------------------
def _eager(q, k, v, sinks, scale, window):
    """transformers' eager gpt-oss attention for one fresh sequence ([tokens, heads, d] in and out)."""
    n, heads = q.shape[0], q.shape[1]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    i, j = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
    mask = (j <= i) & ((i - j < window) if window else True)
    scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.view(-1, 1, 1).expand(-1, n, 1)], dim=-1)
    probs = torch.softmax(logits - logits.max(-1, keepdim=True).values, dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("window", [None, 5])
def test_sink_attention_over_the_cache_in_chunks_equals_eager_and_reads_no_block_before_the_window(window):
    torch.manual_seed(0)
    heads, kv_heads, d, block, n = 4, 2, 8, 4, 23
    attn = SinkAttention(heads, d, kv_heads, d**-0.5, Shard(0, heads, heads), sliding_window=window)
    attn.sinks.data.copy_(torch.randn(heads) * 2)
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
    want = _eager(q, k, v, attn.sinks.data, d**-0.5, window)
    blocks = [3, 1, 5, 2, 6, 4]  # block 0 is the null block: poisoned, never read
    attn.kv_cache = torch.full((2, 7, block, kv_heads, d), float("nan"))
    got = torch.empty_like(q)
    done = 0
    for chunk in (9, 1, 6, 7):  # a chunked prefill, then decode-sized steps
        end = done + chunk
        table = torch.tensor([blocks], dtype=torch.int32)
        if window:  # what the window group leaves: blocks wholly before the window handed back
            first = max(0, done - window + 1) // block
            table[0, :first] = 0
        slots = torch.tensor([blocks[p // block] * block + p % block for p in range(done, end)])
        meta = AttentionMetadata(query_start_loc=torch.tensor([0, chunk], dtype=torch.int32),
                                 seq_lens=torch.tensor([end], dtype=torch.int32), block_table=table,
                                 slot_mapping=slots, max_query_len=chunk)
        out = attn(q[done:end].reshape(chunk, -1), k[done:end].reshape(chunk, -1), v[done:end].reshape(chunk, -1),
                   meta)
        got[done:end] = out.view(chunk, heads, d)
        done = end
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sink_attention_before_the_cache_is_bound_attends_over_the_steps_own_tokens():
    torch.manual_seed(1)
    heads, kv_heads, d = 4, 1, 8
    attn = SinkAttention(heads, d, kv_heads, 0.3, Shard(0, heads, heads), sliding_window=3)
    attn.sinks.data.copy_(torch.randn(heads))
    lens = [5, 8]
    q, k, v = torch.randn(13, heads, d), torch.randn(13, kv_heads, d), torch.randn(13, kv_heads, d)
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 5, 13], dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32),
                             block_table=torch.zeros(2, 1, dtype=torch.int32),
                             slot_mapping=torch.zeros(13, dtype=torch.int64), max_query_len=8)
    got = attn(q.reshape(13, -1), k.reshape(13, -1), v.reshape(13, -1), meta).view(13, heads, d)
    want = torch.cat([_eager(q[:5], k[:5], v[:5], attn.sinks.data, 0.3, 3),
                      _eager(q[5:], k[5:], v[5:], attn.sinks.data, 0.3, 3)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- split in two, in one process (test_zoo_split's harness) -------------------------------------------
def test_tensor_parallel_2_gives_the_single_models_logits():
    path, exchange = checkpoint(), _Exchange(2)
    single = _logits(_load(path, ParallelState.single()))
    ranks = [_load(path, ThreadRank(RankLayout(rank, 2, 1), exchange=exchange), tensor_parallel_size=2)
             for rank in (0, 1)]
    assert ranks[1].model.layers[0].self_attn.attn.sinks.shape == (2,)  # its own heads' sinks
    assert ranks[1].model.layers[0].mlp.experts.gate_up_proj.shape == (4, 2 * 16, 64)  # half of each expert
    report = ranks[1].load_report
    assert report.fraction("model.layers.0.mlp.experts.gate_up_proj") == 0.5  # read, not just kept
    assert report.fraction("model.layers.0.mlp.experts.down_proj") == 0.5
    assert report.fraction("model.layers.0.mlp.router.weight") == 1.0  # replicated
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(_logits, ranks)
    assert second is None
    torch.testing.assert_close(first, single, rtol=1e-4, atol=1e-4)


def test_pipeline_parallel_2_gives_the_single_models_logits():
    path = checkpoint()
    single = _logits(_load(path, ParallelState.single()))
    first, last = (_load(path, ParallelState(RankLayout(rank, 1, 2)), pipeline_parallel_size=2) for rank in (0, 1))
    handed = _logits(first)
    assert isinstance(handed, tuple) and first.logits_head is None
    torch.testing.assert_close(_logits(last, handed), single, rtol=1e-4, atol=1e-4)

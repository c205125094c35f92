"""The LayerNorm decoder family (GPT-2, GPT-J, GPT-NeoX, Phi, StableLM, Starcoder2, Falcon, Bloom) is
token-exact with transformers on tiny random checkpoints built by transformers' own classes.

Each checkpoint's shape is chosen to catch a mistake: head_dim != hidden / heads, MQA and GQA,
tied and untied (biased) heads, partial and interleaved rotary, both residual layouts, Q/K
LayerNorms, ALiBi on a head count that is not a power of two, a sliding window shorter than the
prompts. One engine per checkpoint generates all prompts in one call; greedy tokens must equal
transformers' and the chosen tokens' logprobs agree within 1e-4.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gridserve import LLM, SamplingParams
from gridserve.services.worker.loader import load_model
from gridserve.services.worker.models import construct_model, get_model_class
from gridserve.services.worker.models.layernorm_decoder import DecoderSpec
from gridserve.services.worker.parallel_layers import ColumnParallelLinear, RowParallelLinear
from gridserve.services.worker.parallel_state import ParallelState, set_parallel_state
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.parallel import RankLayout
from tests.zoo import zoo_checkpoint

from .hf_reference import hf_greedy, hf_model

MAX_TOKENS = 16
KV_BYTES = 32 << 20
_SIZES = {"num_hidden_layers": 2, "max_position_embeddings": 512}

# name -> (transformers config class, config): what each shape pins down
CHECKPOINTS = {
    # Conv1D (transposed) fused c_attn, learned positions, tied head, scale / (layer + 1)
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 512, "n_inner": 96,
                            "scale_attn_by_inverse_layer_idx": True}),
    # interleaved rotary on 8 of 16 dims, parallel residual on one norm, biased untied head
    "gptj": ("GPTJConfig", {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 512, "rotary_dim": 8,
                            "n_inner": 128}),
    # per-head [heads, 3, d] fused QKV, rotary_pct, parallel residual on two norms
    "gpt_neox": ("GPTNeoXConfig", {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
                                   "rotary_pct": 0.5, **_SIZES}),
    # sequential residual, no attention biases, tanh GELU
    "gpt_neox-sequential": ("GPTNeoXConfig", {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
                                              "use_parallel_residual": False, "attention_bias": False,
                                              "hidden_act": "gelu_new", **_SIZES}),
    # GQA, shared Q/K LayerNorm, partial rotary 0.5, biased untied head
    "phi": ("PhiConfig", {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "intermediate_size": 128, "qk_layernorm": True, **_SIZES}),
    # GQA, per-head Q/K LayerNorms, Q/K/V biases, gated MLP, sequential (StableLM's default)
    "stablelm": ("StableLmConfig", {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "intermediate_size": 128, "qk_layernorm": True, "use_qkv_bias": True,
                                    **_SIZES}),
    # MQA, head_dim 24, biases, a 32-token window under prompts of up to 120, untied head
    "starcoder2": ("Starcoder2Config", {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
                                        "head_dim": 24, "intermediate_size": 128, "sliding_window": 32,
                                        "tie_word_embeddings": False, **_SIZES}),
    # new decoder architecture: 8 query heads in 2 KV groups, two norms in parallel
    "falcon-new": ("FalconConfig", {"hidden_size": 64, "num_attention_heads": 8, "num_kv_heads": 2,
                                    "new_decoder_architecture": True, "ffn_hidden_size": 96, **_SIZES}),
    # Falcon-7B: multi-query, parallel attention on one norm
    "falcon-mqa": ("FalconConfig", {"hidden_size": 64, "num_attention_heads": 4, "multi_query": True,
                                    "parallel_attn": True, **_SIZES}),
    # Falcon-RW: ALiBi (scaled like transformers), per-head QKV, sequential, biases, untied head
    "falcon-alibi": ("FalconConfig", {"hidden_size": 64, "num_attention_heads": 8, "alibi": True,
                                      "multi_query": False, "parallel_attn": False, "bias": True,
                                      "tie_word_embeddings": False, **_SIZES}),
    # ALiBi over 6 heads (slopes from two bases), embedding LayerNorm, per-head QKV, LayerNorm outputs
    # as the residual stream
    "bloom": ("BloomConfig", {"hidden_size": 96, "n_head": 6, "n_layer": 2,
                              "apply_residual_connection_post_layernorm": True}),
}
FAST = ("gpt2", "falcon-new")  # the fast core; the rest are marked slow

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(name)``: the folder of tiny checkpoint ``name`` (built once, then cached)."""
    built: dict[str, Path] = {}

    def get(name: str) -> str:
        if name not in built:
            config_class, config = CHECKPOINTS[name]
            built[name] = zoo_checkpoint(f"gpt-family-{name}", config_class, **config)
        return str(built[name])

    return get


def _prompts(count: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 4096) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def _greedy(logprobs: int | None = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=logprobs)


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | None = None):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params or _greedy(), use_tqdm=False)
    return [o.outputs[0] for o in outs]


@torch.inference_mode()
def _hf_logprobs(path: str, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' logprob of each of ``tokens`` continuing ``prompt``."""
    logits = hf_model(path)(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1).tolist()


def _assert_matches_hf(path: str, prompts: list[list[int]], outputs) -> None:
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        reference = hf_greedy(path, prompt, MAX_TOKENS)
        assert out.token_ids == reference, f"prompt {i} (len {len(prompt)}) diverges from transformers"
        if out.logprobs:
            ours = [entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs)]
            assert ours == pytest.approx(_hf_logprobs(path, prompt, reference), abs=1e-4), f"prompt {i}"


def _assert_no_leak(llm: LLM) -> None:
    kv = llm.llm_engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in CHECKPOINTS])
def test_eight_prompts_greedy_tokens_and_logprobs_match_transformers(name, checkpoint):
    path = checkpoint(name)
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES)
    try:
        prompts = _prompts(8, 1, 120, seed=1)
        _assert_matches_hf(path, prompts, _generate(llm, prompts))
        _assert_no_leak(llm)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_sliding_window_prefix_cache_past_the_window_matches_transformers(checkpoint):
    path = checkpoint("starcoder2")  # window 32: the shared prefix is five windows long
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES)
    try:
        prefix = _prompts(1, 160, 160, seed=2)[0]
        first = [prefix + [7, 8, 9]]
        _assert_matches_hf(path, first, _generate(llm, first))
        before = llm.stats().prefix_cache_hits
        rest = [prefix + tail for tail in ([10], [11, 12, 13], [14] * 20)]
        outputs = _generate(llm, rest)
        assert llm.stats().prefix_cache_hits - before >= 3 * 160, "each follower reuses the 10 prefix blocks"
        _assert_matches_hf(path, rest, outputs)
        _assert_no_leak(llm)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_sliding_window_chunked_prefill_under_a_32_token_budget_matches_transformers(checkpoint):
    path = checkpoint("starcoder2")
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=32)
    try:
        prompts = _prompts(6, 40, 150, seed=3)
        _assert_matches_hf(path, prompts, _generate(llm, prompts))
        _assert_no_leak(llm)
    finally:
        llm.shutdown()


@pytest.fixture
def rank_of(request):
    """``rank_of(path, rank, tp, pp)``: the model as one rank of a ``PP x TP`` grid, built without
    its peers (loading needs no collectives)."""

    def build(path: str, rank: int, tp: int, pp: int = 1):
        set_parallel_state(ParallelState(RankLayout(rank, tp, pp)))
        config = GridserveConfig.from_kwargs(model=path, tensor_parallel_size=tp,
                                             pipeline_parallel_size=pp).finalize()
        return load_model(config, torch.device("cpu"))

    request.addfinalizer(lambda: set_parallel_state(ParallelState.single()))
    return build


@pytest.mark.parametrize("name", ["gpt2", "gpt_neox", "falcon-new", "falcon-mqa", "stablelm"])
def test_each_tp_rank_loads_the_q_k_v_rows_of_its_own_heads(name, checkpoint, rank_of):
    """The fused layouts (Conv1D transposed, per head, per KV group, multi-query) and separate
    q/k/v all end as ``[Q; K; V]`` of the rank's heads (KV replicated when fewer than ranks)."""
    path = checkpoint(name)
    whole = rank_of(path, 0, 1).model.layers[0].self_attn.qkv_proj
    for rank in (0, 1):
        part = rank_of(path, rank, 2).model.layers[0].self_attn.qkv_proj
        for param in ("weight", "bias"):
            if getattr(whole, param) is None:
                continue
            blocks = getattr(whole, param).split(whole.output_sizes)
            expected = torch.cat([block[s.start : s.end] for block, s in zip(blocks, part.shards)])
            assert torch.equal(getattr(part, param), expected), f"rank {rank} {param}"


@pytest.mark.parametrize(("name", "head", "positions"), [("gpt2", "transformer.wte.weight", "transformer.wpe.weight"),
                                                      ("gptj", "lm_head.bias", None)])
def test_a_pipeline_stage_reads_only_its_layers_and_the_last_one_its_head(name, head, positions, checkpoint, rank_of):
    """Two stages of two layers: the first holds the embedding (and learned positions), the last
    the final norm and the head (GPT-2's tied head read again from the embedding, GPT-J's bias)."""
    path = checkpoint(name)
    whole = rank_of(path, 0, 1)
    first, last = rank_of(path, 0, 1, 2), rank_of(path, 1, 1, 2)
    read_first, read_last = set(first.load_report.read), set(last.load_report.read)
    assert read_first and all(".h.1." not in n for n in read_first) and "transformer.ln_f.weight" not in read_first
    assert read_last and all(".h.0." not in n for n in read_last) and "transformer.ln_f.weight" in read_last
    assert head in read_last and first.logits_head is None and len(last.attention_layers()) == 1
    if positions:
        assert positions in read_first and positions not in read_last
    assert torch.equal(last.logits_head.weight, whole.logits_head.weight)
    if name == "gptj":
        assert torch.equal(last.lm_head.bias, whole.lm_head.bias)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "tp", "pp"), [("bloom", 2, 1), ("gpt2", 1, 2)], ids=["bloom-tp2", "gpt2-pp2"])
def test_parallel_layouts_match_transformers(name, tp, pp, checkpoint):
    """TP: each rank attends with the ALiBi slopes of its own heads; PP: learned positions on the
    first stage, the tied head read again from the embedding by the last."""
    path = checkpoint(name)
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        prompts = _prompts(8, 1, 120, seed=4)
        _assert_matches_hf(path, prompts, _generate(llm, prompts, _greedy(None)))
    finally:
        llm.shutdown()


@pytest.mark.triton
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gptj", "bloom", "starcoder2"])
def test_triton_kernels_give_the_reference_tokens(name, checkpoint, monkeypatch):
    """GPT-J's interleaved partial rotary, Bloom's ALiBi and Starcoder2's window (a 40-token
    prompt over a 32-token window) through the Triton kernels (CPU interpreter)."""
    pytest.importorskip("triton")
    from gridserve.kernels import triton_ops

    llm = LLM(model=checkpoint(name), kv_cache_memory_bytes=8 << 20, max_model_len=128)
    try:
        prompts = [{"prompt_token_ids": list(range(11, 51))}, {"prompt_token_ids": [300, 301, 302]}]
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
        monkeypatch.setenv("GRIDSERVE_KERNELS", "reference")
        reference = llm.generate(prompts, params, use_tqdm=False)
        assert llm.reset_prefix_cache(), "the Triton run must recompute every token"
        calls = []
        original = triton_ops.paged_attention
        monkeypatch.setattr(triton_ops, "paged_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
        monkeypatch.setenv("GRIDSERVE_KERNELS", "triton")
        triton = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert calls, "the dispatcher did not pick the Triton kernels"
    for ref, tri in zip(reference, triton):
        assert tri.outputs[0].token_ids == ref.outputs[0].token_ids
        for ref_lp, tri_lp in zip(ref.outputs[0].logprobs, tri.outputs[0].logprobs):
            assert [tri_lp[t].logprob for t in ref_lp] == pytest.approx([lp.logprob for lp in ref_lp.values()], abs=1e-4)


@pytest.mark.slow
def test_int8_quantizes_every_projection_and_stays_close_to_transformers(checkpoint):
    path = checkpoint("gpt_neox")
    config = GridserveConfig.from_kwargs(model=path, quantization="int8").finalize()
    model = load_model(config, torch.device("cpu"))
    projections = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert len(projections) == 2 * 4 and all(m.qweight is not None for m in projections)
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, quantization="int8")
    try:
        prompts = _prompts(8, 1, 120, seed=5)
        outputs = _generate(llm, prompts, _greedy(5))
    finally:
        llm.shutdown()
    same = 0
    for prompt, out in zip(prompts, outputs):
        reference = hf_greedy(path, prompt, MAX_TOKENS)
        same += out.token_ids == reference
        # int8 may flip a near-tie (these random models have many): at the first difference the
        # reference token must be among our top 5 (vLLM's check_logprobs_close); later ones differ
        diverged = next((i for i, (a, b) in enumerate(zip(out.token_ids, reference)) if a != b), None)
        assert diverged is None or reference[diverged] in out.logprobs[diverged]
    assert same >= len(prompts) // 2


def _build(tmp_path: Path, config: dict, **engine) -> None:
    """Build the model of a checkpoint holding only ``config`` (on the meta device: no weights)."""
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, **config}))
    gridserve_config = GridserveConfig.from_kwargs(model=str(tmp_path), **engine).finalize()
    with torch.device("meta"):
        construct_model(get_model_class(config["architectures"][0]), gridserve_config)


_GPT2 = {"architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 64,
         "vocab_size": 4096}
_FALCON = {"architectures": ["FalconForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 2, "vocab_size": 4096}
_PHI = {"architectures": ["PhiForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
        "num_hidden_layers": 2, "vocab_size": 4096}


@pytest.mark.parametrize(("config", "field"), [
    ({**_GPT2, "add_cross_attention": True}, "model.hf_config.add_cross_attention"),
    ({**_GPT2, "activation_function": "gelu_10"}, "model.hf_config.activation_function"),
    ({**_FALCON, "new_decoder_architecture": True, "parallel_attn": False}, "model.hf_config.parallel_attn"),
    ({**_FALCON, "parallel_attn": True, "num_ln_in_parallel_attn": 2}, "model.hf_config.num_ln_in_parallel_attn"),
    ({**_PHI, "tie_word_embeddings": True}, "model.hf_config.tie_word_embeddings"),
    ({**_PHI, "num_key_value_heads": 3}, "model.hf_config.num_key_value_heads"),
    ({**_PHI, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "model.hf_config.rope_parameters.rope_type"),
], ids=["cross-attention", "activation", "falcon-sequential-new-arch", "falcon-two-norms-old-arch", "tied-biased-head",
        "kv-heads", "rope-type"])
def test_a_config_the_model_cannot_honour_is_refused_naming_the_field(config, field, tmp_path):
    with pytest.raises(ConfigError) as info:
        _build(tmp_path, config)
    assert info.value.field == field


def _spec(architecture: str, **config) -> DecoderSpec:
    return get_model_class(architecture).decoder_spec(SimpleNamespace(**config))


def test_defaults_and_older_spellings_are_read_as_transformers_reads_them():
    gpt2 = _spec("GPT2LMHeadModel", **_GPT2)
    assert gpt2.tie_word_embeddings and gpt2.learned_positions == 64 and gpt2.attention.scale == 16**-0.5
    assert _spec("GPT2LMHeadModel", **_GPT2, scale_attn_weights=False).attention.scale == 1.0
    # Pythia's config.json: rotary_pct / rotary_emb_base, no rope_parameters
    neox = _spec("GPTNeoXForCausalLM", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                 intermediate_size=128, vocab_size=4096, rotary_pct=0.25, rotary_emb_base=5000)
    assert neox.attention.rotary.rotary_dim == 4 and neox.attention.rotary.params["rope_theta"] == 5000
    assert neox.parallel_residual and neox.mlp_norm
    # Phi-2's config.json: top-level partial_rotary_factor and rope_theta
    phi = _spec("PhiForCausalLM", **_PHI, partial_rotary_factor=0.4, rope_theta=20000.0)
    assert phi.attention.rotary.rotary_dim == 6 and phi.attention.rotary.params["rope_theta"] == 20000.0
    assert phi.parallel_residual and not phi.mlp_norm and phi.head_bias
    stablelm = _spec("StableLmForCausalLM", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                     intermediate_size=128, vocab_size=4096, use_parallel_residual=True)
    assert stablelm.parallel_residual and not stablelm.mlp_norm and stablelm.attention.rotary.rotary_dim == 4
    falcon = _spec("FalconForCausalLM", **_FALCON, new_decoder_architecture=True, num_kv_heads=2,
                   num_ln_in_parallel_attn=1)
    assert falcon.parallel_residual and not falcon.mlp_norm and falcon.attention.num_kv_heads == 2
    assert _spec("FalconForCausalLM", **_FALCON).attention.num_kv_heads == 1  # multi_query by default


def test_own_config_names_size_the_engine(tmp_path):
    """GPT-2's config.json says n_layer / n_head / n_embd / n_positions; the engine must size from them."""
    (tmp_path / "config.json").write_text(json.dumps(_GPT2))
    model = GridserveConfig.from_kwargs(model=str(tmp_path)).finalize().model
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.max_model_len) == (2, 4, 16, 64)
    falcon = {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 8, "vocab_size": 4096}
    for extra, kv_heads in (({}, 1), ({"multi_query": False}, 8), ({"new_decoder_architecture": True, "num_kv_heads": 2}, 2)):
        (tmp_path / "config.json").write_text(json.dumps({**falcon, **extra}))
        assert GridserveConfig.from_kwargs(model=str(tmp_path)).finalize().model.num_kv_heads == kv_heads, extra

"""The Llama-family zoo (Qwen3, SmolLM3, OLMo 2, Granite, Phi-3, GLM-4, Cohere, Gemma 1/2/3, and
Mistral's sliding window) is token-exact with Hugging Face transformers on tiny random checkpoints
built with transformers' own classes.

Each checkpoint's shapes are picked to catch mistakes: ``head_dim`` != hidden / heads, GQA and MQA,
tied and untied heads, every option of its architecture set away from its neutral value (soft caps
that bite, multipliers != 1, windows shorter than the prompts). Greedy tokens must equal
transformers' on 8 prompts x 16 tokens and the chosen tokens' logprobs must be within 1e-4 of a
direct transformers forward. The window models also run with a 32-token step budget (chunked
prefill) and a shared prefix longer than the window served from the prefix cache.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from gridserve import LLM, SamplingParams
from gridserve.shared.errors import ConfigError
from tests.zoo import zoo_checkpoint

from .hf_reference import hf_greedy, hf_model
from .test_llm_matches_hf import _assert_no_leak, _prompts

MAX_TOKENS = 16
WINDOW = 24
KV_BYTES = 32 << 20
# a head_dim that is not hidden / heads (64 / 4 = 16), GQA (4 heads over 2 KV heads) by default
_BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 512, "tie_word_embeddings": False}


@dataclass(frozen=True)
class Zoo:
    """A tiny checkpoint: transformers config class, its fields over ``_BASE``, zoo options."""

    config_class: str
    config: dict = field(default_factory=dict)
    norm_offset: float = 0.0  # Gemma's norms scale by 1 + w
    window: bool = False  # a sliding window shorter than the prompts

    def path(self, name: str) -> str:
        config = {k: v for k, v in {**_BASE, **self.config}.items() if v is not None}  # None: leave the default
        return str(zoo_checkpoint(name, self.config_class, norm_offset=self.norm_offset, **config))


ZOO: dict[str, Zoo] = {
    "qwen3": Zoo("Qwen3Config", {"attention_bias": True}),
    # MQA, tied, NoPE on every second layer (1 and 3)
    "smollm3": Zoo("SmolLM3Config", {"num_hidden_layers": 4, "num_key_value_heads": 1, "no_rope_layer_interval": 2,
                                     "tie_word_embeddings": True, "mlp_bias": True}),
    "olmo2": Zoo("Olmo2Config", {"num_key_value_heads": 1}),  # MQA: a TP rank replicates the K head
    "granite": Zoo("GraniteConfig", {"num_key_value_heads": 1, "embedding_multiplier": 3.0, "residual_multiplier": 0.6,
                                     "attention_multiplier": 0.11, "logits_scaling": 1.25, "attention_bias": True}),
    # a window on every layer
    "phi3": Zoo("Phi3Config", {"sliding_window": WINDOW, "pad_token_id": 0}, window=True),
    "glm4": Zoo("Glm4Config", {"partial_rotary_factor": 0.5, "attention_bias": True}),
    "cohere": Zoo("CohereConfig", {"use_qk_norm": True, "logit_scale": 0.8, "tie_word_embeddings": True}),
    "gemma": Zoo("GemmaConfig", {"num_key_value_heads": 1, "tie_word_embeddings": True}, norm_offset=1.0),
    "gemma2": Zoo("Gemma2Config", {"num_hidden_layers": 4, "sliding_window": WINDOW, "query_pre_attn_scalar": 40,
                                   "attn_logit_softcapping": 4.0, "final_logit_softcapping": 8.0,
                                   "tie_word_embeddings": True}, norm_offset=1.0, window=True),
    "gemma3": Zoo("Gemma3TextConfig", {"num_hidden_layers": 4, "sliding_window": WINDOW, "query_pre_attn_scalar": 20,
                                       "final_logit_softcapping": 8.0,
                                       "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                                       "sliding_attention"],
                                       "rope_parameters": {
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                           "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                              "rope_theta": 100_000.0}}},
                      norm_offset=1.0, window=True),
    "mistral": Zoo("MistralConfig", {"sliding_window": WINDOW}, window=True),
    # YaRN (static: its attention factor scales cos and sin) past an original length of 128
    "qwen3_yarn": Zoo("Qwen3Config", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                          "original_max_position_embeddings": 128}}),
}
# LongRoPE on half of each head (transformers checks its factors against hidden / heads, so no head_dim)
PHI3_LONGROPE = Zoo("Phi3Config", {"head_dim": None, "partial_rotary_factor": 0.5, "original_max_position_embeddings": 64,
                                   "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                       "short_factor": [1.0, 1.3, 1.7, 2.2],
                                                       "long_factor": [1.5, 2.5, 4.0, 7.0]}})
WINDOWED = [name for name, zoo in ZOO.items() if zoo.window]


@functools.cache
def checkpoint(name: str) -> str:
    return ZOO[name].path(f"{name}-family")


def _greedy(n: int = MAX_TOKENS, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, logprobs=logprobs)


@torch.inference_mode()
def _hf_teacher_forced(path: str, prompt: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy choice at each position of ``prompt + tokens`` (EOS masked, as
    ``min_new_tokens`` does) and its logprob of each of ``tokens``, in one forward pass."""
    model = hf_model(path)
    ids = torch.tensor([prompt + tokens[:-1]])
    logprobs = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 :].float(), -1)
    chosen = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    eos = model.config.eos_token_id
    logprobs[:, eos if isinstance(eos, list) else [eos]] = -float("inf")
    return logprobs.argmax(-1).tolist(), chosen


def _assert_matches_hf(path: str, llm: LLM, prompts: list[list[int]]) -> None:
    """Greedy tokens equal transformers'; the chosen tokens' logprobs within 1e-4 of its forward.

    transformers' argmax after each prefix of our tokens is our next token at every position exactly
    when its own greedy decoding yields our tokens, so one teacher-forced forward per prompt checks
    both (``hf_greedy``'s token-by-token generate is ~20x slower).
    """
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(logprobs=1), use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        got = list(out.outputs[0].token_ids)
        greedy, ref = _hf_teacher_forced(path, prompt, got)
        assert got == greedy, f"prompt {i} (len {len(prompt)}) diverges from HF"
        ours = [entry[token].logprob for token, entry in zip(got, out.outputs[0].logprobs)]
        assert max(abs(a - b) for a, b in zip(ours, ref)) < 1e-4, (i, ours, ref)


@pytest.mark.parametrize("name", list(ZOO))
def test_greedy_tokens_and_logprobs_match_hf(name):
    path = checkpoint(name)
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES)
    # the window models see prompts up to 4x their window
    prompts = _prompts(8, 1, 100, seed=11)
    _assert_matches_hf(path, llm, prompts)
    # and one prompt through transformers' own generate loop (its KV cache, its window masks)
    out = llm.generate([{"prompt_token_ids": prompts[0]}], _greedy(), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(path, prompts[0], MAX_TOKENS)
    _assert_no_leak(llm)


@pytest.mark.parametrize("name", WINDOWED)
def test_window_models_match_hf_with_chunked_prefill_and_a_cached_prefix_past_the_window(name):
    path = checkpoint(name)
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=32)
    prefix = _prompts(1, 64, 64, seed=12)[0]  # 4 blocks of 16, well past the 24-token window
    _assert_matches_hf(path, llm, [prefix + [7, 8, 9]] + _prompts(3, 40, 90, seed=13))
    before = llm.stats().prefix_cache_hits
    _assert_matches_hf(path, llm, [prefix + tail for tail in ([10], [11, 12, 13], [14] * 20, [15] * 33)])
    assert llm.stats().prefix_cache_hits - before >= 4 * 64
    _assert_no_leak(llm)


def test_window_models_say_at_start_that_the_kv_cache_keeps_only_the_window(caplog):
    with caplog.at_level("INFO", logger="gridserve.services.worker.models.windows"):
        LLM(model=checkpoint("mistral"), kv_cache_memory_bytes=KV_BYTES)
    assert any("sliding window" in r.message and "keeps only the window" in r.message for r in caplog.records)


def test_a_window_no_sequence_can_outgrow_is_full_attention():
    llm = LLM(model=checkpoint("mistral"), kv_cache_memory_bytes=KV_BYTES, max_model_len=WINDOW)
    model = llm.llm_engine.core.executor.worker.runner.model
    assert [a.sliding_window for a in model.attention_layers()] == [None, None]


def test_each_layer_gets_its_window_and_rope_from_layer_types():
    model = LLM(model=checkpoint("gemma3"), kv_cache_memory_bytes=KV_BYTES).llm_engine.core.executor.worker.runner.model
    assert [a.sliding_window for a in model.attention_layers()] == [WINDOW, WINDOW, None, WINDOW]
    ropes = [layer.self_attn.rotary_emb for layer in model.model.layers]
    assert ropes[0] is ropes[1] is ropes[3] and ropes[2] is not ropes[0]  # local and global RoPE
    smol = LLM(model=checkpoint("smollm3"), kv_cache_memory_bytes=KV_BYTES).llm_engine.core.executor.worker.runner.model
    assert [layer.self_attn.rotary_emb is None for layer in smol.model.layers] == [False, True, False, True]


def test_gemma_checkpoints_have_decisive_greedy_logits():
    """The zoo spreads the final norm's effective weight (1 + w) so greedy is decisive."""
    for name in ("gemma", "gemma2", "gemma3"):
        with torch.inference_mode():
            logits = hf_model(checkpoint(name))(torch.tensor([_prompts(1, 40, 40, seed=14)[0]])).logits[0]
        top = logits.topk(2, -1).values
        assert logits.std() > 1.0 and (top[:, 0] - top[:, 1]).min() > 1e-3, name


# ---- refused at start, naming the field ------------------------------------------------------------
def _zoo_with(name: str, tag: str, **config: Any) -> str:
    zoo = ZOO[name]
    return Zoo(zoo.config_class, {**zoo.config, **config}, zoo.norm_offset).path(f"{name}-{tag}")


def _refused(path: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        LLM(model=path, kv_cache_memory_bytes=KV_BYTES)
    return info.value


def test_an_unknown_rope_type_is_refused_naming_the_field(tmp_path):
    import json
    import shutil

    folder = tmp_path / "qwen3-dynamic"
    shutil.copytree(checkpoint("qwen3"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(config))
    error = _refused(str(folder))
    assert error.field == "model.hf_config.rope_parameters.rope_type" and "dynamic" in str(error)


def test_malformed_layer_types_are_refused_naming_the_field(tmp_path):
    import json
    import shutil

    folder = tmp_path / "gemma2-layer-types"
    shutil.copytree(checkpoint("gemma2"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]
    (folder / "config.json").write_text(json.dumps(config))
    assert _refused(str(folder)).field == "model.hf_config.layer_types"


# ---- parallel layouts (gloo workers on the CPU) ------------------------------------------------------
def _assert_parallel_matches_hf(name: str, **parallel: int) -> None:
    path = checkpoint(name)
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, **parallel)
    try:
        _assert_matches_hf(path, llm, _prompts(8, 1, 100, seed=11))
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "gemma2", "phi3", "olmo2", "cohere"])
def test_tensor_parallel_2_matches_hf(name):
    """Heads, MLP rows and the vocabulary split over two ranks; OLMo 2's whole-projection Q/K norms
    all-reduce their sums of squares (its single K head replicated), Cohere's per-head norms load
    their heads' rows."""
    _assert_parallel_matches_hf(name, tensor_parallel_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3", "olmo2", "cohere"])
def test_pipeline_parallel_2_matches_hf(name):
    """Two stages of two layers: Gemma 3's embedding scale on the first, its per-layer windows and
    RoPE on both, the final soft cap on the last; OLMo 2 (no norm before its blocks) and Cohere
    (parallel residual) hand ``(hidden, residual)`` across the boundary."""
    _assert_parallel_matches_hf(name, pipeline_parallel_size=2)


# ---- RoPE types ---------------------------------------------------------------------------------------
def _hf_rope(config_class: str, **config: Any) -> tuple[torch.Tensor, float, Any]:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = getattr(transformers, config_class)(**config)
    kind = hf.rope_parameters["rope_type"]
    return *ROPE_INIT_FUNCTIONS[kind](hf), hf


@pytest.mark.parametrize(("config_class", "config"), [
    ("Qwen3Config", {"rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6,
                                         "original_max_position_embeddings": 4096, "beta_fast": 16.0}}),
    ("Qwen3Config", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "mscale": 0.8,
                                         "mscale_all_dim": 0.5, "original_max_position_embeddings": 8192,
                                         "truncate": False}}),
    ("Phi3Config", {"rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 10 for i in range(16)],
                                     "long_factor": [2.0 + i for i in range(16)]},
                    "original_max_position_embeddings": 4096}),
    ("LlamaConfig", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                         "rope_theta": 500000.0}}),
], ids=["yarn", "yarn-mscale", "phi3-longrope", "llama3"])
def test_rope_frequencies_and_attention_factor_match_transformers(config_class, config):
    from types import SimpleNamespace

    from gridserve.services.worker.layers import RotaryEmbedding, rope_parameters
    from gridserve.services.worker.models.phi3 import phi3_rope

    sizes = {"hidden_size": 1024, "num_attention_heads": 32, "head_dim": 32, "max_position_embeddings": 32768}
    inv_freq, factor, hf = _hf_rope(config_class, **sizes, **config)
    raw = SimpleNamespace(**sizes, **config)  # config.json as written, before transformers standardizes it
    params = phi3_rope(raw) if config_class == "Phi3Config" else rope_parameters(raw)
    rope = RotaryEmbedding(32, 32, sizes["max_position_embeddings"], params)
    assert torch.allclose(rope.inv_freq, inv_freq, rtol=1e-6, atol=0) and rope.attention_factor == pytest.approx(factor)
    if params["rope_type"] == "longrope":  # the long factors from the original length on
        long_freq, _ = _hf_long(hf)
        assert rope.long_from == 4096 and torch.allclose(rope.long_inv_freq, long_freq, rtol=1e-6, atol=0)


def test_older_config_spellings_of_rope_are_read_as_transformers_reads_them():
    from types import SimpleNamespace

    from gridserve.services.worker.models.gemma import gemma3_rope
    from gridserve.services.worker.models.phi3 import phi3_rope

    gemma3 = SimpleNamespace(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                             max_position_embeddings=32768)
    assert gemma3_rope(gemma3, "sliding_attention") == {"rope_type": "default", "rope_theta": 1e4}
    assert gemma3_rope(gemma3, "full_attention") == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    phi3 = SimpleNamespace(rope_theta=1e4, rope_scaling={"type": "su", "short_factor": [1.0], "long_factor": [2.0]},
                           original_max_position_embeddings=4096, max_position_embeddings=131072)
    assert phi3_rope(phi3) == {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0],
                               "rope_theta": 1e4, "original_max_position_embeddings": 4096}


def _hf_long(hf) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS["longrope"](hf, seq_len=hf.rope_parameters["original_max_position_embeddings"] + 1)


@pytest.mark.slow
def test_longrope_takes_the_long_factors_from_the_original_length_on():
    """Prompts shorter than the original 64 positions, continued past it. Up to the crossing the
    tokens are transformers' generate's (short factors); after it, transformers' model with its
    cache kept across the crossing (its rotary switches to the long factors for the new positions),
    which is what a position-keyed cos/sin table computes. (transformers' generate itself drops the
    cache at the crossing and re-encodes everything with the long factors: ``phi3`` module.)"""
    path = PHI3_LONGROPE.path("phi3-longrope")
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES)
    prompts = _prompts(4, 50, 60, seed=15)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(logprobs=1), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens, ref = _hf_incremental(path, prompt)
        assert list(out.outputs[0].token_ids) == tokens
        ours = [entry[token].logprob for token, entry in zip(tokens, out.outputs[0].logprobs)]
        assert max(abs(a - b) for a, b in zip(ours, ref)) < 1e-4
        before_crossing = 64 - len(prompt) + 1
        assert tokens[:before_crossing] == hf_greedy(path, prompt, MAX_TOKENS)[:before_crossing]


@torch.inference_mode()
def _hf_incremental(path: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens (EOS masked) and their logprobs from transformers' model fed one token at a
    time over one KV cache."""
    from transformers import DynamicCache

    model = hf_model(path)
    cache = DynamicCache(config=model.config)
    step, tokens, logprobs = torch.tensor([prompt]), [], []
    for _ in range(MAX_TOKENS):
        out = torch.log_softmax(model(step, cache=cache, use_cache=True).logits[0, -1].float(), -1)
        masked = out.clone()
        masked[model.config.eos_token_id] = -float("inf")
        tokens.append(int(masked.argmax()))
        logprobs.append(float(out[tokens[-1]]))
        step = torch.tensor([[tokens[-1]]])
    return tokens, logprobs


# ---- quantization -------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "gemma2"])
def test_int8_weights_and_a_bf16_kv_cache_meet_the_kl_bars(name):
    """The issue's KL bars (``benchmarks.quantization.BARS``) against fp32 on a held-out random text,
    and >= 90% teacher-forced argmax agreement for int8 + bf16 KV. Free-running greedy agreement is
    not asserted: on random weights it parts at the first near-tie (as ``test_quantization`` notes)."""
    from benchmarks import quantization as bench

    modes = ["kv-bf16", "int8+kv-bf16"]
    results = {r.mode: r for r in bench.evaluate(checkpoint(name), _prompts(1, 256, 256, seed=20)[0],
                                                  _prompts(4, 16, 40, seed=21), modes, MAX_TOKENS,
                                                  kv_cache_memory_bytes=KV_BYTES)}
    for mode in modes:
        assert results[mode].mean_kl <= bench.BARS[mode][0], results[mode]
    assert results["int8+kv-bf16"].argmax_agreement >= 0.9, results["int8+kv-bf16"]


# ---- the Triton kernels (CPU interpreter) ---------------------------------------------------------
@pytest.mark.triton
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "glm4"])
def test_triton_kernels_give_the_reference_kernels_tokens(name, monkeypatch):
    """Gemma 2's window and soft cap, GLM-4's partial interleaved RoPE through the Triton kernels."""
    pytest.importorskip("triton")
    from gridserve.kernels import triton_ops

    llm = LLM(model=checkpoint(name), kv_cache_memory_bytes=8 << 20, max_model_len=128)
    prompts = [{"prompt_token_ids": p} for p in _prompts(2, 3, 40, seed=16) + _prompts(1, 40, 40, seed=17)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
    monkeypatch.setenv("GRIDSERVE_KERNELS", "reference")
    reference = llm.generate(prompts, params, use_tqdm=False)
    assert llm.reset_prefix_cache(), "the Triton run must recompute every token"
    calls = []
    original = triton_ops.paged_attention
    monkeypatch.setattr(triton_ops, "paged_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setenv("GRIDSERVE_KERNELS", "triton")
    triton = llm.generate(prompts, params, use_tqdm=False)
    assert calls, "the dispatcher did not pick the Triton kernels"
    for ref, tri in zip(reference, triton):
        assert tri.outputs[0].token_ids == ref.outputs[0].token_ids
        for ref_lp, tri_lp in zip(ref.outputs[0].logprobs, tri.outputs[0].logprobs):
            for token, lp in ref_lp.items():
                assert tri_lp[token].logprob == pytest.approx(lp.logprob, abs=1e-4)

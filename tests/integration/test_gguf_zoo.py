"""Every architecture gridserve builds that GGUF has a name for: a tiny zoo checkpoint written as a
float32 GGUF the way llama.cpp's converter lays it out (``tests/gguf_files.py``) serves the same
greedy tokens as the safetensors folder it came from.

Each checkpoint keeps what GGUF can carry set away from its neutral value (soft caps that bite,
multipliers != 1, windows shorter than the prompts, partial rotary, fused Q/K/V layouts, biases,
Q/K norms, tied and untied heads, GQA and MQA); what GGUF cannot carry stays at the value llama.cpp
assumes (Gemma's ``query_pre_attn_scalar`` = head size, Granite's and Phi-3's head size = width /
heads, Phi-2's one KV head per head, Bloom's standard residual). A key a model needs and the file
lacks is refused at start, naming it.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import dataclass, field

import pytest

from gridserve import LLM, SamplingParams
from gridserve.shared.config import ModelConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.gguf_architectures import STARCODER2_WINDOW
from tests.gguf_files import write_gguf
from tests.zoo import zoo_checkpoint

WINDOW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, ignore_eos=True, logprobs=5)
_LLAMA_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": False}
_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "max_position_embeddings": 512}
_GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100_000.0}}
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 1.7, 2.2],
             "long_factor": [1.5, 2.5, 4.0, 7.0]}


@dataclass(frozen=True)
class Case:
    """A zoo checkpoint: its transformers config class and fields, and the gridserve class its GGUF builds."""

    architecture: str
    config_class: str
    config: dict = field(default_factory=dict)
    norm_offset: float = 0.0  # Gemma's norms scale by 1 + w

    def folder(self, name: str):
        return zoo_checkpoint(f"gguf-{name}", self.config_class, norm_offset=self.norm_offset, **self.config)


CASES: dict[str, Case] = {
    # MQA, tied, head size 24 != 64 / 4
    "gemma": Case("GemmaForCausalLM", "GemmaConfig",
                  {**_LLAMA_SIZES, "head_dim": 24, "num_key_value_heads": 1, "tie_word_embeddings": True}, 1.0),
    # both soft caps bite, a window on layers 0 and 2
    "gemma2": Case("Gemma2ForCausalLM", "Gemma2Config",
                   {**_LLAMA_SIZES, "num_hidden_layers": 4, "head_dim": 24, "sliding_window": WINDOW,
                    "query_pre_attn_scalar": 24, "attn_logit_softcapping": 4.0, "final_logit_softcapping": 8.0,
                    "tie_word_embeddings": True}, 1.0),
    # five window layers then a global one (local RoPE base, global linear scaling), final soft cap, untied
    "gemma3": Case("Gemma3ForCausalLM", "Gemma3TextConfig",
                   {**_LLAMA_SIZES, "num_hidden_layers": 6, "head_dim": 24, "sliding_window": WINDOW,
                    "query_pre_attn_scalar": 24, "final_logit_softcapping": 8.0, "rope_parameters": _GEMMA3_ROPE},
                   1.0),
    # fused qkv / gate_up, a window on every layer
    "phi3": Case("Phi3ForCausalLM", "Phi3Config", {**_LLAMA_SIZES, "sliding_window": WINDOW, "pad_token_id": 0}),
    # LongRoPE (factors as tensors) on half of each head
    "phi3-longrope": Case("Phi3ForCausalLM", "Phi3Config",
                          {**_LLAMA_SIZES, "partial_rotary_factor": 0.5, "original_max_position_embeddings": 64,
                           "rope_parameters": _LONGROPE}),
    # NoPE on every fourth layer (3: the step llama.cpp fixes), Q/K rows and biases permuted like
    # llama's, MLP biases, MQA, tied
    "smollm3": Case("SmolLM3ForCausalLM", "SmolLM3Config",
                    {**_LLAMA_SIZES, "num_hidden_layers": 4, "num_key_value_heads": 1, "no_rope_layer_interval": 4,
                     "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    "olmo2": Case("Olmo2ForCausalLM", "Olmo2Config", {**_LLAMA_SIZES, "head_dim": 24, "num_key_value_heads": 1}),
    # Q/K rows permuted like llama's, biases (permuted too), all four multipliers
    "granite": Case("GraniteForCausalLM", "GraniteConfig",
                    {**_LLAMA_SIZES, "num_key_value_heads": 1, "embedding_multiplier": 3.0, "residual_multiplier": 0.6,
                     "attention_multiplier": 0.11, "logits_scaling": 1.25, "attention_bias": True}),
    "cohere": Case("CohereForCausalLM", "CohereConfig",
                   {**_LLAMA_SIZES, "head_dim": 24, "use_qk_norm": True, "logit_scale": 0.8,
                    "tie_word_embeddings": True}),
    "glm4": Case("Glm4ForCausalLM", "Glm4Config",
                 {**_LLAMA_SIZES, "head_dim": 24, "partial_rotary_factor": 0.5, "attention_bias": True}),
    "starcoder2": Case("Starcoder2ForCausalLM", "Starcoder2Config",
                       {**_SIZES, "num_key_value_heads": 1, "head_dim": 24, "tie_word_embeddings": False}),
    # per-head Q/K LayerNorms (stacked in the file), Q/K/V biases, sequential residual
    "stablelm": Case("StableLmForCausalLM", "StableLmConfig",
                     {**_SIZES, "num_key_value_heads": 2, "qk_layernorm": True, "use_qkv_bias": True}),
    # Conv1D matrices transposed in the file, the head a copy of the embedding, 96-wide MLP (written 256)
    "gpt2": Case("GPT2LMHeadModel", "GPT2Config",
                 {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 512, "n_inner": 96}),
    # interleaved rotary on 8 of 16 dims, parallel residual on one LayerNorm, a biased untied head,
    # 128-wide MLP (written 256)
    "gptj": Case("GPTJForCausalLM", "GPTJConfig",
                 {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 512, "rotary_dim": 8, "n_inner": 128}),
    "phi2": Case("PhiForCausalLM", "PhiConfig", _SIZES),
    # per-head fused Q/K/V, half of each head rotated, parallel residual
    "gptneox": Case("GPTNeoXForCausalLM", "GPTNeoXConfig", {**_SIZES, "rotary_pct": 0.5}),
    # 40B layout: two LayerNorms, Q/K/V per KV group
    "falcon-40b": Case("FalconForCausalLM", "FalconConfig",
                       {**_SIZES, "num_attention_heads": 8, "num_kv_heads": 2, "new_decoder_architecture": True,
                        "ffn_hidden_size": 96}),
    # 11B layout: KV groups on one LayerNorm
    "falcon-11b": Case("FalconForCausalLM", "FalconConfig",
                       {**_SIZES, "num_attention_heads": 8, "num_kv_heads": 2, "new_decoder_architecture": True,
                        "num_ln_in_parallel_attn": 1}),
    # 7B layout: multi-query, one LayerNorm
    "falcon-7b": Case("FalconForCausalLM", "FalconConfig", {**_SIZES, "multi_query": True, "parallel_attn": True}),
    # ALiBi over 6 heads, embedding LayerNorm
    "bloom": Case("BloomForCausalLM", "BloomConfig", {"hidden_size": 96, "n_head": 6, "n_layer": 2}),
}
FAST = ("gemma2",)
# the layouts llama.cpp's converter rearranges (fused Q/K/V orders, transposes, stacked norms, 1 + w)
FAST_TENSORS = ("gemma2", "granite", "stablelm", "gpt2", "falcon-40b", "bloom")


def _llm(path) -> LLM:
    return LLM(model=str(path), kv_cache_memory_bytes=16 << 20, max_model_len=256)


def _prompts() -> list[list[int]]:
    """Three prompts, two longer than every window here."""
    rng = random.Random(7)
    return [[rng.randrange(6, 4096) for _ in range(n)] for n in (5, 41, 70)]


def _greedy(llm: LLM) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    """Greedy tokens and, at each step, the five most likely tokens' logprobs."""
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY,
                                                 use_tqdm=False)]
    top = [[{t: lp.logprob for t, lp in step.items()} for step in o.logprobs] for o in outs]
    return [list(o.token_ids) for o in outs], top


def _assert_same(got, want) -> None:
    """The same tokens, and at every step the same top-5 with logprobs within 1e-5 (float32 both
    ways; Gemma's stored ``1 + w`` minus 1 may differ from ``w`` in the last bit)."""
    assert got[0] == want[0]
    for got_steps, want_steps in zip(got[1], want[1]):
        for got_top, want_top in zip(got_steps, want_steps):
            assert got_top.keys() == want_top.keys()
            assert all(abs(got_top[t] - want_top[t]) < 1e-5 for t in want_top), (got_top, want_top)


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_float32_gguf_serves_the_safetensors_tokens(name, tmp_path):
    case = CASES[name]
    folder = case.folder(name)
    path = write_gguf(folder, tmp_path / f"{name}.gguf")
    from_gguf, from_folder = ModelConfig(model=str(path)).resolve(), ModelConfig(model=str(folder)).resolve()
    for key in ("architecture", "num_layers", "num_kv_heads", "head_dim", "vocab_size"):
        assert getattr(from_gguf, key) == getattr(from_folder, key), key
    assert from_gguf.architecture == case.architecture
    _assert_same(_greedy(_llm(path)), _greedy(_llm(folder)))


@pytest.mark.parametrize("name", [n if n in FAST_TENSORS else pytest.param(n, marks=pytest.mark.slow)
                                  for n in CASES])
def test_gguf_tensors_are_the_safetensors_tensors(name, tmp_path):
    """Every converter step undone: the same names, shapes and values (bit-exact; Gemma's norms,
    stored ``1 + w``, within float32 rounding of ``w + 1 - 1``)."""
    import torch
    from safetensors.torch import load_file

    from gridserve.services.worker.gguf_loader import iterate_gguf_weights

    folder = CASES[name].folder(name)
    path = write_gguf(folder, tmp_path / f"{name}.gguf")
    expected = load_file(str(folder / "model.safetensors"))
    got = {n: t.full() for n, t in iterate_gguf_weights(path, ModelConfig(model=str(path)).resolve().hf_config)}
    tied_copy = {"lm_head.weight"} - set(expected)  # GPT-2 / Bloom: the converter writes the head out
    assert set(got) - tied_copy == set(expected)
    for n, tensor in expected.items():
        if CASES[name].norm_offset and n.endswith("norm.weight"):
            assert torch.allclose(got[n], tensor, rtol=0, atol=1e-6), n
        else:
            assert torch.equal(got[n], tensor), n


# ---- refused at start, naming the field ------------------------------------------------------------
def _refused(path) -> str:
    with pytest.raises(ConfigError) as info:
        ModelConfig(model=str(path)).resolve()
    assert info.value.field == "model.model" and str(path) in str(info.value)
    return str(info.value)


@pytest.mark.parametrize(("name", "key"), [("gemma2", "gemma2.attn_logit_softcapping"),
                                           ("gemma2", "gemma2.final_logit_softcapping"),
                                           ("gemma2", "gemma2.attention.sliding_window"),
                                           ("granite", "granite.attention.scale"),
                                           ("granite", "granite.logit_scale"),
                                           ("cohere", "command-r.logit_scale")])
def test_a_file_without_a_key_its_model_needs_is_refused_naming_it(name, key, tmp_path):
    path = write_gguf(CASES[name].folder(name), tmp_path / f"{name}.gguf", drop_keys=[key])
    assert f"metadata {key} is missing" in _refused(path)


def test_a_starcoder2_file_without_its_window_is_served_up_to_the_window(tmp_path):
    """llama.cpp's converter writes no window for StarCoder2 (4096 in every release): such a file is
    served no further than the window, where full attention equals it."""
    folder = tmp_path / "starcoder2-long"
    shutil.copytree(CASES["starcoder2"].folder("starcoder2"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16384}))
    model = ModelConfig(model=str(write_gguf(folder, tmp_path / "starcoder2.gguf"))).resolve()
    assert model.max_model_len == STARCODER2_WINDOW and model.hf_config["sliding_window"] is None


def test_an_unsupported_architecture_lists_the_supported_ones(tmp_path):
    path = write_gguf(CASES["olmo2"].folder("olmo2"), tmp_path / "mamba.gguf", arch="mamba")
    message = _refused(path)
    assert "general.architecture 'mamba'" in message
    for arch in ("llama", "gemma3", "phi3", "command-r", "bloom", "gptneox"):
        assert f"'{arch}'" in message


@pytest.mark.parametrize(("key", "value", "problem"), [("rope.freq_base", 50000.0, "RoPE base is fixed at 10000"),
                                                       ("rope.dimension_count", 7, "not an even share")])
def test_a_gptj_file_gridserve_would_misread_is_refused_naming_the_key(key, value, problem, tmp_path):
    """GPT-J's RoPE base is fixed and its rotary share must be even: a file saying otherwise is refused."""
    import dataclasses

    from gridserve.shared.gguf_architectures import ARCHITECTURES, GgufMetadata
    from gridserve.shared.gguf_config import read_gguf

    path = write_gguf(CASES["gptj"].folder("gptj"), tmp_path / "gptj.gguf")
    header = read_gguf(path)
    header = dataclasses.replace(header, fields={**header.fields, f"gptj.{key}": value})
    with pytest.raises(ConfigError, match=f"metadata gptj.{re.escape(key)} .*{problem}") as info:
        ARCHITECTURES["gptj"].build(GgufMetadata(header, "gptj"))
    assert info.value.field == "model.model" and str(path.resolve()) in str(info.value)

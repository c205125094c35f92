"""Tiny GGUF files for the tests: a checkpoint folder (safetensors + tokenizer.json) written with the
``gguf`` package's writer the way llama.cpp's ``convert_hf_to_gguf.py`` lays it out.

Per architecture, as the converter's model class does (``set_gguf_parameters`` for the keys,
``modify_tensors`` for the tensors): tensor names through ``gguf``'s own ``tensor_mapping``
(``get_tensor_name_map``, the converter's ``map_tensor_name``), and each rearrangement the converter
makes, cited where it is made below; the vocabulary as a byte-level BPE with token types, or
llama's SentencePiece.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Optional

import numpy as np

Tensors = dict[str, np.ndarray]
_EXPERT_PARTS = {"w1": "ffn_gate", "w3": "ffn_up", "w2": "ffn_down"}
# HF model_type -> the GGUF architecture llama.cpp's converter writes it as
GGUF_ARCH = {"mistral": "llama", "mixtral": "llama", "gemma3_text": "gemma3", "phi": "phi2", "gpt_neox": "gptneox",
             "cohere": "command-r"}


def permute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: HF's rotary halves -> interleaved pairs."""
    shape = weights.shape
    return (weights.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2)
            .reshape(shape))


def hf_tokenizer_fields(tokenizer_json: dict) -> tuple[list[str], list[int], list[str]]:
    """tokens, token types (1 normal, 3 control, 4 user-defined) and merges of a byte-level BPE."""
    import gguf

    vocab = tokenizer_json["model"]["vocab"]
    added = {t["id"]: t for t in tokenizer_json["added_tokens"]}
    size = max(max(vocab.values()), max(added, default=-1)) + 1
    tokens = [""] * size
    types = [int(gguf.TokenType.NORMAL)] * size
    for text, i in vocab.items():
        tokens[i] = text
    for i, tok in added.items():
        tokens[i] = tok["content"]
        types[i] = int(gguf.TokenType.CONTROL if tok["special"] else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    return tokens, types, merges


def write_gguf(folder: Path, out: Path, tensor_type: str = "F32", pre: str = "gpt2",
               tokenizer_json: Optional[dict] = None, arch: Optional[str] = None,
               add_bos: Optional[bool] = False,
               sentencepiece: Optional[tuple[list[str], list[float], list[int]]] = None,
               drop_keys: Iterable[str] = ()) -> Path:
    """Write the checkpoint in ``folder`` as the GGUF file ``out`` (weights as ``tensor_type``:
    F32, F16, BF16, Q8_0, Q4_0 or Q4_1 for the 2-D ones; 1-D tensors stay F32, as llama.cpp does).

    ``arch`` only renames ``general.architecture`` (the layout stays the checkpoint's own);
    ``drop_keys`` leaves those metadata keys out (a file from an older converter)."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    own_arch = GGUF_ARCH.get(config["model_type"], config["model_type"])
    writer = gguf.GGUFWriter(str(out), arch or own_arch)
    params = _PARAMETERS.get(own_arch, _llama_parameters)
    params(writer, config)
    _write_vocab(writer, folder, config, pre, tokenizer_json, add_bos, sentencepiece)
    for key in drop_keys:
        writer.kv_data[0].pop(key.replace("{arch}", arch or own_arch))

    tensors = {name: value.astype(np.float32) for name, value in load_file(str(folder / "model.safetensors")).items()}
    converted = _CONVERTERS.get(own_arch, _llama_tensors)(config, tensors)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    for name, value in _gguf_named(own_arch, config, converted).items():
        if value.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(value))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, value.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(value), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_vocab(writer, folder: Path, config: dict, pre: str, tokenizer_json: Optional[dict],
                 add_bos: Optional[bool], sentencepiece) -> None:
    if sentencepiece is not None:  # ("llama": tokens, scores, types; no merges, like llama.cpp's files)
        tokens, scores, types = sentencepiece
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
    else:
        tok = tokenizer_json or json.loads((folder / "tokenizer.json").read_text())
        tokens, types, merges = hf_tokenizer_fields(tok)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    template = folder / "chat_template.jinja"
    writer.add_chat_template(template.read_text() if template.is_file() else tok_config["chat_template"])


# ---- metadata: each converter class's ``set_gguf_parameters`` --------------------------------------
def _rope(config: dict, layer_type: str = "full_attention") -> dict:
    """transformers 5's ``rope_parameters`` (one layer type's when nested), as the converter reads them."""
    params = config.get("rope_parameters") or {}
    if isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    return params


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _base_parameters(writer, config: dict) -> None:
    """``TextModel.set_gguf_parameters``: the keys every newer converter class starts from."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    if config.get("num_key_value_heads") is not None:
        writer.add_head_count_kv(config["num_key_value_heads"])
    rope = _rope(config)
    if rope.get("rope_type") == "linear":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_theta") is not None:
        writer.add_rope_freq_base(rope["rope_theta"])
    sliding = (config.get("rope_parameters") or {}).get("sliding_attention")
    if isinstance(sliding, dict) and sliding.get("rope_theta") is not None:
        writer.add_rope_freq_base_swa(sliding["rope_theta"])
    if config.get("rms_norm_eps") is not None:
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    eps = next((config[k] for k in ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon") if k in config), None)
    if eps is not None:
        writer.add_layer_norm_eps(eps)
    if config.get("head_dim") is not None:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])


def _llama_parameters(writer, config: dict) -> None:
    """``LlamaModel`` (llama, Mistral, Mixtral; Qwen2 / Qwen3 write the same keys)."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(_rope(config).get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(_head_dim(config))
    writer.add_key_length(_head_dim(config))
    writer.add_value_length(_head_dim(config))
    if "num_local_experts" in config:
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])


def _gemma_parameters(writer, config: dict) -> None:
    """``GemmaModel`` / ``Gemma2Model``: their own keys (no RoPE base: llama.cpp's 10000), Gemma 2's
    two soft caps and its window."""
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    if config["model_type"] == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])


def _gemma3_parameters(writer, config: dict) -> None:
    """``Gemma3Model``: the base keys (global RoPE base and scaling, ``rope.freq_base_swa``), a final
    soft cap when set, the window unless its pattern is 1."""
    _base_parameters(writer, config)
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if config.get("sliding_window_pattern") != 1:
        writer.add_sliding_window(config["sliding_window"])


def _phi3_parameters(writer, config: dict) -> None:
    """``Phi3MiniModel``: its own keys; the window (0 for none); rotary dims from the width (the
    converter ignores ``head_dim``); LongRoPE's attention factor (its factors: ``_phi3_tensors``)."""
    import math

    n_embd, n_head = config["hidden_size"], config["num_attention_heads"]
    rope = _rope(config)
    writer.add_context_length(config["max_position_embeddings"])
    if config.get("original_max_position_embeddings"):
        writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(config.get("sliding_window") or 0)
    if rope.get("rope_type") == "longrope":
        original = config["original_max_position_embeddings"]
        scale = config["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def _granite_parameters(writer, config: dict) -> None:
    """``GraniteModel``: ``head_dim`` dropped (llama.cpp's Granite has none), the four multipliers."""
    config = {k: v for k, v in config.items() if k != "head_dim"}
    _base_parameters(writer, config)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(_head_dim(config))
    writer.add_attention_scale(config["attention_multiplier"])
    writer.add_embedding_scale(config["embedding_multiplier"])
    writer.add_residual_scale(config["residual_multiplier"])
    writer.add_logit_scale(config["logits_scaling"])


def _cohere_parameters(writer, config: dict) -> None:
    """``CommandR2Model``: the base keys, ``logit_scale``, no RoPE scaling."""
    import gguf

    _base_parameters(writer, config)
    writer.add_logit_scale(config["logit_scale"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def _glm4_parameters(writer, config: dict) -> None:
    """``Glm4Model``: the base keys and the rotated share of each head."""
    _base_parameters(writer, config)
    writer.add_rope_dimension_count(int(_head_dim(config) * _rope(config).get("partial_rotary_factor", 0.5)))


def _stablelm_parameters(writer, config: dict) -> None:
    """``StableLMModel``: its own keys (no RoPE base), partial rotary, parallel residual."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_rope_dimension_count(int(_rope(config)["partial_rotary_factor"] * head_dim))
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_parallel_residual(config.get("use_parallel_residual", True))
    writer.add_layer_norm_eps(config["layer_norm_eps"])


def _gpt2_parameters(writer, config: dict) -> None:
    """``GPT2Model``: the feed-forward width written as 4 x width, whatever the checkpoint's."""
    writer.add_block_count(config["n_layer"])
    writer.add_context_length(config.get("n_ctx", config["n_positions"]))
    writer.add_embedding_length(config["n_embd"])
    writer.add_feed_forward_length(4 * config["n_embd"])
    writer.add_head_count(config["n_head"])
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])


def _gptj_parameters(writer, config: dict) -> None:
    """llama.cpp's ``convert-gptj-hf-to-gguf.py`` (llama.cpp builds no GPT-J graph; this converter
    and the ``gguf`` package's GPT-J tensor names define the file): 4 x width, ``rotary_dim``."""
    writer.add_context_length(config["n_positions"])
    writer.add_embedding_length(config["n_embd"])
    writer.add_block_count(config["n_layer"])
    writer.add_feed_forward_length(4 * config["n_embd"])
    writer.add_head_count(config["n_head"])
    writer.add_rope_dimension_count(config["rotary_dim"])
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])


def _phi2_parameters(writer, config: dict) -> None:
    """``Phi2Model``: 4 x width, as many KV heads as heads, rotary dims from the width."""
    n_embd, n_head = config["hidden_size"], config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(4 * n_embd)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_rope_dimension_count(int(_rope(config)["partial_rotary_factor"] * n_embd) // n_head)


def _gptneox_parameters(writer, config: dict) -> None:
    """``GPTNeoXModel``: its own keys (no RoPE base), ``rotary_pct`` of the head, parallel residual."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_rope_dimension_count(int(_rope(config)["partial_rotary_factor"] * head_dim))
    writer.add_head_count(config["num_attention_heads"])
    writer.add_parallel_residual(config.get("use_parallel_residual", True))
    writer.add_layer_norm_eps(config["layer_norm_eps"])


def _falcon_kv_heads(config: dict) -> int:
    """The converter's ``num_kv_heads`` (or 1): the hub's multi-query config.json has no such key
    (transformers' saved config writes the head count there, which the converter cannot read)."""
    return config["num_kv_heads"] if config.get("new_decoder_architecture") else 1


def _falcon_parameters(writer, config: dict) -> None:
    """``FalconModel``: context 2048 ("not in config.json"), 4 x width."""
    writer.add_context_length(2048)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(4 * config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(_falcon_kv_heads(config))
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])


def _bloom_parameters(writer, config: dict) -> None:
    """``BloomModel``: context ``seq_length`` or (failing that) the width, 4 x width."""
    n_embed, n_head = config["hidden_size"], config["n_head"]
    writer.add_context_length(config.get("seq_length", n_embed))
    writer.add_embedding_length(n_embed)
    writer.add_feed_forward_length(4 * n_embed)
    writer.add_block_count(config["n_layer"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])


_PARAMETERS: dict[str, Callable[[Any, dict], None]] = {
    "gemma": _gemma_parameters, "gemma2": _gemma_parameters, "gemma3": _gemma3_parameters,
    "phi3": _phi3_parameters, "starcoder2": _base_parameters, "olmo2": _base_parameters,
    "granite": _granite_parameters, "command-r": _cohere_parameters, "glm4": _glm4_parameters,
    "stablelm": _stablelm_parameters, "gpt2": _gpt2_parameters, "phi2": _phi2_parameters,
    "gptneox": _gptneox_parameters, "falcon": _falcon_parameters, "bloom": _bloom_parameters,
    "gptj": _gptj_parameters,
}


# ---- tensors: each converter class's ``modify_tensors`` ----------------------------------------------
def _llama_tensors(config: dict, tensors: Tensors) -> Tensors:
    """``LlamaModel.modify_tensors`` (also Granite's and SmolLM3's): Q/K rows (weights and biases)
    permuted; Mixtral's experts stacked. Qwen2 / Qwen3 keep their layout."""
    if config["model_type"] in ("llama", "mistral", "mixtral", "granite", "smollm3"):
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        for name in list(tensors):
            if ".self_attn.q_proj." in name:
                tensors[name] = permute_qk(tensors[name], heads)
            elif ".self_attn.k_proj." in name:
                tensors[name] = permute_qk(tensors[name], kv_heads)
    _stack_experts(tensors)
    return tensors


def _gemma_tensors(config: dict, tensors: Tensors) -> Tensors:
    """``GemmaModel`` / ``Gemma2Model`` / ``Gemma3Model.modify_tensors``: every ``norm.weight`` + 1
    (transformers' ``Gemma2TensorProcessor`` subtracts it back); Gemma 1 / 2 drop ``lm_head``."""
    out = {}
    for name, value in tensors.items():
        if name == "lm_head.weight" and config["model_type"] in ("gemma", "gemma2"):
            continue
        out[name] = value + 1 if name.endswith("norm.weight") else value
    return out


def _phi3_tensors(config: dict, tensors: Tensors) -> Tensors:
    """``Phi3MiniModel.generate_extra_tensors``: LongRoPE's factors as ``rope_factors_long`` /
    ``rope_factors_short`` (F32; read back into the config)."""
    rope = _rope(config)
    if rope.get("rope_type") == "longrope":
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], np.float32)
    return tensors


def _gpt2_tensors(config: dict, tensors: Tensors) -> Tensors:
    """``GPT2Model.modify_tensors``: the Conv1D ``(in, out)`` weights transposed (transformers'
    ``GPT2TensorProcessor`` transposes them back); the output is a copy of the token embedding."""
    out = {}
    for name, value in tensors.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            value = value.T
        out[name] = value
    out.setdefault("lm_head.weight", out["transformer.wte.weight"])
    return out


def _gptj_tensors(config: dict, tensors: Tensors) -> Tensors:
    """The GPT-J converter: the causal-mask buffers dropped, every tensor as it is."""
    return {name: value for name, value in tensors.items() if not name.endswith((".attn.bias", ".attn.masked_bias"))}


def _fused_qkv_to_qkv(qkv: np.ndarray, heads: int, kv_heads: int, head_dim: int) -> np.ndarray:
    """Per KV group ``[kv, heads / kv + 2, head_dim]`` -> ``[Q; K; V]`` (``GPTNeoXModel`` /
    ``BloomModel``: one group per head; ``FalconModel``: jploski's rearrangement)."""
    rest = qkv.shape[1:]
    grouped = qkv.reshape(kv_heads, heads // kv_heads + 2, head_dim, *rest)
    q = grouped[:, :-2].reshape(heads * head_dim, *rest)
    k = grouped[:, -2].reshape(kv_heads * head_dim, *rest)
    v = grouped[:, -1].reshape(kv_heads * head_dim, *rest)
    return np.concatenate([q, k, v])


def _qkv_tensors(heads: int, kv_heads: int, head_dim: int, tensors: Tensors) -> Tensors:
    for name in list(tensors):
        if "query_key_value" in name:  # (transformers' ``BloomTensorProcessor`` reverses it)
            tensors[name] = _fused_qkv_to_qkv(tensors[name], heads, kv_heads, head_dim)
    return tensors


def _gptneox_tensors(config: dict, tensors: Tensors) -> Tensors:
    heads = config["num_attention_heads"]
    return _qkv_tensors(heads, heads, config["hidden_size"] // heads, tensors)


def _bloom_tensors(config: dict, tensors: Tensors) -> Tensors:
    """``BloomModel.modify_tensors``: ``transformer.`` dropped, Q/K/V to ``[Q; K; V]``, the output a
    copy of the token embedding when there is no LM head."""
    heads = config["n_head"]
    tensors = {re.sub(r"^transformer\.", "", name): value for name, value in tensors.items()}
    _qkv_tensors(heads, heads, config["hidden_size"] // heads, tensors)
    tensors.setdefault("lm_head.weight", tensors["word_embeddings.weight"])
    return tensors


def _falcon_tensors(config: dict, tensors: Tensors) -> Tensors:
    heads = config["num_attention_heads"]
    return _qkv_tensors(heads, _falcon_kv_heads(config), config["hidden_size"] // heads, tensors)


def _stablelm_tensors(config: dict, tensors: Tensors) -> Tensors:
    """``StableLMModel._stack_qk_norm``: the per-head ``{q,k}_layernorm.norms.N`` stacked into one
    ``[heads, head_dim]`` tensor."""
    pattern = re.compile(r"^(model\.layers\.\d+\.self_attn\.[qk]_layernorm)\.norms\.(\d+)\.weight$")
    groups: dict[str, dict[int, np.ndarray]] = {}
    for name in list(tensors):
        match = pattern.match(name)
        if match:
            groups.setdefault(match[1], {})[int(match[2])] = tensors.pop(name)
    for prefix, norms in groups.items():
        tensors[f"{prefix}.weight"] = np.stack([norms[i] for i in sorted(norms)])
    return tensors


def _as_is(config: dict, tensors: Tensors) -> Tensors:
    return tensors


_CONVERTERS: dict[str, Callable[[dict, Tensors], Tensors]] = {
    "gemma": _gemma_tensors, "gemma2": _gemma_tensors, "gemma3": _gemma_tensors, "phi3": _phi3_tensors,
    "granite": _llama_tensors, "gpt2": _gpt2_tensors, "gptneox": _gptneox_tensors, "bloom": _bloom_tensors,
    "falcon": _falcon_tensors, "stablelm": _stablelm_tensors, "starcoder2": _as_is, "olmo2": _as_is,
    "command-r": _as_is, "glm4": _as_is, "phi2": _as_is, "gptj": _gptj_tensors,
}


def _gguf_named(arch: str, config: dict, tensors: Tensors) -> Tensors:
    """The tensors under GGUF names, in the order of their checkpoint names: HF names through
    ``gguf``'s ``tensor_mapping`` (the converter's ``map_tensor_name``); names already GGUF's (stacked
    experts, rope factors) kept."""
    import gguf

    arch_enum = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)
    layers = config.get("num_hidden_layers") or config["n_layer"]
    name_map = gguf.get_tensor_name_map(arch_enum, layers)
    named: Tensors = {}
    for name in sorted(tensors):
        target = name
        if not name.startswith(("blk.", "rope_factors_")):
            target = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
            if target is None:
                raise KeyError(f"{arch}: gguf's tensor_mapping has no name for {name!r}")
        named[target] = tensors[name]
    return named


def _stack_experts(tensors: Tensors) -> None:
    """Mixtral's per-expert w1 / w3 / w2 -> llama.cpp's stacked ``blk.N.ffn_{gate,up,down}_exps``."""
    pattern = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for name in list(tensors):
        match = pattern.match(name)
        if match:
            groups.setdefault((match[1], match[3]), {})[int(match[2])] = name
    for (layer, proj), names in groups.items():
        stacked = np.stack([tensors.pop(names[e]) for e in sorted(names)])
        tensors[f"blk.{layer}.{_EXPERT_PARTS[proj]}_exps.weight"] = stacked


def sentencepiece_vocab(texts: list[str], size: int = 1200) -> tuple[list[str], list[float], list[int]]:
    """A llama-style SentencePiece BPE vocabulary (tokens, scores, token types) trained on ``texts``:
    ``<unk>`` ``<s>`` ``</s>``, then ``<pad>``, the 256 ``<0xNN>`` byte tokens, then the pieces (U+2581 for
    a space) scored ``-rank``, as llama.cpp's converter writes a ``tokenizer.model``'s."""
    import gguf
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    special = ["<unk>", "<s>", "</s>", "<pad>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=special, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    vocab = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    tokens = [text for text, _ in vocab]
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    types[0] = int(gguf.TokenType.UNKNOWN)
    types[1] = types[2] = types[3] = int(gguf.TokenType.CONTROL)
    for i in range(4, 260):
        types[i] = int(gguf.TokenType.BYTE)
    scores = [0.0] * 260 + [-float(i) for i in range(len(tokens) - 260)]
    return tokens, scores, types

"""Each GGUF architecture's metadata as the Hugging Face config its gridserve model reads (no torch).

llama.cpp's ``convert_hf_to_gguf.py`` writes a checkpoint's config.json as ``{arch}.*`` keys, some of
it only implied (Gemma's attention scale, Gemma 3's window pattern: llama.cpp's ``llama-model.cpp``
fixes them per architecture) and the rest readable from the tensors (biases, Q/K norms, a second
LayerNorm). One builder per architecture turns that back into the config.json fields its model
reads; ``gguf_config.hf_config_from_gguf`` adds what every architecture shares (vocabulary, tied
head, token ids, dtype). A key a model needs and the file lacks is a ``ConfigError`` naming it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from gridserve.shared.errors import ConfigError

if TYPE_CHECKING:
    from gridserve.shared.gguf_config import GgufFile, GgufTensorInfo

logger = logging.getLogger(__name__)

# Every released StarCoder2 (3B, 7B, 15B) attends over a 4096-token window, which llama.cpp's
# converter does not write: a GGUF without the window key is served up to this length, where full
# attention and the window are the same.
STARCODER2_WINDOW = 4096
# SmolLM3 skips RoPE on every fourth layer (NoPE). GGUF has no key for it: llama.cpp fixes the step
# (``hparams.n_no_rope_layer_step = 4``) for every smollm3 file, as every released SmolLM3 has it.
SMOLLM3_NO_ROPE_INTERVAL = 4
# GPT-J's sinusoids have a fixed base; neither GPT-J converter writes one.
GPTJ_ROPE_BASE = 10000.0


class GgufMetadata:
    """One GGUF file's ``{arch}.*`` keys and tensor table, as an architecture's builder reads them."""

    def __init__(self, gguf_file: GgufFile, arch: str) -> None:
        self.path = gguf_file.path
        self.arch = arch
        self._file = gguf_file
        self.tensors: dict[str, GgufTensorInfo] = {t.name: t for t in gguf_file.tensors}

    def get(self, key: str, default: Any = None, required: bool = False) -> Any:
        """``{arch}.{key}``; a per-layer list must be uniform (gridserve needs one value)."""
        value = self._file.get(f"{self.arch}.{key}", default)
        if required and value is None:
            raise self.error(key, "is missing")
        if isinstance(value, list) and not key.endswith("sliding_window_pattern"):
            if not value or len(set(value)) != 1:
                raise self.error(key, "differs per layer, which gridserve does not support")
            value = value[0]
        return value

    def get_float(self, key: str, default: Optional[float] = None, required: bool = False) -> Optional[float]:
        """``get`` as a float32 value spelled as config.json spells it (``f32``)."""
        value = self.get(key, default, required)
        return None if value is None else f32(value)

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError("model.model", f"{self.path!r}: metadata {self.arch}.{key} {problem}")

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.tensors:
            raise ConfigError("model.model", f"{self.path!r}: tensor {name!r} is missing")
        return self.tensors[name].shape

    def values(self, name: str) -> list[float]:
        """A small F32 / F16 tensor's values (LongRoPE's factors), read from the file."""
        import numpy as np

        tensor = self.tensors[name]
        dtypes = {"F32": np.float32, "F16": np.float16}
        if tensor.type_name not in dtypes:
            raise ConfigError("model.model", f"{self.path!r}: tensor {name!r} is {tensor.type_name}; "
                                             "F32 or F16 expected")
        count = math.prod(tensor.shape)
        data = np.fromfile(self.path, dtype=dtypes[tensor.type_name], count=count, offset=tensor.offset)
        return [float(v) for v in data.astype(np.float32)]


@dataclass(frozen=True)
class Architecture:
    """A GGUF architecture: the gridserve class built for it, its HF ``model_type`` and the builder
    of its config fields."""

    hf_class: str
    model_type: str
    build: Callable[[GgufMetadata], dict[str, Any]]


def f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that is the same float32 (1e-06, not
    9.99999997e-07), as config.json spells it."""
    import numpy as np

    return float(str(np.float32(value)))


# ---- what several architectures share ----------------------------------------------------------------
def attention_sizes(meta: GgufMetadata) -> dict[str, int]:
    """Width, layers, query / KV heads and head size (``attention.key_length``, else width / heads)."""
    hidden = int(meta.get("embedding_length", required=True))
    heads = int(meta.get("attention.head_count", required=True))
    return {
        "hidden_size": hidden,
        "num_hidden_layers": int(meta.get("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("attention.head_count_kv", heads)),
        "head_dim": int(meta.get("attention.key_length", 0) or hidden // heads),
    }


def intermediate_size(meta: GgufMetadata) -> int:
    """The MLP width: ``ffn_down``'s input columns (some converters write 4 x width whatever the
    checkpoint had: GPT-2, Phi-2, Falcon, Bloom), else ``feed_forward_length``."""
    down = meta.tensors.get("blk.0.ffn_down.weight")
    if down is not None and len(down.shape) == 2:
        return int(down.shape[1])
    return int(meta.get("feed_forward_length", required=True))


def rotary_fraction(meta: GgufMetadata, head_dim: int, partial: bool = True) -> float:
    """The share of each head RoPE rotates (``rope.dimension_count`` / head size), checked."""
    rotary = meta.get("rope.dimension_count")
    if rotary is None or int(rotary) == head_dim:
        return 1.0
    rotary = int(rotary)
    fraction = rotary / head_dim
    if not partial:
        raise meta.error("rope.dimension_count", f"= {rotary}: partial rotary embeddings (head size {head_dim}) "
                                                 f"are not supported for {meta.arch}")
    if not 0 < rotary < head_dim or rotary % 2 or int(head_dim * fraction) != rotary:
        raise meta.error("rope.dimension_count", f"= {rotary} is not an even share of the head size {head_dim}")
    return fraction


def rope(meta: GgufMetadata, fraction: float = 1.0) -> dict[str, Any]:
    """``rope_parameters``: the base (llama.cpp's default 10000 when absent), linear scaling, and the
    rotated share of each head when partial."""
    params: dict[str, Any] = {"rope_theta": meta.get_float("rope.freq_base", 10000.0), "rope_type": "default"}
    scaling = meta.get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise meta.error("rope.scaling.type", f"{scaling!r} is not supported (only linear)")
        params.update(rope_type="linear", factor=meta.get_float("rope.scaling.factor", 1.0))
    if fraction != 1.0:
        params["partial_rotary_factor"] = fraction
    return params


def decoder(meta: GgufMetadata, partial_rotary: bool = False) -> dict[str, Any]:
    """The Llama-family fields: sizes, RMSNorm epsilon, RoPE, SiLU."""
    sizes = attention_sizes(meta)
    fraction = rotary_fraction(meta, sizes["head_dim"], partial_rotary)
    return {
        **sizes,
        "intermediate_size": intermediate_size(meta),
        "hidden_act": "silu",
        "rms_norm_eps": meta.get_float("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_parameters": rope(meta, fraction),
        "attention_bias": False,
    }


def layer_norm_eps(meta: GgufMetadata, default: Optional[float] = None) -> float:
    """``attention.layer_norm_epsilon``, required unless a default is given."""
    return meta.get_float("attention.layer_norm_epsilon", default, required=default is None)


def bias(meta: GgufMetadata, part: str) -> bool:
    """Whether the file's first block has a bias on ``part`` (llama.cpp writes biases as found)."""
    return meta.has(f"blk.0.{part}.bias")


# ---- the Llama family ------------------------------------------------------------------------------
def llama(meta: GgufMetadata) -> dict[str, Any]:
    """Llama, Mistral (written as llama) and Mixtral (llama with ``expert_count``), Qwen2, Qwen3."""
    config = decoder(meta)
    experts = int(meta.get("expert_count", 0) or 0)
    if experts and meta.arch != "llama":
        raise meta.error("expert_count", f"is set: mixture-of-experts {meta.arch} GGUF files are not supported "
                                         "(llama's, Mixtral, are)")
    if meta.arch in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None)
    if experts:
        used = int(meta.get("expert_used_count", 0) or 0)
        if not 1 <= used <= experts:
            raise meta.error("expert_used_count", f"={used} must be in [1, {meta.arch}.expert_count={experts}]")
        config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts,
                      num_experts_per_tok=used, sliding_window=None)
    return config


def smollm3(meta: GgufMetadata) -> dict[str, Any]:
    """SmolLM3: the Llama decoder (llama.cpp's converter permutes its Q/K rows as llama's) with no
    RoPE on every ``SMOLLM3_NO_ROPE_INTERVAL``-th layer, as llama.cpp fixes it; no windows (llama.cpp's
    SmolLM3 has none, as SmolLM3's config.json turns them off); biases when the file has them."""
    config = decoder(meta)
    config.update(attention_bias=bias(meta, "attn_q"), mlp_bias=bias(meta, "ffn_gate"),
                  no_rope_layer_interval=SMOLLM3_NO_ROPE_INTERVAL, use_sliding_window=False, sliding_window=None)
    return config


def gemma(meta: GgufMetadata) -> dict[str, Any]:
    """Gemma: GeGLU with GELU's tanh form (llama.cpp's GELU). Its ``1 + w`` norms are stored as
    ``1 + w`` (the loader subtracts the 1)."""
    return {**decoder(meta), "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}


def _gemma_query_scalar(config: dict[str, Any], layers_27b: int) -> int:
    """``query_pre_attn_scalar``, which GGUF does not carry: llama.cpp scales scores by
    ``1 / sqrt(head size)``, except on the 27B (known by its layer count): ``1 / sqrt(width / heads)``
    (``llama-model.cpp``, after gemma_pytorch's config). Every released Gemma 2 / 3 agrees."""
    if config["num_hidden_layers"] == layers_27b:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def gemma2(meta: GgufMetadata) -> dict[str, Any]:
    """Gemma 2: the soft caps and the window, each refused when missing (llama.cpp's converter writes
    all three); window on every second layer (the first of each pair), as llama.cpp fixes it."""
    config = gemma(meta)
    config.update(
        attn_logit_softcapping=meta.get_float("attn_logit_softcapping", required=True),
        final_logit_softcapping=meta.get_float("final_logit_softcapping", required=True),
        sliding_window=int(meta.get("attention.sliding_window", required=True)),
        query_pre_attn_scalar=_gemma_query_scalar(config, 46),
    )
    return config


def _window_layer_types(meta: GgufMetadata, layers: int, default_period: int) -> list[str]:
    """Per layer, window or full: ``attention.sliding_window_pattern`` (a period, or a flag per
    layer) when written, else every ``default_period``-th layer full."""
    pattern = meta.get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise meta.error("attention.sliding_window_pattern", f"has {len(pattern)} entries for {layers} layers")
        return ["sliding_attention" if bool(p) else "full_attention" for p in pattern]
    period = int(pattern) if pattern else default_period
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]


def gemma3(meta: GgufMetadata) -> dict[str, Any]:
    """Gemma 3 (text): per-head Q/K norms; a window on five layers in six (llama.cpp's pattern) with
    their own RoPE base (``rope.freq_base_swa``, llama.cpp's 10000 when absent), the global layers'
    base and linear scaling; a final soft cap when written. No window key: every layer global."""
    config = gemma(meta)
    layers = config["num_hidden_layers"]
    window = int(meta.get("attention.sliding_window", 0) or 0)
    types = _window_layer_types(meta, layers, 6) if window else ["full_attention"] * layers
    config.update(
        rope_parameters={"full_attention": config["rope_parameters"],
                         "sliding_attention": {"rope_type": "default",
                                               "rope_theta": meta.get_float("rope.freq_base_swa", 10000.0)}},
        sliding_window=window or None,
        layer_types=types,
        query_pre_attn_scalar=_gemma_query_scalar(config, 62),
        final_logit_softcapping=meta.get_float("final_logit_softcapping"),
        attn_logit_softcapping=None,
    )
    return config


def phi3(meta: GgufMetadata) -> dict[str, Any]:
    """Phi-3 / Phi-4-mini: pre-fused Q/K/V and gate/up, a window on every layer (0: none, Phi-4),
    LongRoPE from the ``rope_factors_long`` / ``rope_factors_short`` tensors. (llama.cpp itself turns
    Phi-3's window off; gridserve keeps it, as transformers does.)"""
    config = decoder(meta, partial_rotary=True)
    window = int(meta.get("attention.sliding_window", 0) or 0)
    config["sliding_window"] = window or None
    if meta.has("rope_factors_long.weight"):
        config["rope_parameters"] = _longrope(meta, config)
        config["original_max_position_embeddings"] = config["rope_parameters"]["original_max_position_embeddings"]
    return config


def _longrope(meta: GgufMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE's parameters; the attention factor only when the file's differs from the one
    transformers derives (``sqrt(1 + ln(context / original) / ln(original))``)."""
    original = int(meta.get("rope.scaling.original_context_length", required=True))
    params = {**config["rope_parameters"], "rope_type": "longrope",
              "short_factor": meta.values("rope_factors_short.weight"),
              "long_factor": meta.values("rope_factors_long.weight"),
              "original_max_position_embeddings": original}
    context = int(meta.get("context_length", required=True))
    scale = context / original
    derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    written = meta.get_float("rope.scaling.attn_factor")
    if written is not None and abs(written - derived) > 1e-6 * derived:
        params["attention_factor"] = written
    return params


def olmo2(meta: GgufMetadata) -> dict[str, Any]:
    """OLMo 2 (norms after attention and MLP, whole-width Q/K norms). OLMo 3 shares the name and adds
    windows, which gridserve's OLMo 2 does not have: refused."""
    if meta.get("attention.sliding_window") is not None:
        raise meta.error("attention.sliding_window", "is set: an OLMo 3 file (sliding windows), which gridserve's "
                                                     "OLMo 2 does not serve")
    return decoder(meta)


def granite(meta: GgufMetadata) -> dict[str, Any]:
    """Granite: the four multipliers, each refused when missing (llama.cpp's defaults differ from
    transformers' for the attention scale)."""
    config = decoder(meta)
    config.update(
        attention_bias=bias(meta, "attn_q"),
        mlp_bias=bias(meta, "ffn_gate"),
        embedding_multiplier=meta.get_float("embedding_scale", required=True),
        residual_multiplier=meta.get_float("residual_scale", required=True),
        attention_multiplier=meta.get_float("attention.scale", required=True),
        logits_scaling=meta.get_float("logit_scale", required=True),
    )
    return config


def cohere(meta: GgufMetadata) -> dict[str, Any]:
    """Command-R: LayerNorm, per-head Q/K norms when the file has them, logits times ``logit_scale``."""
    config = decoder(meta)
    config.update(
        layer_norm_eps=layer_norm_eps(meta),
        logit_scale=meta.get_float("logit_scale", required=True),
        use_qk_norm=meta.has("blk.0.attn_q_norm.weight"),
    )
    return config


def glm4(meta: GgufMetadata) -> dict[str, Any]:
    """GLM-4 (0414): partial rotary on interleaved pairs, Q/K/V biases, a pre-fused gate/up."""
    config = decoder(meta, partial_rotary=True)
    config["attention_bias"] = bias(meta, "attn_q")
    return config


# ---- the LayerNorm decoders ------------------------------------------------------------------------------
def starcoder2(meta: GgufMetadata) -> dict[str, Any]:
    """Starcoder2: biases when the file has them, a window from ``attention.sliding_window``; without
    one (llama.cpp's converter writes none) the context stops at ``STARCODER2_WINDOW``."""
    config = decoder(meta)
    window = int(meta.get("attention.sliding_window", 0) or 0)
    context = int(meta.get("context_length", 2048))
    if not window and context > STARCODER2_WINDOW:
        logger.warning("%s: no %s.attention.sliding_window (StarCoder2 attends over %d tokens): served up to "
                       "%d tokens, where full attention equals the window", meta.path, meta.arch,
                       STARCODER2_WINDOW, STARCODER2_WINDOW)
        context = STARCODER2_WINDOW
    config.update(norm_epsilon=layer_norm_eps(meta), use_bias=bias(meta, "attn_q"),
                  hidden_act="gelu_pytorch_tanh", sliding_window=window or None, max_position_embeddings=context)
    return config


def stablelm(meta: GgufMetadata) -> dict[str, Any]:
    """StableLM: partial rotary, parallel residual (the key, else no ``ffn_norm``), Q/K biases and
    per-head Q/K LayerNorms when the file has them."""
    sizes = attention_sizes(meta)
    fraction = rotary_fraction(meta, sizes["head_dim"])
    parallel = meta.get("use_parallel_residual")
    if parallel is None:
        parallel = not meta.has("blk.0.ffn_norm.weight")
    return {
        **sizes,
        "intermediate_size": intermediate_size(meta),
        "hidden_act": "silu",
        "layer_norm_eps": layer_norm_eps(meta),
        "rope_parameters": rope(meta, fraction),
        "use_parallel_residual": bool(parallel),
        "use_qkv_bias": bias(meta, "attn_q"),
        "qk_layernorm": meta.has("blk.0.attn_q_norm.weight"),
    }


def gpt2(meta: GgufMetadata) -> dict[str, Any]:
    """GPT-2: learned positions (the table's rows), GELU (tanh form), biases everywhere."""
    sizes = attention_sizes(meta)
    positions = int(meta.shape("position_embd.weight")[0])
    return {
        "n_embd": sizes["hidden_size"], "n_head": sizes["num_attention_heads"], "n_layer": sizes["num_hidden_layers"],
        "n_positions": positions, "n_ctx": int(meta.get("context_length", positions)),
        "n_inner": intermediate_size(meta), "layer_norm_epsilon": layer_norm_eps(meta),
        "activation_function": "gelu_new", "max_position_embeddings": positions,
    }


def gptj(meta: GgufMetadata) -> dict[str, Any]:
    """GPT-J: GPT-J's interleaved RoPE (llama.cpp's normal mode: no Q/K permutation) on the first
    ``rope.dimension_count`` dimensions of each head (all when absent), parallel attention and MLP on
    one LayerNorm, biased MLP and LM head, a fixed RoPE base (a file with another is refused)."""
    sizes = attention_sizes(meta)
    head_dim = sizes["head_dim"]
    rotary = int(meta.get("rope.dimension_count", 0) or head_dim)
    if not 0 < rotary <= head_dim or rotary % 2:
        raise meta.error("rope.dimension_count", f"= {rotary} is not an even share of the head size {head_dim}")
    base = meta.get_float("rope.freq_base")
    if base is not None and base != GPTJ_ROPE_BASE:
        raise meta.error("rope.freq_base", f"= {base:g}: GPT-J's RoPE base is fixed at {GPTJ_ROPE_BASE:g}")
    context = int(meta.get("context_length", required=True))
    return {
        "n_embd": sizes["hidden_size"], "n_head": sizes["num_attention_heads"], "n_layer": sizes["num_hidden_layers"],
        "n_positions": context, "max_position_embeddings": context, "rotary_dim": rotary,
        "n_inner": intermediate_size(meta), "layer_norm_epsilon": layer_norm_eps(meta),
        "activation_function": "gelu_new",
    }


def phi2(meta: GgufMetadata) -> dict[str, Any]:
    """Phi-1 / Phi-2: partial rotary, parallel attention and MLP on one LayerNorm, a biased LM head.
    (GGUF has no place for Phi's optional Q/K LayerNorms.)"""
    sizes = attention_sizes(meta)
    config = {
        **sizes,
        "intermediate_size": intermediate_size(meta),
        "layer_norm_eps": layer_norm_eps(meta),
        "rope_parameters": rope(meta, rotary_fraction(meta, sizes["head_dim"])),
        "hidden_act": "gelu_new",
        "qk_layernorm": False,
    }
    if meta.get("attention.key_length") is None:
        del config["head_dim"]
    return config


def gptneox(meta: GgufMetadata) -> dict[str, Any]:
    """GPT-NeoX / Pythia: partial rotary (``rotary_pct``), parallel residual (the key, default on)."""
    sizes = attention_sizes(meta)
    fraction = rotary_fraction(meta, sizes["head_dim"])
    return {
        **sizes,
        "intermediate_size": intermediate_size(meta),
        "layer_norm_eps": layer_norm_eps(meta),
        "rotary_pct": fraction,
        "rope_parameters": rope(meta, fraction),
        "use_parallel_residual": bool(meta.get("use_parallel_residual", True)),
        "attention_bias": bias(meta, "attn_qkv"),
        "hidden_act": "gelu",
    }


def falcon(meta: GgufMetadata) -> dict[str, Any]:
    """Falcon: attention and MLP side by side, on two LayerNorms when the file has ``attn_norm_2``
    (40B / 180B) or one (7B, 11B); one KV head is the 7B's multi-query layout, more are KV groups
    (``new_decoder_architecture``). llama.cpp's Falcon has no ALiBi (Falcon-RW)."""
    sizes = attention_sizes(meta)
    kv_heads = sizes["num_key_value_heads"]
    two_norms = meta.has("blk.0.attn_norm_2.weight")
    new = two_norms or kv_heads > 1
    return {
        **sizes,
        "num_kv_heads": kv_heads,
        "new_decoder_architecture": new,
        "multi_query": not new,
        "parallel_attn": True,
        "num_ln_in_parallel_attn": 2 if two_norms else 1,
        "ffn_hidden_size": intermediate_size(meta),
        "layer_norm_epsilon": layer_norm_eps(meta),
        "bias": bias(meta, "attn_qkv"),
        "alibi": False,
        "activation": "gelu",
        "rope_parameters": rope(meta),
    }


def bloom(meta: GgufMetadata) -> dict[str, Any]:
    """Bloom: ALiBi (no position limit: the converter's ``context_length`` is the config's
    ``seq_length`` or, failing that, the width, so it is not used), an embedding LayerNorm, the
    standard residual (llama.cpp has no ``apply_residual_connection_post_layernorm``)."""
    sizes = attention_sizes(meta)
    return {
        "hidden_size": sizes["hidden_size"], "n_head": sizes["num_attention_heads"],
        "n_layer": sizes["num_hidden_layers"], "num_key_value_heads": sizes["num_attention_heads"],
        "layer_norm_epsilon": layer_norm_eps(meta), "apply_residual_connection_post_layernorm": False,
        "max_position_embeddings": None,
    }


# GGUF ``general.architecture`` -> what gridserve builds for it. llama.cpp writes Mistral checkpoints
# as "llama", and Mixtral ones as "llama" with ``llama.expert_count``.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("LlamaForCausalLM", "llama", llama),
    "qwen2": Architecture("Qwen2ForCausalLM", "qwen2", llama),
    "qwen3": Architecture("Qwen3ForCausalLM", "qwen3", llama),
    "smollm3": Architecture("SmolLM3ForCausalLM", "smollm3", smollm3),
    "gemma": Architecture("GemmaForCausalLM", "gemma", gemma),
    "gemma2": Architecture("Gemma2ForCausalLM", "gemma2", gemma2),
    "gemma3": Architecture("Gemma3ForCausalLM", "gemma3_text", gemma3),
    "phi3": Architecture("Phi3ForCausalLM", "phi3", phi3),
    "olmo2": Architecture("Olmo2ForCausalLM", "olmo2", olmo2),
    "granite": Architecture("GraniteForCausalLM", "granite", granite),
    "command-r": Architecture("CohereForCausalLM", "cohere", cohere),
    "glm4": Architecture("Glm4ForCausalLM", "glm4", glm4),
    "starcoder2": Architecture("Starcoder2ForCausalLM", "starcoder2", starcoder2),
    "stablelm": Architecture("StableLmForCausalLM", "stablelm", stablelm),
    "gpt2": Architecture("GPT2LMHeadModel", "gpt2", gpt2),
    "gptj": Architecture("GPTJForCausalLM", "gptj", gptj),
    "phi2": Architecture("PhiForCausalLM", "phi", phi2),
    "gptneox": Architecture("GPTNeoXForCausalLM", "gpt_neox", gptneox),
    "falcon": Architecture("FalconForCausalLM", "falcon", falcon),
    "bloom": Architecture("BloomForCausalLM", "bloom", bloom),
}

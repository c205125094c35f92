"""Gemma 1, 2 and 3 (text): the Llama decoder with Gemma's ``1 + w`` RMSNorm, embeddings scaled by
``sqrt(hidden_size)`` and a GeGLU (tanh) MLP; Gemma 2 adds norms after attention and MLP, a score
scale of ``query_pre_attn_scalar ** -0.5``, attention and final logit soft-capping and sliding
windows on alternate layers; Gemma 3 adds per-head Q/K norms and a local RoPE base on its window
layers (five in six by default)."""

from __future__ import annotations

import math
from typing import Any

from gridserve.services.worker.layers import rope_parameters
from gridserve.services.worker.models.llama import (
    DecoderSpec,
    LlamaForCausalLM,
    layer_types_of,
    llama_spec,
)
from gridserve.shared.errors import ConfigError

GEMMA2_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")


def _gemma(hf: Any, **overrides: Any) -> DecoderSpec:
    if getattr(hf, "use_bidirectional_attention", False):
        raise ConfigError("model.hf_config.use_bidirectional_attention",
                          "bidirectional (encoder) Gemma is not a causal LM; only causal attention is supported")
    return llama_spec(hf, norm="gemma_rms", embed_scale=math.sqrt(hf.hidden_size), **overrides)


def _every_nth_full(hf: Any, n: int) -> tuple[str, ...]:
    """Window layers with every ``n``-th one full (transformers' default ``layer_types``)."""
    return tuple("sliding_attention" if (i + 1) % n else "full_attention" for i in range(hf.num_hidden_layers))


def _score_scale(hf: Any) -> float:
    return float(getattr(hf, "query_pre_attn_scalar", 256)) ** -0.5


class GemmaForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        return _gemma(hf)


class Gemma2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        return _gemma(
            hf,
            layer_types=_every_nth_full(hf, 2),
            norms=GEMMA2_NORMS,
            attention_scale=_score_scale(hf),
            attn_soft_cap=getattr(hf, "attn_logit_softcapping", None),
            final_soft_cap=getattr(hf, "final_logit_softcapping", None),
        )


def gemma3_rope(hf: Any, layer_type: str) -> dict:
    """The RoPE of a Gemma 3 layer type: ``rope_parameters[layer_type]`` (transformers 5), or the
    older spelling: ``rope_theta`` and ``rope_scaling`` for full layers, ``rope_local_base_freq``
    (default 10000) unscaled for window layers."""
    nested = (getattr(hf, "rope_parameters", None) or {}).get(layer_type)
    if layer_type == "sliding_attention" and not isinstance(nested, dict):
        return {"rope_type": "default", "rope_theta": float(getattr(hf, "rope_local_base_freq", 10_000.0))}
    theta = 1_000_000.0 if layer_type == "full_attention" else 10_000.0
    return rope_parameters(hf, layer_type, default_theta=theta)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text-only (``Gemma3TextConfig``). Its ``attn_logit_softcapping`` is ignored, as
    transformers' Gemma 3 attention ignores it."""

    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        types = layer_types_of(hf, _every_nth_full(hf, int(getattr(hf, "sliding_window_pattern", 6))))
        ropes = {t: gemma3_rope(hf, t) for t in set(types)}
        return _gemma(
            hf,
            layer_types=types,
            rope=tuple(ropes[t] for t in types),
            norms=GEMMA2_NORMS,
            qk_norm="head",
            attention_scale=_score_scale(hf),
            final_soft_cap=getattr(hf, "final_logit_softcapping", None),
        )

"""Gemma 1, 2 and 3 (text): the Llama decoder with Gemma's ``1 + w`` RMSNorm, embeddings scaled by
``sqrt(hidden_size)`` and a GeGLU (tanh) MLP; Gemma 2 adds norms after attention and MLP, a score
scale of ``query_pre_attn_scalar ** -0.5``, attention and final logit soft-capping and sliding
windows on alternate layers; Gemma 3 adds per-head Q/K norms and a local RoPE base on its window
layers (five in six by default).

``use_bidirectional_attention: true`` (EmbeddingGemma: a ``Gemma3TextConfig``) makes the decoder an
encoder: every token sees its whole input, and a window layer the tokens less than its window away
on either side. Gemma 3's config halves that window first, as transformers' ``Gemma3TextConfig``
does (``sliding_window // 2 + 1``: ``sliding_window // 2`` tokens each way); Gemma 1 / 2 keep the
config's. Soft caps, the score scale and the embedding scale stay. Such a model serves embeddings
only (the pooling runner: whole inputs, no KV cache); the generate runner refuses it.
EmbeddingGemma's ``config.json`` names the bare text model, ``Gemma3TextModel``: Gemma 3 as an
embedder, which the pooling runner serves without ``--convert``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from gridserve.services.worker.layers import rope_parameters
from gridserve.services.worker.models.adapters import as_embedding_model
from gridserve.services.worker.models.llama import (
    DecoderSpec,
    LlamaForCausalLM,
    layer_types_of,
    llama_spec,
)
from gridserve.shared.errors import ConfigError

GEMMA2_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")


BIDIRECTIONAL_FIELD = "model.hf_config.use_bidirectional_attention"


def _gemma(model_class: type, hf: Any, halve_window: bool = False, **overrides: Any) -> DecoderSpec:
    """Gemma's decoder for ``model_class``; bidirectional when the config says so, which only a
    pooling model (the decoder converted to an embedder) may be. ``halve_window``: Gemma 3's rule."""
    spec = llama_spec(hf, norm="gemma_rms", embed_scale=math.sqrt(hf.hidden_size), **overrides)
    if not getattr(hf, "use_bidirectional_attention", False):
        return spec
    if not getattr(model_class, "is_pooling_model", False):
        raise ConfigError(BIDIRECTIONAL_FIELD, "true makes this Gemma attend bidirectionally (an embedder such "
                                               "as EmbeddingGemma), so it cannot generate; serve it with "
                                               "runner='pooling' (--runner pooling)")
    windows = spec.windows
    if halve_window:
        windows = tuple(None if w is None else w // 2 + 1 for w in windows)
    return replace(spec, causal=False, windows=windows)


def _every_nth_full(hf: Any, n: int) -> tuple[str, ...]:
    """Window layers with every ``n``-th one full (transformers' default ``layer_types``)."""
    return tuple("sliding_attention" if (i + 1) % n else "full_attention" for i in range(hf.num_hidden_layers))


def _score_scale(hf: Any) -> float:
    return float(getattr(hf, "query_pre_attn_scalar", 256)) ** -0.5


class GemmaForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        return _gemma(cls, hf)


class Gemma2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        return _gemma(
            cls,
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
            cls,
            hf,
            halve_window=True,
            layer_types=types,
            rope=tuple(ropes[t] for t in types),
            norms=GEMMA2_NORMS,
            qk_norm="head",
            attention_scale=_score_scale(hf),
            final_soft_cap=getattr(hf, "final_logit_softcapping", None),
        )


class Gemma3TextModel(as_embedding_model(Gemma3ForCausalLM)):  # type: ignore[misc]
    """EmbeddingGemma's architecture: the bare Gemma 3 text decoder (saved without ``model.`` or an
    LM head) as an embedder; a pooling model of its own, never a generator."""

"""Granite: the Llama decoder with four multipliers (embeddings, residual branches, attention
scores, logits)."""

from __future__ import annotations

from typing import Any

from gridserve.services.worker.models.llama import DecoderSpec, LlamaForCausalLM, llama_spec


class GraniteForCausalLM(LlamaForCausalLM):
    """``embedding_multiplier`` on the embeddings, ``residual_multiplier`` on each block's output,
    ``attention_multiplier`` as the score scale (in place of ``head_dim ** -0.5``), logits divided by
    ``logits_scaling``."""

    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        return llama_spec(
            hf,
            embed_scale=float(getattr(hf, "embedding_multiplier", 1.0)),
            residual_multiplier=float(getattr(hf, "residual_multiplier", 1.0)),
            attention_scale=float(getattr(hf, "attention_multiplier", 1.0)),
            logit_scale=1.0 / float(getattr(hf, "logits_scaling", 1.0)),
        )

"""Cohere (Command-R): one LayerNorm (no bias) per layer feeding attention and MLP in parallel,
interleaved rotary, optional per-head Q/K LayerNorm (``use_qk_norm``), logits times ``logit_scale``."""

from __future__ import annotations

from typing import Any

from gridserve.services.worker.models.llama import DecoderSpec, LlamaForCausalLM, llama_spec


class CohereForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        return llama_spec(
            hf,
            default_theta=500_000.0,
            norm="layer",
            norm_eps=float(getattr(hf, "layer_norm_eps", 1e-5)),
            norms=("input_layernorm", None, None, None),
            parallel_residual=True,
            is_neox=False,
            qk_norm="each_head" if getattr(hf, "use_qk_norm", False) else None,
            logit_scale=float(getattr(hf, "logit_scale", 0.0625)),
        )

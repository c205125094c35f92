"""Qwen3: the Llama decoder with an RMSNorm over each query and key head before RoPE."""

from __future__ import annotations

from typing import Any

from gridserve.services.worker.models.llama import (
    DecoderSpec,
    LlamaForCausalLM,
    llama_spec,
    max_window_layer_types,
)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense): per-head Q/K RMSNorm; windows, when turned on, from ``max_window_layers`` on."""

    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        return llama_spec(hf, layer_types=max_window_layer_types(hf), windows_on=False, qk_norm="head")

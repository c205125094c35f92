"""SmolLM3: the Llama decoder with no RoPE on every ``no_rope_layer_interval``-th layer (NoPE)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gridserve.services.worker.models.llama import DecoderSpec, LlamaForCausalLM, llama_spec
from gridserve.shared.errors import ConfigError


def uses_rope(hf: Any) -> tuple[bool, ...]:
    """Per layer, whether it applies RoPE: ``no_rope_layers[i]`` is 1 for a RoPE layer, 0 for a NoPE
    one (default: every ``no_rope_layer_interval``-th layer, 4, is NoPE)."""
    layers = hf.num_hidden_layers
    flags = getattr(hf, "no_rope_layers", None)
    if flags is None:
        interval = int(getattr(hf, "no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ConfigError("model.hf_config.no_rope_layers", f"must have one flag per layer ({layers}), got {flags!r}")
    return tuple(bool(flag) for flag in flags)


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: NoPE layers; windows (off by default) on the NoPE layers unless ``layer_types`` says."""

    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        rope = uses_rope(hf)
        types = tuple("full_attention" if r else "sliding_attention" for r in rope)
        spec = llama_spec(hf, layer_types=types, windows_on=False, default_theta=2_000_000.0)
        return replace(spec, rope=tuple(p if r else None for p, r in zip(spec.rope, rope)))

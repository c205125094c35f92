"""GLM-4 (0414): the Llama decoder with extra norms after attention and after the MLP, partial
rotary (half of each head by default) on interleaved pairs, a pre-fused ``gate_up_proj``, biases on
Q/K/V but not on the output projection."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gridserve.services.worker.layers import rope_parameters
from gridserve.services.worker.models.llama import DecoderSpec, LlamaForCausalLM, llama_spec
from gridserve.services.worker.weight_loader import LLAMA_STACKED, ROTARY_BUFFERS, WeightMap

GLM4_NORMS = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")


class Glm4ForCausalLM(LlamaForCausalLM):
    weight_map = WeightMap(skip=ROTARY_BUFFERS, stacked=LLAMA_STACKED, fused=("gate_up_proj",))

    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        rope = {"partial_rotary_factor": 0.5, **rope_parameters(hf)}  # transformers' Glm4Config default
        spec = llama_spec(hf, o_proj_bias=False, is_neox=False, norms=GLM4_NORMS)
        return replace(spec, rope=(rope,) * hf.num_hidden_layers)

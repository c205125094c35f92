"""Phi-1 / Phi-2 (``microsoft/phi-2``): parallel attention + MLP on one LayerNorm, partial rotary
embedding (``partial_rotary_factor``), biases everywhere, optional Q/K LayerNorm shared by the heads,
a final LayerNorm and an LM head with a bias."""

from __future__ import annotations

from typing import Any

from gridserve.services.worker.models.layernorm_decoder import (
    AttentionSpec,
    DecoderSpec,
    HeadLayerNorm,
    LayerNormCausalLM,
    activation,
    dense_mlp,
    head_dim_of,
    rotary_settings,
)
from gridserve.services.worker.weight_loader import LLAMA_STACKED, ROTARY_BUFFERS, WeightMap
from gridserve.shared.errors import ConfigError


class PhiForCausalLM(LayerNormCausalLM):
    """Phi with its own (biased, untied) LM head."""

    @staticmethod
    def decoder_spec(hf: Any) -> DecoderSpec:
        hidden, heads = hf.hidden_size, hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or head_dim_of(hidden, heads)
        eps = getattr(hf, "layer_norm_eps", 1e-5)
        norm = None
        if getattr(hf, "qk_layernorm", False):
            if head_dim != hidden // heads:  # transformers sizes these norms hidden_size / heads
                raise ConfigError("model.hf_config.qk_layernorm",
                                  f"needs head_dim ({head_dim}) = hidden_size / num_attention_heads")
            norm = lambda heads_shard: HeadLayerNorm(head_dim, eps)  # noqa: E731
        act = activation(getattr(hf, "hidden_act", "gelu_new"), "model.hf_config.hidden_act")
        return DecoderSpec(
            hidden_size=hidden, num_layers=hf.num_hidden_layers, vocab_size=hf.vocab_size,
            attention=AttentionSpec(heads, getattr(hf, "num_key_value_heads", None) or heads, head_dim,
                                    qkv_bias=True, o_bias=True, scale=head_dim**-0.5,
                                    rotary=rotary_settings(hf, head_dim, default_fraction=0.5),
                                    q_norm=norm, k_norm=norm),
            mlp=dense_mlp(hidden, hf.intermediate_size, act, bias=True),
            norm_eps=eps,
            parallel_residual=True, mlp_norm=False,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            head_bias=True,
        )

    @staticmethod
    def checkpoint_names(hf: Any) -> WeightMap:
        return WeightMap(
            skip=ROTARY_BUFFERS,
            rename=(
                (r"^model\.final_layernorm\.", "model.norm."),
                (r"\.input_layernorm\.", ".attn_norm."),
                (r"\.self_attn\.dense\.", ".self_attn.o_proj."),
                (r"\.self_attn\.q_layernorm\.", ".self_attn.q_norm.norm."),
                (r"\.self_attn\.k_layernorm\.", ".self_attn.k_norm.norm."),
                (r"\.mlp\.fc1\.", ".mlp.fc_in."),
                (r"\.mlp\.fc2\.", ".mlp.fc_out."),
            ),
            stacked=LLAMA_STACKED[:3],
        )

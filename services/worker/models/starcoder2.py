"""Starcoder2 (``bigcode/starcoder2-3b``): LayerNorm, GQA with rotary embedding, biases on every
projection (``use_bias``), a GELU MLP and sliding-window attention (``sliding_window``)."""

from __future__ import annotations

from typing import Any

from gridserve.services.worker.models.layernorm_decoder import (
    AttentionSpec,
    DecoderSpec,
    LayerNormCausalLM,
    activation,
    dense_mlp,
    head_dim_of,
    rotary_settings,
)
from gridserve.services.worker.models.windows import checked_window
from gridserve.services.worker.weight_loader import LLAMA_STACKED, ROTARY_BUFFERS, WeightMap


class Starcoder2ForCausalLM(LayerNormCausalLM):
    """Starcoder2 with its LM head (tied to the embedding unless the config says otherwise)."""

    @staticmethod
    def decoder_spec(hf: Any) -> DecoderSpec:
        hidden, heads = hf.hidden_size, hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or head_dim_of(hidden, heads)
        bias = bool(getattr(hf, "use_bias", True))
        act = activation(getattr(hf, "hidden_act", "gelu_pytorch_tanh"), "model.hf_config.hidden_act")
        return DecoderSpec(
            hidden_size=hidden, num_layers=hf.num_hidden_layers, vocab_size=hf.vocab_size,
            attention=AttentionSpec(heads, getattr(hf, "num_key_value_heads", None) or heads, head_dim,
                                    qkv_bias=bias, o_bias=bias, scale=head_dim**-0.5,
                                    rotary=rotary_settings(hf, head_dim),
                                    sliding_window=checked_window(getattr(hf, "sliding_window", None))),
            mlp=dense_mlp(hidden, hf.intermediate_size, act, bias=bias),
            norm_eps=getattr(hf, "norm_epsilon", 1e-5),
            parallel_residual=False,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        )

    @staticmethod
    def checkpoint_names(hf: Any) -> WeightMap:
        return WeightMap(
            skip=ROTARY_BUFFERS,
            rename=(
                (r"\.input_layernorm\.", ".attn_norm."),
                (r"\.post_attention_layernorm\.", ".mlp_norm."),
                (r"\.mlp\.c_fc\.", ".mlp.fc_in."),
                (r"\.mlp\.c_proj\.", ".mlp.fc_out."),
            ),
            stacked=LLAMA_STACKED[:3],
        )

"""GPT-J (``EleutherAI/gpt-j-6b``): parallel attention + MLP on one LayerNorm, GPT-J's interleaved
rotary embedding over the first ``rotary_dim`` dimensions of each head, an LM head with a bias."""

from __future__ import annotations

from typing import Any

from gridserve.services.worker.models.layernorm_decoder import (
    AttentionSpec,
    DecoderSpec,
    LayerNormCausalLM,
    RotarySpec,
    activation,
    dense_mlp,
    head_dim_of,
)
from gridserve.services.worker.weight_loader import LLAMA_STACKED, ROTARY_BUFFERS, WeightMap

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}  # GPT-J's sinusoids have a fixed base


class GPTJForCausalLM(LayerNormCausalLM):
    """GPT-J with its own (biased, untied) LM head."""

    @staticmethod
    def decoder_spec(hf: Any) -> DecoderSpec:
        hidden, heads = hf.n_embd, hf.n_head
        head_dim = head_dim_of(hidden, heads)
        rotary = getattr(hf, "rotary_dim", None) or head_dim
        act = activation(getattr(hf, "activation_function", "gelu_new"), "model.hf_config.activation_function")
        return DecoderSpec(
            hidden_size=hidden, num_layers=hf.n_layer, vocab_size=hf.vocab_size,
            attention=AttentionSpec(heads, heads, head_dim, qkv_bias=False, o_bias=False, scale=head_dim**-0.5,
                                    rotary=RotarySpec(rotary, hf.n_positions, _ROPE, is_neox=False)),
            mlp=dense_mlp(hidden, getattr(hf, "n_inner", None) or 4 * hidden, act, bias=True),
            norm_eps=getattr(hf, "layer_norm_epsilon", 1e-5),
            parallel_residual=True, mlp_norm=False,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            head_bias=True,
        )

    @staticmethod
    def checkpoint_names(hf: Any) -> WeightMap:
        return WeightMap(
            skip=ROTARY_BUFFERS,
            rename=(
                (r"^transformer\.wte\.", "model.embed_tokens."),
                (r"^transformer\.ln_f\.", "model.norm."),
                (r"^transformer\.h\.", "model.layers."),
                (r"\.ln_1\.", ".attn_norm."),
                (r"\.attn\.out_proj\.", ".self_attn.o_proj."),
                (r"\.attn\.", ".self_attn."),
            ),
            stacked=LLAMA_STACKED[:3],
        )

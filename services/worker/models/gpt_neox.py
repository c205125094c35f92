"""GPT-NeoX / Pythia (``EleutherAI/pythia-160m``): partial rotary embedding (``rotary_pct``), a fused
Q/K/V projection stored per head (``[heads, 3, head_dim]``, rearranged at load), and by default
the attention and MLP side by side on two LayerNorms of the same input (``use_parallel_residual``)."""

from __future__ import annotations

from typing import Any

from gridserve.services.worker.models.layernorm_decoder import (
    AttentionSpec,
    DecoderSpec,
    LayerNormCausalLM,
    activation,
    dense_mlp,
    grouped_qkv,
    head_dim_of,
    rotary_settings,
)
from gridserve.services.worker.weight_loader import ROTARY_BUFFERS, WeightMap


class GPTNeoXForCausalLM(LayerNormCausalLM):
    """GPT-NeoX with its LM head (``embed_out`` in older checkpoints)."""

    @staticmethod
    def decoder_spec(hf: Any) -> DecoderSpec:
        hidden, heads = hf.hidden_size, hf.num_attention_heads
        head_dim = head_dim_of(hidden, heads)
        bias = bool(getattr(hf, "attention_bias", True))
        rotary = rotary_settings(hf, head_dim, default_fraction=getattr(hf, "rotary_pct", 0.25),
                                 default_theta=getattr(hf, "rotary_emb_base", 10000.0))
        act = activation(getattr(hf, "hidden_act", "gelu"), "model.hf_config.hidden_act")
        return DecoderSpec(
            hidden_size=hidden, num_layers=hf.num_hidden_layers, vocab_size=hf.vocab_size,
            attention=AttentionSpec(heads, heads, head_dim, qkv_bias=bias, o_bias=bias, scale=head_dim**-0.5,
                                    rotary=rotary),
            mlp=dense_mlp(hidden, hf.intermediate_size, act, bias=True),
            norm_eps=getattr(hf, "layer_norm_eps", 1e-5),
            parallel_residual=bool(getattr(hf, "use_parallel_residual", True)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        )

    @staticmethod
    def checkpoint_names(hf: Any) -> WeightMap:
        heads = hf.num_attention_heads
        return WeightMap(
            skip=(*ROTARY_BUFFERS, r"\.attention\.(masked_)?bias$"),
            rename=(
                (r"^embed_out\.", "lm_head."),
                (r"^gpt_neox\.embed_in\.", "model.embed_tokens."),
                (r"^gpt_neox\.final_layer_norm\.", "model.norm."),
                (r"^gpt_neox\.layers\.", "model.layers."),
                (r"\.input_layernorm\.", ".attn_norm."),
                (r"\.post_attention_layernorm\.", ".mlp_norm."),
                (r"\.attention\.query_key_value\.", ".self_attn.qkv_proj."),
                (r"\.attention\.dense\.", ".self_attn.o_proj."),
                (r"\.mlp\.dense_h_to_4h\.", ".mlp.fc_in."),
                (r"\.mlp\.dense_4h_to_h\.", ".mlp.fc_out."),
            ),
            convert=((r"\.attention\.query_key_value\.", grouped_qkv(heads, heads, hf.hidden_size // heads)),),
            fused=("qkv_proj",),
        )

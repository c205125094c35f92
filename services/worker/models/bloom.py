"""Bloom (``bigscience/bloomz-560m``): ALiBi attention biases instead of positions, a LayerNorm on
the embedding, Q/K/V stored per head (``[heads, 3, head_dim]``), a tanh-GELU MLP, and optionally the
LayerNorm outputs as the residual stream (``apply_residual_connection_post_layernorm``).
Checkpoints saved by old transformers versions omit the ``transformer.`` prefix."""

from __future__ import annotations

from typing import Any

from gridserve.services.worker.attention import alibi_slopes
from gridserve.services.worker.models.layernorm_decoder import (
    GELU_TANH,
    AttentionSpec,
    DecoderSpec,
    LayerNormCausalLM,
    dense_mlp,
    grouped_qkv,
    head_dim_of,
)
from gridserve.services.worker.weight_loader import WeightMap


def _hidden_size(hf: Any) -> int:
    return getattr(hf, "hidden_size", None) or hf.n_embed  # older configs: n_embed


class BloomForCausalLM(LayerNormCausalLM):
    """Bloom with its LM head (tied to the embedding unless the config says otherwise).

    ``pretraining_tp`` / ``slow_but_exact`` only change how transformers splits two matrix products
    (the same sums in another order), so they are accepted.
    """

    @staticmethod
    def decoder_spec(hf: Any) -> DecoderSpec:
        hidden, heads = _hidden_size(hf), hf.n_head
        head_dim = head_dim_of(hidden, heads)
        return DecoderSpec(
            hidden_size=hidden, num_layers=hf.n_layer, vocab_size=hf.vocab_size,
            attention=AttentionSpec(heads, heads, head_dim, qkv_bias=True, o_bias=True, scale=head_dim**-0.5,
                                    alibi_slopes=alibi_slopes(heads)),
            mlp=dense_mlp(hidden, 4 * hidden, GELU_TANH, bias=True),
            norm_eps=getattr(hf, "layer_norm_epsilon", 1e-5),
            parallel_residual=False,
            residual_from_norm=bool(getattr(hf, "apply_residual_connection_post_layernorm", False)),
            embedding_norm=True,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        )

    @staticmethod
    def checkpoint_names(hf: Any) -> WeightMap:
        heads = hf.n_head
        return WeightMap(
            rename=(
                (r"^(?!transformer\.|lm_head\.|model\.)", "transformer."),  # old checkpoints
                (r"^transformer\.word_embeddings\.", "model.embed_tokens."),
                (r"^transformer\.word_embeddings_layernorm\.", "model.embed_norm."),
                (r"^transformer\.ln_f\.", "model.norm."),
                (r"^transformer\.h\.", "model.layers."),
                (r"\.input_layernorm\.", ".attn_norm."),
                (r"\.post_attention_layernorm\.", ".mlp_norm."),
                (r"\.self_attention\.query_key_value\.", ".self_attn.qkv_proj."),
                (r"\.self_attention\.dense\.", ".self_attn.o_proj."),
                (r"\.mlp\.dense_h_to_4h\.", ".mlp.fc_in."),
                (r"\.mlp\.dense_4h_to_h\.", ".mlp.fc_out."),
            ),
            convert=((r"\.self_attention\.query_key_value\.", grouped_qkv(heads, heads, _hidden_size(hf) // heads)),),
            fused=("qkv_proj",),
        )

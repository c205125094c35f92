"""GPT-2 (``openai-community/gpt2``): learned positions, LayerNorm, GELU MLP, Conv1D projections.

The checkpoint's Conv1D matrices are stored ``(in, out)`` and read transposed; ``c_attn`` already
holds ``[Q; K; V]`` and is split across the fused projection's shards. Checkpoints saved by old
transformers versions omit the ``transformer.`` prefix.
"""

from __future__ import annotations

from typing import Any

from gridserve.services.worker.models.layernorm_decoder import (
    AttentionSpec,
    DecoderSpec,
    LayerNormCausalLM,
    activation,
    dense_mlp,
    head_dim_of,
)
from gridserve.services.worker.weight_loader import ROTARY_BUFFERS, WeightMap
from gridserve.shared.errors import ConfigError


class GPT2LMHeadModel(LayerNormCausalLM):
    """GPT-2 with its LM head (tied to the token embedding unless the config says otherwise)."""

    @staticmethod
    def decoder_spec(hf: Any) -> DecoderSpec:
        if getattr(hf, "add_cross_attention", False):
            raise ConfigError("model.hf_config.add_cross_attention",
                              "true is not supported: GPT-2 as an encoder-decoder's decoder has no place here")
        hidden, heads = hf.n_embd, hf.n_head
        head_dim = head_dim_of(hidden, heads)
        act = activation(getattr(hf, "activation_function", "gelu_new"), "model.hf_config.activation_function")
        # reorder_and_upcast_attn only changes the precision of transformers' eager path (and its
        # SDPA path ignores it): the same attention
        return DecoderSpec(
            hidden_size=hidden, num_layers=hf.n_layer, vocab_size=hf.vocab_size,
            attention=AttentionSpec(
                heads, heads, head_dim, qkv_bias=True, o_bias=True,
                scale=head_dim**-0.5 if getattr(hf, "scale_attn_weights", True) else 1.0,
                inverse_layer_scale=bool(getattr(hf, "scale_attn_by_inverse_layer_idx", False)),
            ),
            mlp=dense_mlp(hidden, getattr(hf, "n_inner", None) or 4 * hidden, act, bias=True),
            norm_eps=getattr(hf, "layer_norm_epsilon", 1e-5),
            parallel_residual=False,
            learned_positions=hf.n_positions,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        )

    @staticmethod
    def checkpoint_names(hf: Any) -> WeightMap:
        return WeightMap(
            skip=ROTARY_BUFFERS,
            rename=(
                (r"^(?!transformer\.|lm_head\.|model\.)", "transformer."),  # old checkpoints
                (r"^transformer\.wte\.", "model.embed_tokens."),
                (r"^transformer\.wpe\.", "model.embed_positions."),
                (r"^transformer\.ln_f\.", "model.norm."),
                (r"^transformer\.h\.", "model.layers."),
                (r"\.ln_1\.", ".attn_norm."),
                (r"\.ln_2\.", ".mlp_norm."),
                (r"\.attn\.c_attn\.", ".self_attn.qkv_proj."),
                (r"\.attn\.c_proj\.", ".self_attn.o_proj."),
                (r"\.mlp\.c_fc\.", ".mlp.fc_in."),
                (r"\.mlp\.c_proj\.", ".mlp.fc_out."),
            ),
            transposed=(r"\.(c_attn|c_proj|c_fc)\.weight$",),
            fused=("qkv_proj",),
        )

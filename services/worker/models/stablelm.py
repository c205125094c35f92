"""StableLM (``stabilityai/stablelm-2-1_6b-chat``): LayerNorm, partial rotary embedding, a gated
SiLU MLP (the Llama MLP), optional Q/K biases, per-head Q/K LayerNorms (``qk_layernorm``) and
attention + MLP side by side (``use_parallel_residual``)."""

from __future__ import annotations

from typing import Any

from gridserve.services.worker.models.layernorm_decoder import (
    AttentionSpec,
    DecoderSpec,
    LayerNormCausalLM,
    PerHeadLayerNorm,
    head_dim_of,
    rotary_settings,
)
from gridserve.services.worker.models.llama import LlamaMLP
from gridserve.services.worker.weight_loader import LLAMA_STACKED, ROTARY_BUFFERS, WeightMap


class StableLmForCausalLM(LayerNormCausalLM):
    """StableLM with its LM head."""

    @staticmethod
    def decoder_spec(hf: Any) -> DecoderSpec:
        hidden, heads = hf.hidden_size, hf.num_attention_heads
        head_dim = head_dim_of(hidden, heads)
        eps = getattr(hf, "layer_norm_eps", 1e-5)
        norm = None
        if getattr(hf, "qk_layernorm", False):
            norm = lambda shard: PerHeadLayerNorm(shard, head_dim, eps)  # noqa: E731
        parallel = bool(getattr(hf, "use_parallel_residual", False))
        return DecoderSpec(
            hidden_size=hidden, num_layers=hf.num_hidden_layers, vocab_size=hf.vocab_size,
            attention=AttentionSpec(heads, getattr(hf, "num_key_value_heads", None) or heads, head_dim,
                                    qkv_bias=bool(getattr(hf, "use_qkv_bias", False)), o_bias=False,
                                    scale=head_dim**-0.5,
                                    rotary=rotary_settings(hf, head_dim, default_fraction=0.25),
                                    q_norm=norm, k_norm=norm),
            mlp=lambda state, prefix: LlamaMLP(hf, state, prefix),
            norm_eps=eps,
            parallel_residual=parallel, mlp_norm=not parallel,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        )

    @staticmethod
    def checkpoint_names(hf: Any) -> WeightMap:
        return WeightMap(
            skip=ROTARY_BUFFERS,
            rename=(
                (r"\.input_layernorm\.", ".attn_norm."),
                (r"\.post_attention_layernorm\.", ".mlp_norm."),
                (r"\.self_attn\.q_layernorm\.", ".self_attn.q_norm."),
                (r"\.self_attn\.k_layernorm\.", ".self_attn.k_norm."),
            ),
            stacked=LLAMA_STACKED,
        )

"""Falcon (``tiiuae/falcon-7b-instruct``, Falcon-40B/180B, Falcon-RW) in its three layouts.

- ``new_decoder_architecture`` (40B / 180B): grouped KV heads, Q/K/V stored per KV group
  (``[kv_heads, heads / kv_heads + 2, head_dim]``), attention and MLP side by side on two LayerNorms
  (``num_ln_in_parallel_attn`` 2, the default) or one.
- the original (7B): ``multi_query`` (one KV head, stored ``[Q; K; V]``) and ``parallel_attn``
  (attention and MLP side by side on one LayerNorm).
- Falcon-RW: ``alibi`` instead of rotary embeddings, Q/K/V per head, attention then MLP.

ALiBi is added before transformers scales the scores, so the slopes are passed scaled by
``1 / sqrt(head_dim)``; like transformers, the slopes are rounded to bfloat16 first (transformers
also rounds ``slope * position`` to bfloat16, which is exact for power-of-two head counts up to 8
and positions below 256, and is computed exactly here).
"""

from __future__ import annotations

from typing import Any

import torch

from gridserve.services.worker.attention import alibi_slopes
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
from gridserve.shared.errors import ConfigError


def _kv_heads(hf: Any) -> int:
    """KV heads as transformers counts them: ``num_kv_heads`` (new architecture), 1 (multi-query) or all."""
    heads = hf.num_attention_heads
    if getattr(hf, "new_decoder_architecture", False):
        return getattr(hf, "num_kv_heads", None) or heads
    return 1 if getattr(hf, "multi_query", True) else heads


def _norms_in_parallel(hf: Any) -> int:
    """LayerNorms feeding a parallel block (1: shared by attention and MLP, 2: one each)."""
    new = getattr(hf, "new_decoder_architecture", False)
    norms = getattr(hf, "num_ln_in_parallel_attn", None) or (2 if new else 1)
    if new and not getattr(hf, "parallel_attn", True):
        raise ConfigError("model.hf_config.parallel_attn",
                          "false is not supported with new_decoder_architecture (always parallel)")
    if not new and getattr(hf, "parallel_attn", True) and norms != 1:
        raise ConfigError("model.hf_config.num_ln_in_parallel_attn",
                          f"{norms} is not supported without new_decoder_architecture (one LayerNorm)")
    if norms not in (1, 2):
        raise ConfigError("model.hf_config.num_ln_in_parallel_attn", f"must be 1 or 2, got {norms!r}")
    return norms


class FalconForCausalLM(LayerNormCausalLM):
    """Falcon with its LM head (tied to the embedding unless the config says otherwise)."""

    @staticmethod
    def decoder_spec(hf: Any) -> DecoderSpec:
        hidden, heads = hf.hidden_size, hf.num_attention_heads
        head_dim = head_dim_of(hidden, heads)
        new = bool(getattr(hf, "new_decoder_architecture", False))
        parallel = new or bool(getattr(hf, "parallel_attn", True))
        bias = bool(getattr(hf, "bias", False))
        scale = head_dim**-0.5
        if getattr(hf, "alibi", False):
            positions = {"alibi_slopes": alibi_slopes(heads).to(torch.bfloat16).float() * scale}
        else:
            positions = {"rotary": rotary_settings(hf, head_dim)}
        act = activation(getattr(hf, "activation", "gelu"), "model.hf_config.activation")
        return DecoderSpec(
            hidden_size=hidden, num_layers=hf.num_hidden_layers, vocab_size=hf.vocab_size,
            attention=AttentionSpec(heads, _kv_heads(hf), head_dim, qkv_bias=bias, o_bias=bias, scale=scale,
                                    **positions),
            mlp=dense_mlp(hidden, getattr(hf, "ffn_hidden_size", None) or 4 * hidden, act, bias=bias),
            norm_eps=getattr(hf, "layer_norm_epsilon", 1e-5),
            parallel_residual=parallel, mlp_norm=not parallel or _norms_in_parallel(hf) == 2,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        )

    @staticmethod
    def checkpoint_names(hf: Any) -> WeightMap:
        heads, kv_heads = hf.num_attention_heads, _kv_heads(hf)
        convert = ()
        if kv_heads > 1:  # multi-query checkpoints already hold [Q; K; V]
            convert = ((r"\.self_attention\.query_key_value\.",
                        grouped_qkv(heads, kv_heads, hf.hidden_size // heads)),)
        return WeightMap(
            skip=ROTARY_BUFFERS,
            rename=(
                (r"^transformer\.word_embeddings\.", "model.embed_tokens."),
                (r"^transformer\.ln_f\.", "model.norm."),
                (r"^transformer\.h\.", "model.layers."),
                (r"\.(input_layernorm|ln_attn)\.", ".attn_norm."),
                (r"\.(post_attention_layernorm|ln_mlp)\.", ".mlp_norm."),
                (r"\.self_attention\.query_key_value\.", ".self_attn.qkv_proj."),
                (r"\.self_attention\.dense\.", ".self_attn.o_proj."),
                (r"\.mlp\.dense_h_to_4h\.", ".mlp.fc_in."),
                (r"\.mlp\.dense_4h_to_h\.", ".mlp.fc_out."),
            ),
            convert=convert,
            fused=("qkv_proj",),
        )

"""OPT decoder (the architecture of ``facebook/opt-125m``): learned positions, LayerNorm, ReLU MLP.

With tensor parallelism the Q/K/V heads and fc1 rows are column-parallel, out_proj and fc2
row-parallel, the (tied) embedding vocab-parallel; positions and LayerNorms are replicated.
Pipeline parallelism is not built for OPT (the engine refuses it, ``shared.config``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn

from gridserve.services.worker.attention import AttentionMetadata, PagedAttention
from gridserve.services.worker.checkpoint import CheckpointTensor
from gridserve.services.worker.models.hf_config import hf_config_of
from gridserve.services.worker.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    add_prefix,
    parallel_logits,
)
from gridserve.services.worker.parallel_state import ParallelState, get_parallel_state
from gridserve.services.worker.weight_loader import LLAMA_STACKED, WeightMap, load_weights
from gridserve.shared.config import GridserveConfig
from gridserve.shared.parallel import Shard, even_shard

_POSITION_OFFSET = 2  # OPT's learned position table reserves its first two rows
_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}


class OPTAttention(nn.Module):
    def __init__(self, hf, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        self.head_dim = hf.hidden_size // hf.num_attention_heads
        heads = even_shard(hf.num_attention_heads, state.tp_size, state.tp_rank, "num_attention_heads")
        self.num_heads = heads.size
        bias = getattr(hf, "enable_bias", True)
        d = self.head_dim
        rows = Shard(heads.start * d, heads.size * d, hf.hidden_size)
        self.qkv_proj = ColumnParallelLinear(hf.hidden_size, [rows] * 3, bias=bias,
                                             prefix=add_prefix(prefix, "qkv_proj"))
        self.out_proj = RowParallelLinear(rows, hf.hidden_size, bias=bias, state=state,
                                          prefix=add_prefix(prefix, "out_proj"))
        self.attn = PagedAttention(self.num_heads, d, self.num_heads, d**-0.5)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        return self.out_proj(self.attn(q, k, v, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, hf, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        bias = getattr(hf, "enable_bias", True)
        affine = getattr(hf, "layer_norm_elementwise_affine", True)
        self.pre_norm = getattr(hf, "do_layer_norm_before", True)
        self.self_attn = OPTAttention(hf, state, add_prefix(prefix, "self_attn"))
        self.self_attn_layer_norm = nn.LayerNorm(hf.hidden_size, elementwise_affine=affine)
        ffn = even_shard(hf.ffn_dim, state.tp_size, state.tp_rank, "ffn_dim")
        self.fc1 = ColumnParallelLinear(hf.hidden_size, [ffn], bias=bias, prefix=add_prefix(prefix, "fc1"))
        self.fc2 = RowParallelLinear(ffn, hf.hidden_size, bias=bias, state=state,
                                     prefix=add_prefix(prefix, "fc2"))
        self.final_layer_norm = nn.LayerNorm(hf.hidden_size, elementwise_affine=affine)
        act = getattr(hf, "activation_function", "relu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"model.hf_config.activation_function: unsupported {act!r}")
        self.act = _ACTIVATIONS[act]()

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        residual = x
        if self.pre_norm:
            x = self.self_attn_layer_norm(x)
        x = residual + self.self_attn(x, meta)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        residual = x
        if self.pre_norm:
            x = self.final_layer_norm(x)
        x = residual + self.fc2(self.act(self.fc1(x)))
        if not self.pre_norm:
            x = self.final_layer_norm(x)
        return x


class OPTDecoder(nn.Module):
    def __init__(self, hf, state: ParallelState, prefix: str = "model.decoder") -> None:
        super().__init__()
        proj_dim = getattr(hf, "word_embed_proj_dim", None) or hf.hidden_size
        self.embed_tokens = VocabParallelEmbedding(hf.vocab_size, proj_dim, state,
                                                   prefix=add_prefix(prefix, "embed_tokens"))
        self.embed_positions = nn.Embedding(hf.max_position_embeddings + _POSITION_OFFSET, hf.hidden_size)
        needs_proj = proj_dim != hf.hidden_size
        self.project_in = nn.Linear(proj_dim, hf.hidden_size, bias=False) if needs_proj else None
        self.project_out = nn.Linear(hf.hidden_size, proj_dim, bias=False) if needs_proj else None
        keep_final = getattr(hf, "do_layer_norm_before", True) and not getattr(
            hf, "_remove_final_layer_norm", False
        )
        affine = getattr(hf, "layer_norm_elementwise_affine", True)
        self.final_layer_norm = nn.LayerNorm(hf.hidden_size, elementwise_affine=affine) if keep_final else None
        self.layers = nn.ModuleList(OPTDecoderLayer(hf, state, add_prefix(prefix, f"layers.{i}"))
                                    for i in range(hf.num_hidden_layers))

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + _POSITION_OFFSET)
        for layer in self.layers:
            x = layer(x, meta)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x


class _OPTModel(nn.Module):
    def __init__(self, hf, state: ParallelState, prefix: str = "model") -> None:
        super().__init__()
        self.decoder = OPTDecoder(hf, state, add_prefix(prefix, "decoder"))


class OPTForCausalLM(nn.Module):
    """OPT with its LM head tied to the token embedding."""

    def __init__(self, *, config: GridserveConfig, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix
        hf = hf_config_of(config)
        self.state = get_parallel_state()
        self.vocab_size = hf.vocab_size
        self.model = _OPTModel(hf, self.state, add_prefix(prefix, "model"))

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.decoder(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Full-vocabulary logits on TP rank 0 (``None`` on the other TP ranks)."""
        return parallel_logits(hidden, self.logits_head, self.vocab_size, self.state)

    @property
    def logits_head(self) -> VocabParallelEmbedding:
        """The LM head: the token embedding (tied)."""
        return self.model.decoder.embed_tokens

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.decoder.layers]

    # old checkpoints (e.g. facebook/opt-125m) omit "model."; the LM head is tied to the embedding
    weight_map = WeightMap(skip=(r"^lm_head\.weight$",), rename=((r"^decoder\.", "model.decoder."),),
                           stacked=LLAMA_STACKED[:3])

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        return load_weights(self, weights, self.weight_map)

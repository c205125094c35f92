"""Llama-family decoder (Llama, Mistral, Qwen2): RMSNorm, RoPE, GQA, SwiGLU, paged attention.

Q/K/V and gate/up projections are merged into one GEMM each; ``load_weights`` maps the
Hugging Face parameter names onto the merged layout. With tensor parallelism every projection is a
column- or row-parallel shard (heads split, KV heads replicated when fewer than ranks), the
embedding and LM head are vocab-parallel; with pipeline parallelism a rank builds only its stage's
layers and hands ``(hidden, residual)`` to the next stage.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn

from gridserve.kernels import silu_and_mul
from gridserve.services.worker.attention import AttentionMetadata, PagedAttention
from gridserve.services.worker.checkpoint import CheckpointTensor
from gridserve.services.worker.layers import RMSNorm, RotaryEmbedding, rope_parameters
from gridserve.services.worker.models.hf_config import hf_config_of
from gridserve.services.worker.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    add_prefix,
    load_replicated,
    parallel_logits,
)
from gridserve.services.worker.parallel_state import ParallelState, get_parallel_state
from gridserve.shared.config import GridserveConfig
from gridserve.shared.parallel import Shard, even_shard, kv_head_shard, stage_layers

# HF name fragment -> (merged parameter, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class LlamaAttention(nn.Module):
    """GQA attention; with TP each rank holds ``heads / tp`` query heads and their KV heads."""

    def __init__(self, hf, qkv_bias: bool, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        total_heads = hf.num_attention_heads
        total_kv = getattr(hf, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // total_heads
        heads = even_shard(total_heads, state.tp_size, state.tp_rank, "num_attention_heads")
        kv_heads = kv_head_shard(total_kv, state.tp_size, state.tp_rank)
        self.num_heads, self.num_kv_heads = heads.size, kv_heads.size
        d = self.head_dim
        self.qkv_proj = ColumnParallelLinear(
            hf.hidden_size,
            [Shard(heads.start * d, heads.size * d, heads.total * d)]
            + [Shard(kv_heads.start * d, kv_heads.size * d, kv_heads.total * d)] * 2,
            bias=qkv_bias, prefix=add_prefix(prefix, "qkv_proj"),
        )
        self.o_proj = RowParallelLinear(Shard(heads.start * d, heads.size * d, heads.total * d), hf.hidden_size,
                                        bias=getattr(hf, "attention_bias", False), state=state,
                                        prefix=add_prefix(prefix, "o_proj"))
        self.rotary_emb = RotaryEmbedding(d, d, hf.max_position_embeddings, rope_parameters(hf))
        self.attn = PagedAttention(self.num_heads, d, self.num_kv_heads, d**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q, k = self.rotary_emb(positions, q, k, self.num_heads, self.num_kv_heads)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    """SwiGLU; with TP each rank holds ``intermediate / tp`` rows of gate and up, columns of down."""

    def __init__(self, hf, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        bias = getattr(hf, "mlp_bias", False)
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"model.hf_config.hidden_act: only silu is supported, got {hf.hidden_act!r}")
        inter = even_shard(hf.intermediate_size, state.tp_size, state.tp_rank, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(hf.hidden_size, [inter, inter], bias=bias,
                                                 prefix=add_prefix(prefix, "gate_up_proj"))
        self.down_proj = RowParallelLinear(inter, hf.hidden_size, bias=bias, state=state,
                                           prefix=add_prefix(prefix, "down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    mlp_class: type[nn.Module] = LlamaMLP  # the feed-forward block (Mixtral: sparse MoE)

    def __init__(self, hf, qkv_bias: bool, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hf, qkv_bias, state, add_prefix(prefix, "self_attn"))
        self.mlp = self.mlp_class(hf, state, add_prefix(prefix, "mlp"))
        self.input_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)

    def forward(self, positions, x, residual, meta: AttentionMetadata):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class StageMissingLayer(nn.Module):
    """Placeholder for a layer another pipeline stage holds (keeps checkpoint indices aligned)."""


class LlamaModel(nn.Module):
    """Embedding (first stage), this stage's decoder layers, final norm (last stage)."""

    def __init__(self, hf, qkv_bias: bool, state: ParallelState,
                 layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer, prefix: str = "model") -> None:
        super().__init__()
        layout = state.layout
        self.stage = stage_layers(hf.num_hidden_layers, state.pp_size, state.pp_rank)
        if layout.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(hf.vocab_size, hf.hidden_size, state,
                                                       prefix=add_prefix(prefix, "embed_tokens"))
        self.layers = nn.ModuleList(
            layer_class(hf, qkv_bias, state, add_prefix(prefix, f"layers.{i}"))
            if self.stage.start <= i < self.stage.end else StageMissingLayer()
            for i in range(hf.num_hidden_layers)
        )
        if layout.is_last_stage:
            self.norm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)

    def forward(self, input_ids, positions, meta: AttentionMetadata,
                intermediate: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                inputs_embeds: Optional[torch.Tensor] = None):
        """Hidden states after the final norm (last stage), else ``(hidden, residual)`` for the next stage.
        ``inputs_embeds`` (a vision-language model's prefill) replaces the token embeddings."""
        if intermediate is None:
            x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
            residual = None
        else:
            x, residual = intermediate
        for layer in self.layers[self.stage.start : self.stage.end]:
            x, residual = layer(positions, x, residual, meta)
        if not hasattr(self, "norm"):
            return x, residual
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral decoder with an LM head (tied to the embedding when the config says so).

    Built for this worker's place in the ``PP x TP`` grid: only its stage's layers, only its
    tensor-parallel shard of each. The last stage owns the LM head; with tied embeddings and more
    than one stage it loads its own copy from ``embed_tokens``.
    """

    qkv_bias = False
    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, *, config: GridserveConfig, prefix: str = "") -> None:
        super().__init__()
        hf = hf_config_of(config)
        self.prefix = prefix
        self.state = get_parallel_state()
        self.vocab_size = hf.vocab_size
        self.model = LlamaModel(hf, self.qkv_bias or getattr(hf, "attention_bias", False), self.state,
                                self.layer_class, add_prefix(prefix, "model"))
        self.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
        layout = self.state.layout
        if layout.is_last_stage and not (self.tie_word_embeddings and layout.is_first_stage):
            self.lm_head = VocabParallelEmbedding(hf.vocab_size, hf.hidden_size, self.state,
                                                  prefix=add_prefix(prefix, "lm_head"))

    def forward(self, input_ids, positions, meta: AttentionMetadata, intermediate=None, inputs_embeds=None):
        return self.model(input_ids, positions, meta, intermediate, inputs_embeds)

    @property
    def logits_head(self) -> Optional[VocabParallelEmbedding]:
        """The LM head (the embedding when tied); None on a stage that does not compute logits."""
        if hasattr(self, "lm_head"):
            return self.lm_head
        return self.model.embed_tokens if self.state.layout.is_last_stage else None

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Full-vocabulary logits on TP rank 0 (``None`` on the other TP ranks)."""
        return parallel_logits(hidden, self.logits_head, self.vocab_size, self.state)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers if isinstance(layer, LlamaDecoderLayer)]

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Copy this rank's part of each HF-named tensor; return the names of parameters loaded.

        Tensors of other stages are skipped unread; sharded layers read only their slice.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._target(name)
            if target is None:
                continue
            target, shard = _stacked_target(target)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            module_name, _, param_name = target.rpartition(".")
            module = self.get_submodule(module_name)
            if hasattr(module, "load"):
                module.load(param_name, tensor, shard or 0)
            else:
                load_replicated(params[target], tensor)
            loaded.add(target)
        return loaded

    def _target(self, name: str) -> Optional[str]:
        """This model's parameter for checkpoint tensor ``name``, or None when it lives elsewhere."""
        if "rotary_emb.inv_freq" in name:
            return None
        layer = _LAYER.match(name)
        if layer is not None:
            stage = self.model.stage
            return name if stage.start <= int(layer.group(1)) < stage.end else None
        if name == "lm_head.weight":
            return None if self.tie_word_embeddings or not hasattr(self, "lm_head") else name
        if name == "model.embed_tokens.weight":
            if hasattr(self.model, "embed_tokens"):
                return name
            return "lm_head.weight" if self.tie_word_embeddings and hasattr(self, "lm_head") else None
        if name.startswith("model.norm."):
            return name if hasattr(self.model, "norm") else None
        return name


def _stacked_target(name: str) -> tuple[str, Optional[int]]:
    for fragment, (merged, shard) in _STACKED.items():
        if f".{fragment}." in name:
            return name.replace(fragment, merged), shard
    return name, None


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama architecture (sliding-window attention is not used at these lengths)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama architecture with biases on the Q/K/V projections."""

    qkv_bias = True

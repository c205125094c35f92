"""The LayerNorm decoder family as one set of layers, configured per architecture by a ``DecoderSpec``.

GPT-2, GPT-J, GPT-NeoX, Phi, StableLM, Starcoder2, Falcon and Bloom are the same machine with
different switches: LayerNorm (with or without bias) instead of RMSNorm; learned positions
(GPT-2), rotary embeddings (full, partial, GPT-J's interleaved pairs) or ALiBi (Bloom, Falcon);
the attention and the MLP one after the other or side by side on the same input ("parallel
residual": GPT-J, GPT-NeoX, Phi, Falcon); a plain activation MLP (``fc_in`` -> act -> ``fc_out``) or
StableLM's gated one; optional Q/K LayerNorms, sliding windows and biases. Each architecture's
module turns its config.json into a ``DecoderSpec`` and declares a ``WeightMap`` from its checkpoint
names onto the one layout used here::

    model.embed_tokens / model.embed_positions / model.embed_norm      (first pipeline stage)
    model.layers.N.attn_norm, .mlp_norm, .self_attn.{qkv_proj, o_proj, q_norm, k_norm},
                   .mlp.{fc_in, fc_out}   (or ``gate_up_proj`` / ``down_proj``)
    model.norm, lm_head                                                 (last pipeline stage)

Layers hand on ``(x, residual)`` as the Llama layers do: the hidden state is their sum, added at
the start of the next layer (or the final norm), so a pipeline stage passes the same pair on. Every
projection is a column- or row-parallel layer (tensor parallelism, int8 / int4 quantization).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from gridserve.kernels import gelu
from gridserve.services.worker.attention import AttentionMetadata, PagedAttention
from gridserve.services.worker.checkpoint import CheckpointTensor
from gridserve.services.worker.layers import RotaryEmbedding, rope_parameters, rotary_dim
from gridserve.services.worker.models.hf_config import hf_config_of
from gridserve.services.worker.models.llama import StageMissingLayer
from gridserve.services.worker.models.windows import announce_windows, effective_windows
from gridserve.services.worker.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    add_prefix,
    parallel_logits,
)
from gridserve.services.worker.parallel_state import ParallelState, get_parallel_state
from gridserve.services.worker.weight_loader import WeightMap, load_weights
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.parallel import Shard, even_shard, kv_head_shard, stage_layers

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# model-level modules that live on one pipeline stage only (the head and embedding are handled apart)
_STAGE_MODULES = ("embed_positions", "embed_norm", "norm")

Activation = Callable[[torch.Tensor], torch.Tensor]
# Builds one layer's feed-forward block: ``(state, prefix) -> module``.
MLPFactory = Callable[[ParallelState, str], nn.Module]
# Builds a Q or K norm for this rank's heads: ``(heads shard) -> module``.
HeadNormFactory = Callable[[Shard], nn.Module]


@dataclass(frozen=True)
class RotarySpec:
    rotary_dim: int  # leading dimensions of each head that are rotated
    max_position: int
    params: dict  # ``rope_parameters`` (type, theta, scaling)
    is_neox: bool = True  # False: GPT-J's interleaved pairs


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer: heads, biases, scale and how positions enter (rotary, ALiBi or neither)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool
    scale: float
    inverse_layer_scale: bool = False  # GPT-2's scale_attn_by_inverse_layer_idx: scale / (layer + 1)
    rotary: Optional[RotarySpec] = None
    sliding_window: Optional[int] = None
    alibi_slopes: Optional[torch.Tensor] = None  # every head's slope (float32, CPU)
    q_norm: Optional[HeadNormFactory] = None
    k_norm: Optional[HeadNormFactory] = None


@dataclass(frozen=True)
class DecoderSpec:
    """A whole decoder: sizes, the per-layer attention and MLP, and how the residual stream flows."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    attention: AttentionSpec
    mlp: MLPFactory
    norm_eps: float
    parallel_residual: bool  # x + attn(norm(x)) + mlp(norm'(x)) instead of two residual steps
    mlp_norm: bool = True  # the MLP reads its own norm (False: parallel, sharing the attention's)
    residual_from_norm: bool = False  # Bloom's apply_residual_connection_post_layernorm
    learned_positions: int = 0  # rows of a learned position table (GPT-2); 0: none
    embedding_norm: bool = False  # a LayerNorm right after the embedding (Bloom)
    tie_word_embeddings: bool = False
    head_bias: bool = False  # the LM head adds a bias over the vocabulary (GPT-J, Phi)

    def norm(self) -> nn.LayerNorm:
        return nn.LayerNorm(self.hidden_size, eps=self.norm_eps)


def _gelu(approximate: str) -> Activation:
    return lambda x: gelu(x, approximate)


# GELU's tanh approximation; gelu_new, gelu_fast and Bloom's GELU write it out (equal to rounding)
GELU_TANH = _gelu("tanh")
# Hugging Face activation names (``ACT2FN``) -> the function
_ACTIVATIONS: dict[str, Activation] = {
    "gelu": _gelu("none"),
    "gelu_new": GELU_TANH,
    "gelu_fast": GELU_TANH,
    "gelu_pytorch_tanh": GELU_TANH,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str, field: str) -> Activation:
    """The activation HF calls ``name``; refused, naming the config ``field``, when unknown."""
    if name not in _ACTIVATIONS:
        raise ConfigError(field, f"unsupported activation {name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]


def head_dim_of(hidden_size: int, num_heads: int) -> int:
    """``hidden_size / num_heads``, refused when it does not divide (these models derive it)."""
    if num_heads <= 0 or hidden_size % num_heads:
        raise ConfigError("model.hf_config.num_attention_heads",
                          f"hidden size {hidden_size} is not divisible by {num_heads} heads")
    return hidden_size // num_heads


def rotary_settings(hf: Any, head_dim: int, *, default_fraction: float = 1.0, default_theta: float = 10000.0,
                    is_neox: bool = True) -> RotarySpec:
    """RoPE over the first ``partial_rotary_factor`` of each head, as transformers reads the config
    (``rope_parameters``, or the older top-level keys; ``default_*`` are the architecture's own)."""
    params = rope_parameters(hf, default_theta=default_theta)
    params.setdefault("partial_rotary_factor", default_fraction)
    return RotarySpec(rotary_dim(head_dim, params), int(getattr(hf, "max_position_embeddings", 2048)),
                      params, is_neox)


def grouped_qkv(num_heads: int, num_kv_heads: int, head_dim: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A fused Q/K/V tensor stored per KV group ``[kv_heads, heads / kv_heads + 2, head_dim]`` (the
    group's query heads, then its key, then its value) rearranged to ``[Q; K; V]``. With one query
    head per group this is the per-head ``[heads, 3, head_dim]`` layout of GPT-NeoX and Bloom."""
    per_group = num_heads // num_kv_heads

    def convert(t: torch.Tensor) -> torch.Tensor:
        rest = t.shape[1:]
        groups = t.reshape(num_kv_heads, per_group + 2, head_dim, *rest)
        q, k, v = groups[:, :per_group], groups[:, per_group], groups[:, per_group + 1]
        return torch.cat([q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)])

    return convert


class DenseMLP(nn.Module):
    """``fc_out(act(fc_in(x)))``: GPT-2's c_fc / c_proj, NeoX's dense_h_to_4h / dense_4h_to_h, Phi's
    fc1 / fc2. With TP each rank holds ``intermediate / tp`` rows of fc_in and columns of fc_out."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: Activation, bias: bool,
                 state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        inter = even_shard(intermediate_size, state.tp_size, state.tp_rank, "intermediate_size")
        self.fc_in = ColumnParallelLinear(hidden_size, [inter], bias=bias, prefix=add_prefix(prefix, "fc_in"))
        self.fc_out = RowParallelLinear(inter, hidden_size, bias=bias, state=state, prefix=add_prefix(prefix, "fc_out"))
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


def dense_mlp(hidden_size: int, intermediate_size: int, act: Activation, bias: bool) -> MLPFactory:
    return lambda state, prefix: DenseMLP(hidden_size, intermediate_size, act, bias, state, prefix)


class HeadLayerNorm(nn.Module):
    """One LayerNorm over ``head_dim`` shared by every head (Phi's Q/K layernorm)."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(head_dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.unflatten(-1, (-1, self.norm.normalized_shape[0]))).flatten(-2)


class PerHeadLayerNorm(nn.Module):
    """A bias-free LayerNorm of its own for each head (StableLM's Q/K layernorm, ``norms.<head>``).

    Every head's weight is kept (they are ``head_dim`` numbers each, and the checkpoint numbers
    them globally); this rank applies those of its own heads.
    """

    def __init__(self, heads: Shard, head_dim: int, eps: float) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(head_dim, eps=eps, bias=False) for _ in range(heads.total))
        self.heads = heads
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mine = self.norms[self.heads.start : self.heads.end]
        weight = torch.stack([norm.weight for norm in mine])  # [heads, head_dim]
        h = x.unflatten(-1, (len(mine), -1))
        return (F.layer_norm(h, h.shape[-1:], eps=self.eps) * weight).flatten(-2)


class DecoderAttention(nn.Module):
    """Fused Q/K/V projection, optional Q/K norms and rotary embedding, paged attention, output
    projection. With TP each rank holds ``heads / tp`` query heads and their KV heads (replicated
    when there are fewer KV heads than ranks) and the ALiBi slopes of its own heads."""

    def __init__(self, spec: AttentionSpec, hidden_size: int, layer_index: int, state: ParallelState,
                 prefix: str = "") -> None:
        super().__init__()
        if spec.num_kv_heads <= 0 or spec.num_heads % spec.num_kv_heads:
            raise ConfigError("model.hf_config.num_key_value_heads",
                              f"{spec.num_kv_heads} KV heads do not divide {spec.num_heads} query heads")
        heads = even_shard(spec.num_heads, state.tp_size, state.tp_rank, "num_attention_heads")
        kv_heads = kv_head_shard(spec.num_kv_heads, state.tp_size, state.tp_rank)
        self.num_heads, self.num_kv_heads = heads.size, kv_heads.size
        d = spec.head_dim
        q_rows = Shard(heads.start * d, heads.size * d, heads.total * d)
        kv_rows = Shard(kv_heads.start * d, kv_heads.size * d, kv_heads.total * d)
        self.qkv_proj = ColumnParallelLinear(hidden_size, [q_rows, kv_rows, kv_rows], bias=spec.qkv_bias,
                                             prefix=add_prefix(prefix, "qkv_proj"))
        self.o_proj = RowParallelLinear(q_rows, hidden_size, bias=spec.o_bias, state=state,
                                        prefix=add_prefix(prefix, "o_proj"))
        self.q_norm = spec.q_norm(heads) if spec.q_norm else None
        self.k_norm = spec.k_norm(kv_heads) if spec.k_norm else None
        rotary = spec.rotary
        self.rotary_emb = (RotaryEmbedding(d, rotary.rotary_dim, rotary.max_position, rotary.params, rotary.is_neox)
                           if rotary else None)
        slopes = spec.alibi_slopes[heads.start : heads.end] if spec.alibi_slopes is not None else None
        scale = spec.scale / (layer_index + 1) if spec.inverse_layer_scale else spec.scale
        self.attn = PagedAttention(self.num_heads, d, self.num_kv_heads, scale,
                                   sliding_window=spec.sliding_window, alibi_slopes=slopes)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k, self.num_heads, self.num_kv_heads)
        return self.o_proj(self.attn(q, k, v, meta))


class DecoderLayer(nn.Module):
    """Pre-LayerNorm block, sequential (attention then MLP) or parallel (both read the same input)."""

    def __init__(self, spec: DecoderSpec, index: int, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        self.parallel = spec.parallel_residual
        self.residual_from_norm = spec.residual_from_norm
        self.attn_norm = spec.norm()
        self.mlp_norm = spec.norm() if spec.mlp_norm or not self.parallel else None
        self.self_attn = DecoderAttention(spec.attention, spec.hidden_size, index, state,
                                          add_prefix(prefix, "self_attn"))
        self.mlp = spec.mlp(state, add_prefix(prefix, "mlp"))

    def forward(self, positions, x: torch.Tensor, residual: Optional[torch.Tensor], meta: AttentionMetadata):
        """``(x, residual)`` in and out; the layer's input (and output) hidden state is their sum."""
        hidden = x if residual is None else x + residual
        normed = self.attn_norm(hidden)
        attn = self.self_attn(positions, normed, meta)
        if self.parallel:
            mlp_in = normed if self.mlp_norm is None else self.mlp_norm(hidden)
            return attn + self.mlp(mlp_in), hidden
        hidden = attn + (normed if self.residual_from_norm else hidden)
        normed = self.mlp_norm(hidden)
        return self.mlp(normed), (normed if self.residual_from_norm else hidden)


class LayerNormDecoder(nn.Module):
    """Embedding (+ learned positions, + embedding norm) on the first stage, this stage's layers,
    the final norm on the last stage."""

    def __init__(self, spec: DecoderSpec, state: ParallelState, prefix: str = "model") -> None:
        super().__init__()
        layout = state.layout
        self.stage = stage_layers(spec.num_layers, state.pp_size, state.pp_rank)
        first = layout.is_first_stage
        self.embed_tokens = (VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, state,
                                                    prefix=add_prefix(prefix, "embed_tokens")) if first else None)
        self.embed_positions = (nn.Embedding(spec.learned_positions, spec.hidden_size)
                                if first and spec.learned_positions else None)
        self.embed_norm = spec.norm() if first and spec.embedding_norm else None
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, state, add_prefix(prefix, f"layers.{i}"))
            if self.stage.start <= i < self.stage.end else StageMissingLayer()
            for i in range(spec.num_layers)
        )
        self.norm = spec.norm() if layout.is_last_stage else None

    def forward(self, input_ids, positions, meta: AttentionMetadata,
                intermediate: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                inputs_embeds: Optional[torch.Tensor] = None):
        """Hidden states after the final norm (last stage), else ``(x, residual)`` for the next stage."""
        if intermediate is None:
            x, residual = self.embed(input_ids, positions, inputs_embeds), None
        else:
            x, residual = intermediate
        for layer in self.layers[self.stage.start : self.stage.end]:
            x, residual = layer(positions, x, residual, meta)
        if self.norm is None:
            return x, residual
        return self.norm(x if residual is None else x + residual)

    def embed(self, input_ids, positions, inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions)
        return x if self.embed_norm is None else self.embed_norm(x)


class BiasedLMHead(VocabParallelEmbedding):
    """A vocab-parallel LM head that adds a bias to its logits (GPT-J, Phi); each rank holds the
    bias of its own vocabulary rows (zero on the padding rows)."""

    def __init__(self, vocab_size: int, hidden_size: int, state: Optional[ParallelState] = None,
                 prefix: str = "") -> None:
        super().__init__(vocab_size, hidden_size, state, prefix)
        self.bias = nn.Parameter(torch.empty(self.weight.shape[0]))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return super().matmul(x) + self.bias

    def load(self, param: str, tensor: CheckpointTensor, shard_id: int = 0) -> None:
        if param != "bias":
            super().load(param, tensor, shard_id)
            return
        rows = self.shard.size
        self.bias.data[:rows].copy_(tensor.rows(self.shard.start, self.shard.end))
        self.bias.data[rows:].zero_()


def _effective_window(spec: DecoderSpec, max_model_len: int) -> DecoderSpec:
    """``spec`` without a window no sequence can outgrow (``windows.effective_windows``)."""
    window = effective_windows((spec.attention.sliding_window,), max_model_len)[0]
    if window == spec.attention.sliding_window:
        return spec
    return replace(spec, attention=replace(spec.attention, sliding_window=window))


class LayerNormCausalLM(nn.Module):
    """A LayerNorm-family decoder with its LM head, built for this worker's place in the ``PP x TP`` grid.

    A subclass gives ``decoder_spec(hf)`` (config.json -> ``DecoderSpec``, refusing what it cannot
    honour) and ``checkpoint_names(hf)`` (its ``WeightMap``). The last stage owns the LM head; tied
    to the embedding, it is the embedding itself on a single stage and a copy read from it otherwise.
    """

    def __init__(self, *, config: GridserveConfig, prefix: str = "") -> None:
        super().__init__()
        hf = hf_config_of(config)
        spec = _effective_window(self.decoder_spec(hf), config.model.max_model_len)
        announce_windows(type(self).__name__, (spec.attention.sliding_window,) * spec.num_layers)
        if spec.tie_word_embeddings and spec.head_bias:
            raise ConfigError("model.hf_config.tie_word_embeddings",
                              "true is not supported: this architecture's LM head has a bias of its own")
        self.prefix = prefix
        self.state = get_parallel_state()
        self.vocab_size = spec.vocab_size
        self.tie_word_embeddings = spec.tie_word_embeddings
        self.model = LayerNormDecoder(spec, self.state, add_prefix(prefix, "model"))
        layout = self.state.layout
        if layout.is_last_stage and not (self.tie_word_embeddings and layout.is_first_stage):
            head = BiasedLMHead if spec.head_bias else VocabParallelEmbedding
            self.lm_head = head(spec.vocab_size, spec.hidden_size, self.state, prefix=add_prefix(prefix, "lm_head"))
        self.weight_map = self.checkpoint_names(hf)

    @staticmethod
    def decoder_spec(hf: Any) -> DecoderSpec:
        raise NotImplementedError

    @staticmethod
    def checkpoint_names(hf: Any) -> WeightMap:
        raise NotImplementedError

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
        return [layer.self_attn.attn for layer in self.model.layers if isinstance(layer, DecoderLayer)]

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Copy this rank's part of each checkpoint tensor; return the names of parameters loaded."""
        return load_weights(self, weights, self.weight_map, self._target)

    def _target(self, name: str) -> Optional[str]:
        """This rank's parameter for (renamed) checkpoint tensor ``name``; None when it lives elsewhere."""
        layer = _LAYER.match(name)
        if layer is not None:
            stage = self.model.stage
            return name if stage.start <= int(layer.group(1)) < stage.end else None
        if name.startswith("lm_head."):
            return name if hasattr(self, "lm_head") and not self.tie_word_embeddings else None
        if name.startswith("model.embed_tokens."):
            if self.model.embed_tokens is not None:
                return name
            return "lm_head.weight" if self.tie_word_embeddings and hasattr(self, "lm_head") else None
        module = name.split(".")[1] if name.startswith("model.") else None
        if module in _STAGE_MODULES:
            return name if getattr(self.model, module) is not None else None
        return name

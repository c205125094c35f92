"""Llama-family decoders: one configurable decoder (norms, RoPE, GQA, gated MLP, paged attention).

Llama, Mistral and Qwen2 are this decoder with its defaults; the architectures that differ from
Llama by a few options (Qwen3, SmolLM3, OLMo 2, Granite, Phi-3, GLM-4, Cohere, Gemma 1/2/3) each
declare a ``DecoderSpec`` in their own module and reuse the classes here.

Q/K/V and gate/up projections are merged into one GEMM each; ``load_weights`` maps the
Hugging Face parameter names onto the merged layout (or splits a checkpoint's pre-fused ones). With
tensor parallelism every projection is a column- or row-parallel shard (heads split, KV heads
replicated when fewer than ranks), the embedding and LM head are vocab-parallel; with pipeline
parallelism a rank builds only its stage's layers and hands ``(hidden, residual)`` to the next
stage.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from torch import nn

from gridserve.kernels import gelu_and_mul, rms_norm, silu_and_mul
from gridserve.services.worker.attention import AttentionMetadata, PagedAttention
from gridserve.services.worker.checkpoint import CheckpointTensor
from gridserve.services.worker.layers import (
    BiasFreeLayerNorm,
    GemmaRMSNorm,
    RMSNorm,
    RotaryEmbedding,
    rope_parameters,
    rotary_dim,
)
from gridserve.services.worker.models.hf_config import hf_config_of
from gridserve.services.worker.models.windows import (
    announce_windows,
    checked_window,
    effective_windows,
)
from gridserve.services.worker.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    add_prefix,
    parallel_logits,
)
from gridserve.services.worker.parallel_state import ParallelState, get_parallel_state
from gridserve.services.worker.weight_loader import (
    LLAMA_STACKED,
    ROTARY_BUFFERS,
    WeightMap,
    load_weights,
)
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.parallel import Shard, even_shard, kv_head_shard, stage_layers

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_LAYER_TYPES = ("full_attention", "sliding_attention")
# Llama's norms: before attention and before the MLP (``DecoderSpec.norms``)
LLAMA_NORMS = ("input_layernorm", None, "post_attention_layernorm", None)


@dataclass(frozen=True)
class DecoderSpec:
    """What one architecture's decoder does differently from Llama's; every default is Llama's.

    A model class builds it from the checkpoint's config (``decoder_spec``, usually via
    ``llama_spec(hf, **overrides)``); the layers below read nothing else that varies by architecture.
    """

    # ---- attention
    qkv_bias: bool = False
    o_proj_bias: bool = False
    # Q/K normalised before RoPE: "head" (each head, one shared weight: Qwen3, Gemma 3), "each_head"
    # (each head, a weight per head; LayerNorm only: Cohere), "projection" (the whole width: OLMo 2)
    qk_norm: Optional[str] = None
    attention_scale: Optional[float] = None  # the score scale; None: head_dim ** -0.5
    attn_soft_cap: Optional[float] = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    is_neox: bool = True  # RoPE on each head's two halves; False: on interleaved pairs (GLM-4, Cohere)
    rope: tuple[Optional[dict], ...] = ()  # per layer: its RoPE parameters; None: no RoPE (SmolLM3)
    windows: tuple[Optional[int], ...] = ()  # per layer: its sliding window; None: full attention
    # False: bidirectional (a decoder embedder: EmbeddingGemma): every token sees its whole input (or
    # its window either side), so no KV cache is kept and the model pools only, never generates
    causal: bool = True
    # ---- norms and residuals
    norm: str = "rms"  # "rms", "gemma_rms" (scales by 1 + w), "layer" (LayerNorm without bias)
    norm_eps: float = 1e-6
    # checkpoint names of the norms before attention, after it, before the MLP, after it (None: none)
    norms: tuple[Optional[str], ...] = LLAMA_NORMS
    parallel_residual: bool = False  # attention and MLP both read the block's normed input (Cohere)
    residual_multiplier: float = 1.0  # attention / MLP outputs scaled before the residual add (Granite)
    # ---- embeddings and logits
    embed_scale: float = 1.0  # token embeddings times this (Gemma: sqrt(hidden); Granite's multiplier)
    logit_scale: float = 1.0  # logits times this (Cohere's logit_scale, Granite's 1 / logits_scaling)
    final_soft_cap: Optional[float] = None  # logits -> cap * tanh(logits / cap) (Gemma 2 / 3)


def llama_spec(hf: Any, *, layer_types: Optional[Sequence[str]] = None, windows_on: bool = True,
               default_theta: float = 10000.0, **overrides: Any) -> DecoderSpec:
    """Llama's decoder for config ``hf``, with ``overrides`` (``DecoderSpec`` fields).

    The architecture's defaults for what a config may leave out: ``layer_types`` (None: a window,
    when there is one, applies to every layer, as Mistral and Phi-3 do), ``windows_on`` (the
    default of ``use_sliding_window``) and ``default_theta`` (the RoPE base).
    """
    bias = bool(getattr(hf, "attention_bias", False))
    base = {
        "qkv_bias": bias,
        "o_proj_bias": bias,
        "rope": (rope_parameters(hf, default_theta=default_theta),) * hf.num_hidden_layers,
        "windows": layer_windows(hf, layer_types, windows_on),
        "norm_eps": getattr(hf, "rms_norm_eps", 1e-6),
    }
    return DecoderSpec(**{**base, **overrides})


def layer_types_of(hf: Any, default: Optional[Sequence[str]] = None) -> Optional[tuple[str, ...]]:
    """The config's ``layer_types`` (checked), else ``default``."""
    types = getattr(hf, "layer_types", None) or default
    if types is None:
        return None
    if len(types) != hf.num_hidden_layers or any(t not in _LAYER_TYPES for t in types):
        raise ConfigError("model.hf_config.layer_types",
                          f"must list one of {_LAYER_TYPES} per layer ({hf.num_hidden_layers}), got {types!r}")
    return tuple(types)


def layer_windows(hf: Any, default_types: Optional[Sequence[str]] = None,
                  windows_on: bool = True) -> tuple[Optional[int], ...]:
    """Each layer's sliding window, as transformers reads the config.

    ``sliding_window`` applies to the layers ``layer_types`` marks ``sliding_attention`` (every layer
    when there are no layer types), and to none when the config turns windows off
    (``use_sliding_window: false``: Qwen2 / Qwen3 / SmolLM3, ``windows_on`` when it says nothing)
    or names no window.
    """
    layers = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    if window is None or not getattr(hf, "use_sliding_window", windows_on):
        return (None,) * layers
    window = checked_window(window)
    types = layer_types_of(hf, default_types)
    if types is None:
        return (window,) * layers
    return tuple(window if t == "sliding_attention" else None for t in types)


def max_window_layer_types(hf: Any) -> tuple[str, ...]:
    """Qwen2 / Qwen3's default layer types: a window on the layers from ``max_window_layers`` on."""
    first = getattr(hf, "max_window_layers", 28)
    return tuple("sliding_attention" if i >= first else "full_attention" for i in range(hf.num_hidden_layers))


def make_norm(kind: str, shape: int | tuple[int, ...], eps: float) -> nn.Module:
    """The norm of ``DecoderSpec.norm`` over ``shape``."""
    if kind == "rms":
        return RMSNorm(shape, eps)
    if kind == "gemma_rms":
        return GemmaRMSNorm(shape, eps)
    if kind == "layer":
        return BiasFreeLayerNorm(shape, eps)
    raise ValueError(f"unknown norm kind {kind!r}")


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole Q or K projection (OLMo 2), whose heads may be split across TP ranks.

    Each rank holds the weight of its own columns; the mean square is all-reduced over the group,
    so the result equals the unsharded norm. With fewer KV heads than ranks the replicated K head
    is counted once per replica, and so is its width: the mean is still exact.
    """

    def __init__(self, shard: Shard, eps: float, state: ParallelState) -> None:
        super().__init__()
        self.shard = shard
        self.eps = eps
        self.state = state
        self.weight = nn.Parameter(torch.ones(shard.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.state.tp_size == 1:
            return rms_norm(x, self.weight, self.eps)
        h = x.float()
        mean_square = self.state.all_reduce(h.pow(2).sum(-1, keepdim=True)) / (h.shape[-1] * self.state.tp_size)
        return (self.weight * (h * torch.rsqrt(mean_square + self.eps))).to(x.dtype)

    def load(self, param: str, tensor: CheckpointTensor, shard_id: int = 0) -> None:
        self.weight.data.copy_(tensor.rows(self.shard.start, self.shard.end))


class HeadShardedLayerNorm(BiasFreeLayerNorm):
    """A per-head LayerNorm with one weight row per head (Cohere's Q/K norms): this rank's heads' rows."""

    def __init__(self, heads: Shard, head_dim: int, eps: float) -> None:
        super().__init__((heads.size, head_dim), eps)
        self.heads = heads

    def load(self, param: str, tensor: CheckpointTensor, shard_id: int = 0) -> None:
        self.weight.data.copy_(tensor.rows(self.heads.start, self.heads.end))


class LlamaAttention(nn.Module):
    """GQA attention; with TP each rank holds ``heads / tp`` query heads and their KV heads."""

    def __init__(self, hf, spec: DecoderSpec, layer: int, rotary: Optional[RotaryEmbedding], state: ParallelState,
                 prefix: str = "") -> None:
        super().__init__()
        total_heads = hf.num_attention_heads
        total_kv = getattr(hf, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // total_heads
        heads = even_shard(total_heads, state.tp_size, state.tp_rank, "num_attention_heads")
        kv_heads = kv_head_shard(total_kv, state.tp_size, state.tp_rank)
        self.num_heads, self.num_kv_heads = heads.size, kv_heads.size
        d = self.head_dim
        q_cols, kv_cols = (Shard(s.start * d, s.size * d, s.total * d) for s in (heads, kv_heads))
        self.qkv_proj = ColumnParallelLinear(hf.hidden_size, [q_cols, kv_cols, kv_cols], bias=spec.qkv_bias,
                                             prefix=add_prefix(prefix, "qkv_proj"))
        self.o_proj = RowParallelLinear(q_cols, hf.hidden_size, bias=spec.o_proj_bias, state=state,
                                        prefix=add_prefix(prefix, "o_proj"))
        self.qk_norm = spec.qk_norm
        if spec.qk_norm is not None:
            self.q_norm, self.k_norm = _qk_norms(spec, heads, kv_heads, q_cols, kv_cols, d, state)
        self.rotary_emb = rotary  # shared by the layers with the same RoPE (it holds no parameters)
        scale = spec.attention_scale if spec.attention_scale is not None else d**-0.5
        self.attn = PagedAttention(self.num_heads, d, self.num_kv_heads, scale, sliding_window=spec.windows[layer],
                                   logits_soft_cap=spec.attn_soft_cap, causal=spec.causal)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        if self.qk_norm is not None:
            q, k = self._norm_qk(q, k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k, self.num_heads, self.num_kv_heads)
        return self.o_proj(self.attn(q, k, v, meta))

    def _norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.qk_norm == "projection":
            return self.q_norm(q), self.k_norm(k)
        t, d = q.shape[0], self.head_dim
        if self.qk_norm == "each_head":  # a weight row per head: [tokens, heads, head_dim]
            q = self.q_norm(q.reshape(t, self.num_heads, d)).reshape(t, -1)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, d)).reshape(t, -1)
            return q, k
        # one weight for every head: q and k are column slices of the fused QKV output, so ``reshape``
        # copies each once into [tokens x heads, head_dim] rows, which the norm kernel reads as they lie
        q = self.q_norm(q.reshape(t * self.num_heads, d)).view(t, -1)
        k = self.k_norm(k.reshape(t * self.num_kv_heads, d)).view(t, -1)
        return q, k


def _qk_norms(spec: DecoderSpec, heads: Shard, kv_heads: Shard, q_cols: Shard, kv_cols: Shard, head_dim: int,
              state: ParallelState) -> tuple[nn.Module, nn.Module]:
    if spec.qk_norm == "head":
        return make_norm(spec.norm, head_dim, spec.norm_eps), make_norm(spec.norm, head_dim, spec.norm_eps)
    if spec.qk_norm == "each_head" and spec.norm == "layer":
        return HeadShardedLayerNorm(heads, head_dim, spec.norm_eps), HeadShardedLayerNorm(kv_heads, head_dim, spec.norm_eps)
    if spec.qk_norm == "projection":
        return ProjectionRMSNorm(q_cols, spec.norm_eps, state), ProjectionRMSNorm(kv_cols, spec.norm_eps, state)
    raise ValueError(f"unknown qk_norm {spec.qk_norm!r}")


# The gated activations ``act(gate) * up`` by transformers' names (``hidden_act`` / ``hidden_activation``).
_GATED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "gelu": functools.partial(gelu_and_mul, approximate="none"),
    "gelu_pytorch_tanh": functools.partial(gelu_and_mul, approximate="tanh"),
}


def gated_activation(hf: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``act(gate) * up`` over a merged gate/up projection, ``act`` as the config names it.

    Gemma 2 / 3 name it ``hidden_activation``, the others ``hidden_act``; Gemma's legacy
    ``hidden_act: gelu`` means the tanh approximation (as transformers' ``GemmaConfig`` reads it).
    """
    field_name = "hidden_activation" if getattr(hf, "hidden_activation", None) else "hidden_act"
    name = getattr(hf, field_name, None) or "silu"
    if name == "gelu" and getattr(hf, "model_type", None) == "gemma":
        name = "gelu_pytorch_tanh"
    if name not in _GATED:
        raise ConfigError(f"model.hf_config.{field_name}",
                          f"unsupported activation {name!r}; supported: {', '.join(_GATED)}")
    return _GATED[name]


class LlamaMLP(nn.Module):
    """Gated MLP (SwiGLU / GeGLU); with TP each rank holds ``intermediate / tp`` rows of gate and up,
    columns of down."""

    def __init__(self, hf, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        bias = getattr(hf, "mlp_bias", False)
        self.act = gated_activation(hf)
        inter = even_shard(hf.intermediate_size, state.tp_size, state.tp_rank, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(hf.hidden_size, [inter, inter], bias=bias,
                                                 prefix=add_prefix(prefix, "gate_up_proj"))
        self.down_proj = RowParallelLinear(inter, hf.hidden_size, bias=bias, state=state,
                                           prefix=add_prefix(prefix, "down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def _add_then_norm(norm: Optional[nn.Module], x: torch.Tensor, residual: Optional[torch.Tensor]):
    """``(norm(x + residual), x + residual)``: the residual stream advanced by ``x`` and its normed
    form (the stream itself where there is no norm; ``x`` alone for the first layer)."""
    if residual is None:
        return (x if norm is None else norm(x)), x
    if norm is None:
        residual = x + residual
        return residual, residual
    return norm(x, residual)


class LlamaDecoderLayer(nn.Module):
    """Attention and MLP blocks around the residual stream, with the norms ``DecoderSpec.norms`` names.

    ``forward`` takes the previous layer's block output ``x`` (not yet added) and the residual
    stream, and returns this layer's last block output and the stream: each add is fused with the
    norm that follows it.
    """

    mlp_class: type[nn.Module] = LlamaMLP  # the feed-forward block (Mixtral: sparse MoE)

    def __init__(self, hf, spec: DecoderSpec, layer: int, rotary: Optional[RotaryEmbedding], state: ParallelState,
                 prefix: str = "") -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hf, spec, layer, rotary, state, add_prefix(prefix, "self_attn"))
        self.mlp = self.mlp_class(hf, state, add_prefix(prefix, "mlp"))
        for name in spec.norms:
            if name is not None:
                setattr(self, name, make_norm(spec.norm, hf.hidden_size, spec.norm_eps))
        # (before attention, after it, before the MLP, after it): the modules registered above, by slot
        self._norms = tuple(None if name is None else getattr(self, name) for name in spec.norms)
        self.parallel_residual = spec.parallel_residual
        self.residual_multiplier = spec.residual_multiplier

    def forward(self, positions, x, residual, meta: AttentionMetadata):
        attn_in, attn_out, mlp_in, mlp_out = self._norms
        h, residual = _add_then_norm(attn_in, x, residual)
        a = self.self_attn(positions, h, meta)
        if attn_out is not None:
            a = attn_out(a)
        a = self._scaled(a)
        if self.parallel_residual:  # residual + attention + MLP, added in that order
            return self._scaled(self.mlp(h)), a + residual
        h, residual = _add_then_norm(mlp_in, a, residual)
        m = self.mlp(h)
        if mlp_out is not None:
            m = mlp_out(m)
        return self._scaled(m), residual

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier


class StageMissingLayer(nn.Module):
    """Placeholder for a layer another pipeline stage holds (keeps checkpoint indices aligned)."""


def _rotaries(hf, spec: DecoderSpec, stage: Shard) -> list[Optional[RotaryEmbedding]]:
    """Each layer's RoPE (None: no RoPE or another stage's layer); one module per distinct setting."""
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    built: dict[str, RotaryEmbedding] = {}
    out: list[Optional[RotaryEmbedding]] = []
    for i, params in enumerate(spec.rope):
        if params is None or not stage.start <= i < stage.end:
            out.append(None)
            continue
        key = json.dumps(params, sort_keys=True, default=str)
        if key not in built:
            built[key] = RotaryEmbedding(head_dim, rotary_dim(head_dim, params), hf.max_position_embeddings, params,
                                         spec.is_neox)
        out.append(built[key])
    return out


class LlamaModel(nn.Module):
    """Embedding (first stage), this stage's decoder layers, final norm (last stage)."""

    def __init__(self, hf, spec: DecoderSpec, state: ParallelState,
                 layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer, prefix: str = "model") -> None:
        super().__init__()
        layout = state.layout
        self.stage = stage_layers(hf.num_hidden_layers, state.pp_size, state.pp_rank)
        self.embed_scale = spec.embed_scale
        if layout.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(hf.vocab_size, hf.hidden_size, state,
                                                       prefix=add_prefix(prefix, "embed_tokens"))
        rotaries = _rotaries(hf, spec, self.stage)
        self.layers = nn.ModuleList(
            layer_class(hf, spec, i, rotaries[i], state, add_prefix(prefix, f"layers.{i}"))
            if self.stage.start <= i < self.stage.end else StageMissingLayer()
            for i in range(hf.num_hidden_layers)
        )
        if layout.is_last_stage:
            self.norm = make_norm(spec.norm, hf.hidden_size, spec.norm_eps)

    def forward(self, input_ids, positions, meta: AttentionMetadata,
                intermediate: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                inputs_embeds: Optional[torch.Tensor] = None):
        """Hidden states after the final norm (last stage), else ``(hidden, residual)`` for the next stage.
        ``inputs_embeds`` (a vision-language model's prefill) replaces the token embeddings."""
        if intermediate is None:
            x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
            if self.embed_scale != 1.0:  # the scale in the activations' dtype, as transformers' Gemma
                x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
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
    """A Llama-family decoder with an LM head (tied to the embedding when the config says so).

    Built for this worker's place in the ``PP x TP`` grid: only its stage's layers, only its
    tensor-parallel shard of each. The last stage owns the LM head; with tied embeddings and more
    than one stage it loads its own copy from ``embed_tokens``. A subclass describes its
    architecture with ``decoder_spec`` and, where its checkpoint names differ, ``weight_map``.
    """

    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, *, config: GridserveConfig, prefix: str = "") -> None:
        super().__init__()
        hf = hf_config_of(config)
        self.prefix = prefix
        self.state = get_parallel_state()
        self.vocab_size = hf.vocab_size
        spec = self.decoder_spec(hf)
        self.spec = replace(spec, windows=effective_windows(spec.windows, config.model.max_model_len))
        if self.spec.causal:  # a bidirectional model keeps no KV cache, windowed or not
            announce_windows(type(self).__name__, self.spec.windows)
        self.model = LlamaModel(hf, self.spec, self.state, self.layer_class, add_prefix(prefix, "model"))
        self.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
        layout = self.state.layout
        if layout.is_last_stage and not (self.tie_word_embeddings and layout.is_first_stage):
            self.lm_head = VocabParallelEmbedding(hf.vocab_size, hf.hidden_size, self.state,
                                                  prefix=add_prefix(prefix, "lm_head"))

    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        """How this architecture's decoder differs from Llama's, read from its config."""
        return llama_spec(hf)

    def forward(self, input_ids, positions, meta: AttentionMetadata, intermediate=None, inputs_embeds=None):
        return self.model(input_ids, positions, meta, intermediate, inputs_embeds)

    @property
    def logits_head(self) -> Optional[VocabParallelEmbedding]:
        """The LM head (the embedding when tied); None on a stage that does not compute logits."""
        if hasattr(self, "lm_head"):
            return self.lm_head
        return self.model.embed_tokens if self.state.layout.is_last_stage else None

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Full-vocabulary logits on TP rank 0 (``None`` on the other TP ranks), scaled and soft-capped
        as the architecture does."""
        logits = parallel_logits(hidden, self.logits_head, self.vocab_size, self.state)
        if logits is None:
            return None
        if self.spec.logit_scale != 1.0:
            logits = logits * self.spec.logit_scale
        cap = self.spec.final_soft_cap
        if cap is None:
            return logits
        # cap * tanh(logits / cap), written as cap * (2 sigmoid(2 logits / cap) - 1): the same to
        # ~1e-6 and ~3x faster on the CPU, where tanh over [batch, vocab] was a step's largest op
        return torch.sigmoid(logits * (2.0 / cap)).mul_(2.0 * cap).sub_(cap)

    def attention_layers(self) -> list[PagedAttention]:
        """The layers that keep a KV cache: none in a bidirectional model (it attends without one)."""
        if not self.spec.causal:
            return []
        return [layer.self_attn.attn for layer in self.model.layers if isinstance(layer, LlamaDecoderLayer)]

    # checkpoint names -> parameters (``weight_loader``); a subclass may extend it
    weight_map = WeightMap(skip=ROTARY_BUFFERS, stacked=LLAMA_STACKED)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Copy this rank's part of each HF-named tensor; return the names of parameters loaded.

        Tensors of other stages are skipped unread; sharded layers read only their slice.
        """
        return load_weights(self, weights, self.weight_map, self._target)

    def _target(self, name: str) -> Optional[str]:
        """This model's parameter for checkpoint tensor ``name``, or None when it lives elsewhere."""
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


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama architecture with ``sliding_window`` on every layer (when set)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama architecture with biases on the Q/K/V projections (windows, when turned on,
    on the layers from ``max_window_layers`` on)."""

    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        return llama_spec(hf, layer_types=max_window_layer_types(hf), windows_on=False, qkv_bias=True,
                          o_proj_bias=bool(getattr(hf, "attention_bias", False)))

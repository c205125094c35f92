"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention and a routed MoE with shared experts.

Attention (MLA, ``services/worker/mla_attention.py``): the query comes from ``q_proj`` or, with
``q_lora_rank`` set, from ``q_b_proj(RMSNorm(q_a_proj(x)))``; ``kv_a_proj_with_mqa`` gives the
latent (``kv_lora_rank``, RMS-normed by ``kv_a_layernorm``) and one rope key shared by every head
(``qk_rope_head_dim``); only those two are cached. RoPE rotates the last ``qk_rope_head_dim`` of
each query head and the rope key, on interleaved pairs (V2; V3 unless ``rope_interleave`` is false).
The score scale is ``qk_head_dim ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` when
the RoPE is scaled and names ``mscale_all_dim`` (as transformers). The two norms inside attention
use eps 1e-6 whatever ``rms_norm_eps`` says (transformers builds them with the default). Decode
rows absorb ``kv_b_proj`` into the query and output (``MLAAttention.absorb``: split again after
every ``load_weights``); prefill chunks expand the latents.

Feed-forward: layer ``i`` is a dense SwiGLU below ``first_k_dense_replace``, else (when ``i %
moe_layer_freq == 0``, 1 by default) the MoE block: the router (``grouped_topk``: V2 softmax with
``greedy`` / ``group_limited_greedy``, V3 sigmoid + ``e_score_correction_bias`` with ``noaux_tc``),
``routed_scaling_factor`` on the weights, the routed experts in ``FusedMoE`` and
``n_shared_experts x moe_intermediate_size`` of shared expert on every token. transformers' V2 router
ignores ``norm_topk_prob`` (its V3 router honours it): so do we.

Tensor parallelism: query, ``kv_b_proj`` and ``o_proj`` split by heads, ``kv_a_proj_with_mqa`` and
``q_a_proj`` replicated (every rank caches the whole latent); the MoE as Qwen2-MoE's, one all-reduce
per block. Pipeline parallelism is ``LlamaModel``'s. Multi-token-prediction layers in a checkpoint
(indices from ``num_hidden_layers`` on, ``num_nextn_predict_layers``) are not loaded; the log names them.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch
from torch import nn

from gridserve.services.worker.attention import AttentionMetadata
from gridserve.services.worker.checkpoint import CheckpointTensor
from gridserve.services.worker.fused_moe import ExpertTensors, FusedMoE, grouped_topk
from gridserve.services.worker.layers import RMSNorm, RotaryEmbedding, rope_parameters
from gridserve.services.worker.mla_attention import MLAAttention
from gridserve.services.worker.models.hf_config import hf_config_of
from gridserve.services.worker.models.llama import (
    DecoderSpec,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    llama_spec,
)
from gridserve.services.worker.models.qwen_moe import QWEN_EXPERT_PARTS, SharedExpert
from gridserve.services.worker.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    add_prefix,
)
from gridserve.services.worker.parallel_state import ParallelState
from gridserve.services.worker.weight_loader import ROTARY_BUFFERS, WeightMap
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.parallel import Shard, even_shard

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' default, not rms_norm_eps


def softmax_scale(hf: Any) -> float:
    """``qk_head_dim ** -0.5``, with YaRN's ``mscale_all_dim`` correction squared (transformers')."""
    scale = (hf.qk_nope_head_dim + hf.qk_rope_head_dim) ** -0.5
    params = rope_parameters(hf)
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params["rope_type"] != "default" and mscale_all_dim:
        factor = float(params["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def _heads(count: Shard, width: int) -> Shard:
    """The columns of ``count`` heads of ``width`` each."""
    return Shard(count.start * width, count.size * width, count.total * width)


def _replicated(size: int) -> list[Shard]:
    return [Shard(0, size, size)]


class DeepseekMLA(nn.Module):
    """The projections around ``MLAAttention``; this rank's heads of the query, ``kv_b_proj`` and
    ``o_proj``, the whole latent."""

    def __init__(self, hf, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        heads = even_shard(hf.num_attention_heads, state.tp_size, state.tp_rank, "num_attention_heads")
        self.num_heads = heads.size
        self.nope, self.rope, self.v_dim = hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim
        self.kv_lora_rank = hf.kv_lora_rank
        qk_head_dim = self.nope + self.rope
        bias = bool(getattr(hf, "attention_bias", False))
        self.q_lora_rank = getattr(hf, "q_lora_rank", None)
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hf.hidden_size, [_heads(heads, qk_head_dim)], bias=False,
                                               prefix=add_prefix(prefix, "q_proj"))
        else:
            self.q_a_proj = ColumnParallelLinear(hf.hidden_size, _replicated(self.q_lora_rank), bias=bias,
                                                 prefix=add_prefix(prefix, "q_a_proj"))
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _MLA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, [_heads(heads, qk_head_dim)], bias=False,
                                                 prefix=add_prefix(prefix, "q_b_proj"))
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hf.hidden_size, _replicated(self.kv_lora_rank + self.rope),
                                                       bias=bias, prefix=add_prefix(prefix, "kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _MLA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, [_heads(heads, self.nope + self.v_dim)], bias=False,
                                              prefix=add_prefix(prefix, "kv_b_proj"))
        self.o_proj = RowParallelLinear(_heads(heads, self.v_dim), hf.hidden_size, bias=bias, state=state,
                                        prefix=add_prefix(prefix, "o_proj"))
        # set by the model: the RoPE every layer shares (over qk_rope_head_dim), and whether it runs in fp32
        self.rotary_emb: Optional[RotaryEmbedding] = None
        self.rope_in_fp32 = False
        self.attn = MLAAttention(self.num_heads, self.nope, self.rope, self.v_dim, self.kv_lora_rank,
                                 softmax_scale(hf))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope + self.rope)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split((self.kv_lora_rank, self.rope), dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = q[..., self.nope:].reshape(t, -1), k_pe.contiguous()
        if self.rope_in_fp32:  # V2 rotates as complex numbers in fp32 (transformers), V3 in the dtype
            q_pe, k_pe = q_pe.float(), k_pe.float()
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe, self.num_heads, 1)
        q_pe, k_pe = q_pe.to(x.dtype), k_pe.to(x.dtype)
        q = torch.cat((q[..., : self.nope], q_pe.view(t, self.num_heads, self.rope)), dim=-1)
        return self.o_proj(self.attn(q.reshape(t, -1), latent, k_pe, meta, self.kv_b_proj))


class DeepseekRouter(nn.Module):
    """The ``gate``: fp32 logits of every routed expert, then ``grouped_topk``. Replicated."""

    def __init__(self, hf: Any, experts: int, sigmoid: bool) -> None:
        super().__init__()
        self.top_k = hf.num_experts_per_tok
        self.sigmoid = sigmoid
        # transformers' V3 router always selects by groups (noaux_tc), whatever topk_method says
        method = "noaux_tc" if sigmoid else (getattr(hf, "topk_method", None) or "greedy")
        grouped = method in ("group_limited_greedy", "noaux_tc")
        self.n_group = int(getattr(hf, "n_group", None) or 1) if grouped else 1
        self.topk_group = int(getattr(hf, "topk_group", None) or 1) if grouped else 1
        _check_routing(hf, method, experts, self.top_k, self.n_group, self.topk_group)
        self.renormalize = sigmoid and bool(getattr(hf, "norm_topk_prob", False))  # V2's router ignores it
        self.scaling = float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0)
        self.weight = nn.Parameter(torch.empty(experts, hf.hidden_size))
        if sigmoid:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(experts), requires_grad=False)

    def keep_fp32(self) -> None:
        """Hold the weight and the correction bias in fp32 whatever the model's dtype (as transformers
        does): called before loading, so the checkpoint's values are not rounded to bf16 first."""
        for param in self.parameters():
            param.data = param.data.float()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(x.float(), self.weight.float())
        return grouped_topk(logits, self.top_k, scoring="sigmoid" if self.sigmoid else "softmax",
                            n_group=self.n_group, topk_group=self.topk_group,
                            group_score="top2_sum" if self.sigmoid else "max",
                            correction_bias=self.e_score_correction_bias if self.sigmoid else None,
                            renormalize=self.renormalize, scaling_factor=self.scaling)


def _check_routing(hf: Any, method: str, experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ConfigError("model.hf_config.topk_method",
                          f"unsupported {method!r}; supported: greedy, group_limited_greedy, noaux_tc")
    if n_group < 1 or experts % n_group or not 1 <= topk_group <= n_group:
        raise ConfigError("model.hf_config.n_group", f"n_group={n_group} must divide n_routed_experts={experts} "
                                                     f"and topk_group={topk_group} be in [1, n_group]")
    if not 1 <= top_k <= topk_group * (experts // n_group):
        raise ConfigError("model.hf_config.num_experts_per_tok",
                          f"must be in [1, {topk_group * (experts // n_group)}] (the experts of topk_group groups), "
                          f"got {top_k}")


class DeepseekMoE(nn.Module):
    """Router, routed experts and shared experts; one all-reduce of the sum (with TP)."""

    sigmoid_router = False

    def __init__(self, hf: Any, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ConfigError("model.hf_config.hidden_act", f"only silu is supported, got {hf.hidden_act!r}")
        experts = int(hf.n_routed_experts)
        self.state = state
        self.gate = DeepseekRouter(hf, experts, self.sigmoid_router)
        self.experts = FusedMoE(experts, hf.hidden_size, hf.moe_intermediate_size, state,
                                experts_field="model.hf_config.n_routed_experts")
        shared = hf.moe_intermediate_size * (getattr(hf, "n_shared_experts", None) or 0)
        if shared:
            self.shared_experts = SharedExpert(hf.hidden_size, shared, state, add_prefix(prefix, "shared_experts"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)
        out = self.experts(x, weights, expert_ids)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return self.state.all_reduce(out)


class DeepseekV3MoE(DeepseekMoE):
    sigmoid_router = True


def is_moe_layer(hf: Any, layer: int) -> bool:
    """Whether layer ``layer`` has the MoE block (else a dense MLP of ``intermediate_size``)."""
    freq = getattr(hf, "moe_layer_freq", 1) or 1
    return bool(getattr(hf, "n_routed_experts", None)) and layer >= (getattr(hf, "first_k_dense_replace", None) or 0) \
        and layer % freq == 0


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """Llama's residual stream and norms around MLA and the dense or MoE feed-forward block."""

    moe_class: type[DeepseekMoE] = DeepseekMoE

    def __init__(self, hf, spec: DecoderSpec, layer: int, rotary: Optional[RotaryEmbedding], state: ParallelState,
                 prefix: str = "") -> None:
        nn.Module.__init__(self)
        self.self_attn = DeepseekMLA(hf, state, add_prefix(prefix, "self_attn"))
        block = self.moe_class if is_moe_layer(hf, layer) else LlamaMLP
        self.mlp = block(hf, state, add_prefix(prefix, "mlp"))
        self.input_layernorm = RMSNorm(hf.hidden_size, spec.norm_eps)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, spec.norm_eps)
        self._norms = (self.input_layernorm, None, self.post_attention_layernorm, None)
        self.parallel_residual = False
        self.residual_multiplier = 1.0


class DeepseekV3DecoderLayer(DeepseekDecoderLayer):
    moe_class = DeepseekV3MoE


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 (and V2-Lite): MLA, softmax-routed MoE with shared experts."""

    layer_class: type[LlamaDecoderLayer] = DeepseekDecoderLayer
    rope_in_fp32 = True

    # q_proj is not merged (no Q/K/V of one width); only the dense and shared SwiGLUs' gate/up are
    weight_map = WeightMap(skip=ROTARY_BUFFERS, stacked=(("gate_proj", "gate_up_proj", 0),
                                                         ("up_proj", "gate_up_proj", 1)))

    def __init__(self, *, config: GridserveConfig, prefix: str = "") -> None:
        super().__init__(config=config, prefix=prefix)
        # one RoPE for every layer, over qk_rope_head_dim (LlamaModel's would span head_dim)
        hf = hf_config_of(config)
        rotary = RotaryEmbedding(hf.qk_rope_head_dim, hf.qk_rope_head_dim, hf.max_position_embeddings,
                                 rope_parameters(hf), self.spec.is_neox)
        for layer in self.model.layers:
            if isinstance(layer, DeepseekDecoderLayer):
                layer.self_attn.rotary_emb = rotary
                layer.self_attn.rope_in_fp32 = self.rope_in_fp32

    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        layers = hf.num_hidden_layers
        return llama_spec(hf, windows=(None,) * layers, rope=(None,) * layers, is_neox=not cls.interleaved_rope(hf))

    @classmethod
    def interleaved_rope(cls, hf: Any) -> bool:
        """Whether RoPE rotates interleaved pairs: always in V2."""
        return True

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Routed experts by ``ExpertTensors``, the rest by the Llama loader; MTP layers skipped."""
        for router in self.modules():
            if isinstance(router, DeepseekRouter):
                router.keep_fp32()
        experts = ExpertTensors(self, QWEN_EXPERT_PARTS, self._target)
        skipped: set[int] = set()
        loaded = super().load_weights(experts.others(self._without_mtp(weights, skipped)))
        for attention in self.modules():
            if isinstance(attention, MLAAttention):
                attention.weights_changed()  # W_uk / W_uv split again from the new kv_b_proj
        if skipped:
            logger.info("%s: not loading the multi-token-prediction layer(s) %s of the checkpoint "
                        "(speculative decoding with them is not supported)", type(self).__name__, sorted(skipped))
        return loaded | experts.loaded

    def _without_mtp(self, weights: Iterable[tuple[str, CheckpointTensor]],
                     skipped: set[int]) -> Iterator[tuple[str, CheckpointTensor]]:
        layers = len(self.model.layers)
        for name, tensor in weights:
            match = _LAYER.match(name)
            if match is not None and int(match.group(1)) >= layers:
                skipped.add(int(match.group(1)))
                continue
            yield name, tensor


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1: V2's architecture with the sigmoid ``noaux_tc`` router."""

    layer_class = DeepseekV3DecoderLayer
    rope_in_fp32 = False

    @classmethod
    def interleaved_rope(cls, hf: Any) -> bool:
        """V3's ``rope_interleave`` (absent: true; as transformers, an explicit null is false)."""
        return bool(getattr(hf, "rope_interleave", True))

"""Qwen2-MoE and Qwen3-MoE: the Llama decoder with a sparse mixture-of-experts block on most layers.

Layer ``i`` is sparse unless ``mlp_only_layers`` lists it, when ``(i + 1) % decoder_sparse_step == 0``;
the other layers have a dense SwiGLU MLP of ``intermediate_size``. A sparse block's router (a
replicated ``gate`` linear) takes the softmax in fp32, keeps the top ``num_experts_per_tok``
experts, renormalises their weights to sum to one when ``norm_topk_prob`` says so, and casts them to
the activations' dtype, as transformers' ``Qwen2MoeTopKRouter``; the experts (SwiGLUs of
``moe_intermediate_size``) run in the fused MoE layer (``services/worker/fused_moe.py``).

- Qwen2-MoE adds a shared expert on every token, a SwiGLU of ``shared_expert_intermediate_size``
  scaled by ``sigmoid(shared_expert_gate(x))``; Q/K/V have biases (``qkv_bias``), O none; windows,
  when ``use_sliding_window`` turns them on, on the layers ``layer_types`` marks (by default every
  second layer below ``max_window_layers``, as transformers' ``Qwen2MoeConfig``).
- Qwen3-MoE has no shared expert; each query and key head is RMS-normed before RoPE (Qwen3's);
  ``attention_bias`` on all four projections; a window, when turned on, on every layer.

With tensor parallelism the experts' intermediate dimension is split as Mixtral's, the shared expert
as a dense MLP (its down projection's partial sum not reduced on its own), the router and the
shared-expert gate replicated: one all-reduce per block. Pipeline parallelism is ``LlamaModel``'s.

Checkpoints name the experts one by one (``mlp.experts.J.gate_proj.weight``: the hub's and what
transformers 5 ``save_pretrained`` writes) or stacked (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]: transformers 5's in-memory layout); both load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from gridserve.kernels import silu_and_mul
from gridserve.services.worker.checkpoint import CheckpointTensor
from gridserve.services.worker.fused_moe import ExpertTensors, FusedMoE, route
from gridserve.services.worker.models.llama import (
    DecoderSpec,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    llama_spec,
)
from gridserve.services.worker.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    add_prefix,
)
from gridserve.services.worker.parallel_state import ParallelState
from gridserve.shared.errors import ConfigError
from gridserve.shared.parallel import even_shard

# one expert's matrices in a Qwen MoE checkpoint
QWEN_EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def num_experts(hf: Any) -> int:
    """The routed experts: ``num_experts`` (the hub's configs) or ``num_local_experts`` (what
    transformers 5 writes for Qwen3-MoE, its attribute map's target)."""
    count = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None)
    if not count or count < 1:
        raise ConfigError("model.hf_config.num_experts", f"must be a positive number of experts, got {count!r}")
    return int(count)


def sparse_layers(hf: Any) -> tuple[bool, ...]:
    """Per layer: whether it has the MoE block (else a dense MLP), as transformers decides."""
    step = getattr(hf, "decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ConfigError("model.hf_config.decoder_sparse_step", f"must be a positive integer, got {step!r}")
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(hf.num_hidden_layers))


def qwen2_moe_layer_types(hf: Any) -> tuple[str, ...]:
    """Qwen2-MoE's default layer types: a window on every second layer below ``max_window_layers``."""
    first = getattr(hf, "max_window_layers", 28)
    return tuple("sliding_attention" if i % 2 == 0 and i < first else "full_attention"
                 for i in range(hf.num_hidden_layers))


class PartialSumLinear(RowParallelLinear):
    """A row-parallel linear that leaves its partial sum unreduced: the block all-reduces once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU every token goes through; this rank's partial sum."""

    def __init__(self, hidden_size: int, intermediate_size: int, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        inter = even_shard(intermediate_size, state.tp_size, state.tp_rank, "shared_expert_intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [inter, inter], bias=False,
                                                 prefix=add_prefix(prefix, "gate_up_proj"))
        self.down_proj = PartialSumLinear(inter, hidden_size, bias=False, state=state,
                                          prefix=add_prefix(prefix, "down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class QwenMoeSparseBlock(nn.Module):
    """Router, top-k routed experts (and the shared expert, where the architecture has one), one
    all-reduce of the sum (with TP)."""

    has_shared_expert = False

    def __init__(self, hf: Any, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix  # the router stays float; the experts quantize as ``FusedMoE``
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ConfigError("model.hf_config.hidden_act", f"only silu is supported, got {hf.hidden_act!r}")
        experts, top_k = num_experts(hf), hf.num_experts_per_tok
        if not 1 <= top_k <= experts:
            raise ConfigError("model.hf_config.num_experts_per_tok", f"must be in [1, num_experts={experts}], got {top_k}")
        self.state = state
        self.top_k = top_k
        self.renormalize = bool(getattr(hf, "norm_topk_prob", False))
        self.gate = nn.Linear(hf.hidden_size, experts, bias=False)  # the router, replicated
        self.experts = FusedMoE(experts, hf.hidden_size, hf.moe_intermediate_size, state)
        if self.has_shared_expert:
            self.shared_expert = SharedExpert(hf.hidden_size, hf.shared_expert_intermediate_size, state,
                                              add_prefix(prefix, "shared_expert"))
            self.shared_expert_gate = nn.Linear(hf.hidden_size, 1, bias=False)  # replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights.to(x.dtype), expert_ids)
        if self.has_shared_expert:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.state.all_reduce(out)


class Qwen2MoeSparseBlock(QwenMoeSparseBlock):
    has_shared_expert = True


class _ChosenBelow(nn.Module):
    """Stands in for the feed-forward block until the layer, knowing its index, builds the real one."""

    def __init__(self, *args: Any) -> None:
        super().__init__()


class QwenMoeDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose feed-forward block is the sparse block or a dense MLP, by its index."""

    mlp_class = _ChosenBelow
    sparse_block: type[QwenMoeSparseBlock] = QwenMoeSparseBlock

    def __init__(self, hf, spec: DecoderSpec, layer: int, rotary, state: ParallelState, prefix: str = "") -> None:
        super().__init__(hf, spec, layer, rotary, state, prefix)
        block = self.sparse_block if sparse_layers(hf)[layer] else LlamaMLP
        self.mlp = block(hf, state, add_prefix(prefix, "mlp"))


class Qwen2MoeDecoderLayer(QwenMoeDecoderLayer):
    sparse_block = Qwen2MoeSparseBlock


class QwenMoeForCausalLM(LlamaForCausalLM):
    """What both Qwen MoE generations share: the layers above and the expert tensors' loading."""

    layer_class: type[LlamaDecoderLayer] = QwenMoeDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Expert tensors are loaded by ``ExpertTensors``, everything else (routers, shared experts,
        dense MLPs) by the Llama loader."""
        experts = ExpertTensors(self, QWEN_EXPERT_PARTS, self._target)
        loaded = super().load_weights(experts.others(weights))
        return loaded | experts.loaded


class Qwen2MoeForCausalLM(QwenMoeForCausalLM):
    """Qwen2-MoE (Qwen1.5-MoE): Qwen2 attention (Q/K/V biases) and sparse blocks with a shared expert."""

    layer_class = Qwen2MoeDecoderLayer

    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        return llama_spec(hf, layer_types=qwen2_moe_layer_types(hf), windows_on=False,
                          qkv_bias=bool(getattr(hf, "qkv_bias", True)), o_proj_bias=False)


class Qwen3MoeForCausalLM(QwenMoeForCausalLM):
    """Qwen3-MoE: Qwen3 attention (per-head Q/K RMSNorm) and sparse blocks without a shared expert."""

    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        return llama_spec(hf, windows_on=False, qk_norm="head")

"""Mixtral: the Llama decoder with a sparse mixture-of-experts block in place of the dense MLP.

Per token the router (a replicated ``gate`` linear) scores every expert; the softmax (in fp32)
keeps its top ``num_experts_per_tok`` experts, their weights renormalised to sum to one, exactly as
transformers' ``MixtralTopKRouter``. Each expert is a SwiGLU (``w1`` gate, ``w3`` up, ``w2`` down),
all of them run by the fused MoE layer (``services/worker/fused_moe.py``).

With tensor parallelism every expert's intermediate dimension is split like the dense MLP's
(``w1`` / ``w3`` rows, ``w2`` columns) and the block's partial sums are all-reduced once; the router
is replicated. Pipeline parallelism is ``LlamaModel``'s.

Checkpoints name the experts one by one (``block_sparse_moe.experts.J.w1.weight``: the hub's
Mixtral and what transformers 5 ``save_pretrained`` writes) or stacked (``mlp.experts.gate_up_proj``
[E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]: transformers 5's in-memory layout); both load.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from gridserve.services.worker.checkpoint import CheckpointTensor
from gridserve.services.worker.fused_moe import ExpertTensors, FusedMoE, route
from gridserve.services.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from gridserve.services.worker.parallel_state import ParallelState
from gridserve.shared.errors import ConfigError

# one expert's matrices in a Mixtral checkpoint
MIXTRAL_EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down"}


class MixtralSparseMoeBlock(nn.Module):
    """Router, top-k experts per token, one all-reduce of the weighted sum (with TP)."""

    def __init__(self, hf, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix  # the router stays float; the experts quantize as ``FusedMoE``
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ConfigError("model.hf_config.hidden_act", f"only silu is supported, got {hf.hidden_act!r}")
        experts, top_k = hf.num_local_experts, hf.num_experts_per_tok
        if not 1 <= top_k <= experts:
            raise ConfigError("model.hf_config.num_experts_per_tok",
                              f"must be in [1, num_local_experts={experts}], got {top_k}")
        self.state = state
        self.top_k = top_k
        self.gate = nn.Linear(hf.hidden_size, experts, bias=False)  # the router, replicated
        self.experts = FusedMoE(experts, hf.hidden_size, hf.intermediate_size, state, field="intermediate_size",
                                experts_field="model.hf_config.num_local_experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = route(self.gate(x), self.top_k)
        return self.state.all_reduce(self.experts(x, weights, expert_ids))


class MixtralDecoderLayer(LlamaDecoderLayer):
    mlp_class = MixtralSparseMoeBlock


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: Llama attention (GQA, RoPE) and a sparse MoE block per layer.

    A ``sliding_window`` applies to every layer, as Mistral's does (``llama_spec``): masked in
    every attention path, the KV cache keeping every token (said at start).
    """

    layer_class = MixtralDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Expert tensors are loaded by ``ExpertTensors``, everything else (router included) by the Llama loader."""
        experts = ExpertTensors(self, MIXTRAL_EXPERT_PARTS, self._target)
        renamed = ((name.replace(".block_sparse_moe.", ".mlp."), tensor) for name, tensor in weights)
        loaded = super().load_weights(experts.others(renamed))
        return loaded | experts.loaded

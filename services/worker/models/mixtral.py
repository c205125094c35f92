"""Mixtral: the Llama decoder with a sparse mixture-of-experts block in place of the dense MLP.

Per token the router (a replicated ``gate`` linear) scores every expert; the softmax (in fp32)
keeps its top ``num_experts_per_tok`` experts, their weights renormalised to sum to one, exactly as
transformers' ``MixtralTopKRouter``. Each expert is a SwiGLU (``w1`` gate, ``w3`` up, ``w2`` down).
The experts run grouped: the (token, expert) assignments are sorted by expert, each expert runs one
GEMM pair over the tokens routed to it, and the weighted results are added back per token.

With tensor parallelism every expert's intermediate dimension is split like the dense MLP's
(``w1`` / ``w3`` rows, ``w2`` columns) and the block's partial sums are all-reduced once; the router
is replicated. Pipeline parallelism is ``LlamaModel``'s.

Checkpoints name the experts one by one (``block_sparse_moe.experts.J.w1.weight``: the hub's
Mixtral and what transformers 5 ``save_pretrained`` writes) or stacked (``mlp.experts.gate_up_proj``
[E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]: transformers 5's in-memory layout); both load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gridserve.kernels import silu_and_mul
from gridserve.services.worker.checkpoint import CheckpointTensor
from gridserve.services.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from gridserve.services.worker.parallel_state import ParallelState
from gridserve.shared.errors import ConfigError
from gridserve.shared.parallel import even_shard

# Expert weights after ``block_sparse_moe.`` -> ``mlp.``: one expert's w1/w2/w3, or a stacked tensor.
_EXPERTS = re.compile(
    r"^(?P<module>model\.layers\.\d+\.mlp\.experts)\."
    r"(?:(?P<expert>\d+)\.(?P<proj>w[123])\.weight|(?P<stacked>gate_up_proj|down_proj))$"
)


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, expert_ids)``, each ``[tokens, top_k]``: fp32 softmax, top-k, renormalised to sum 1."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), expert_ids


class MixtralExperts(nn.Module):
    """Every expert's SwiGLU, stacked: ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and
    ``down_proj`` [E, H, I], where ``I`` is this rank's shard of ``intermediate_size``.

    ``forward`` returns this rank's partial sum (the block all-reduces it).
    """

    def __init__(self, hf, state: ParallelState) -> None:
        super().__init__()
        self.num_experts = hf.num_local_experts
        self.shard = even_shard(hf.intermediate_size, state.tp_size, state.tp_rank, "intermediate_size")
        inter = self.shard.size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * inter, hf.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, hf.hidden_size, inter))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """``sum_k weights[t, k] * expert[expert_ids[t, k]](x[t])`` for every token ``t``."""
        top_k = expert_ids.shape[1]
        flat = expert_ids.flatten()
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, ascending
        tokens = order // top_k
        gates = weights.flatten()[order].unsqueeze(-1)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        for expert, (rows, gate) in enumerate(zip(tokens.split(counts), gates.split(counts))):
            if rows.numel() == 0:
                continue
            h = silu_and_mul(F.linear(x[rows], self.gate_up_proj[expert]))
            out.index_add_(0, rows, (F.linear(h, self.down_proj[expert]) * gate).to(out.dtype))
        return out

    def load_expert(self, expert: int, proj: str, tensor: CheckpointTensor) -> str:
        """This rank's slice of one expert's ``w1`` (gate), ``w3`` (up) or ``w2`` (down).

        Returns the name of the parameter it went into.
        """
        s = self.shard
        if proj == "w2":
            self.down_proj.data[expert].copy_(tensor.cols(s.start, s.end))
            return "down_proj"
        offset = 0 if proj == "w1" else s.size
        self.gate_up_proj.data[expert, offset : offset + s.size].copy_(tensor.rows(s.start, s.end))
        return "gate_up_proj"

    def load_stacked(self, param: str, tensor: CheckpointTensor) -> str:
        """This rank's slice of a stacked ``gate_up_proj`` or ``down_proj``; returns ``param``."""
        s = self.shard
        if param == "down_proj":
            self.down_proj.data.copy_(tensor.narrow(2, s.start, s.end))
        else:
            self.gate_up_proj.data[:, : s.size].copy_(tensor.narrow(1, s.start, s.end))
            self.gate_up_proj.data[:, s.size :].copy_(tensor.narrow(1, s.total + s.start, s.total + s.end))
        return param


class MixtralSparseMoeBlock(nn.Module):
    """Router, top-k experts per token, one all-reduce of the weighted sum (with TP)."""

    def __init__(self, hf, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix  # experts and router stay unquantized (grouped GEMMs, not linear layers)
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ConfigError("model.hf_config.hidden_act", f"only silu is supported, got {hf.hidden_act!r}")
        experts, top_k = hf.num_local_experts, hf.num_experts_per_tok
        if not 1 <= top_k <= experts:
            raise ConfigError("model.hf_config.num_experts_per_tok",
                              f"must be in [1, num_local_experts={experts}], got {top_k}")
        self.state = state
        self.top_k = top_k
        self.gate = nn.Linear(hf.hidden_size, experts, bias=False)  # the router, replicated
        self.experts = MixtralExperts(hf, state)

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
        """Expert tensors are loaded here, everything else (router included) by the Llama loader."""
        experts_loaded: set[str] = set()

        def dense(named: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
            for name, tensor in named:
                name = name.replace(".block_sparse_moe.", ".mlp.")
                match = _EXPERTS.match(name)
                if match is None:
                    yield name, tensor
                elif self._target(name) is not None:  # a layer of this pipeline stage
                    experts_loaded.add(self._load_experts(match, tensor))

        loaded = super().load_weights(dense(weights))
        return loaded | experts_loaded

    def _load_experts(self, match: re.Match, tensor: CheckpointTensor) -> str:
        module = match["module"]
        experts: MixtralExperts = self.get_submodule(module)
        if match["stacked"]:
            return f"{module}.{experts.load_stacked(match['stacked'], tensor)}"
        return f"{module}.{experts.load_expert(int(match['expert']), match['proj'], tensor)}"

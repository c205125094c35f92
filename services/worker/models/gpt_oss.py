"""gpt-oss: the Llama decoder with attention sinks, alternating window / full layers and a biased MoE.

As transformers' ``GptOss*`` classes compute it:

- attention: Q/K/V/O with biases (``attention_bias``), GQA, YaRN RoPE on each head's two halves
  (``rope_parameters``, cos and sin scaled by YaRN's attention factor), and a learned sink logit per
  head in every softmax's denominator (``SinkAttention``, ``services/worker/sink_attention.py``);
  ``sliding_window`` on the layers ``layer_types`` marks (by default every even layer), full
  attention on the others: the engine plans a window KV cache group and a full one.
- MoE on every layer: the router is a linear with a bias; its top ``num_experts_per_tok`` logits are
  kept and softmaxed among themselves (``topk_softmax``). Each expert is a clamped SwiGLU with biases:
  ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
  ``(up + 1) * gate * sigmoid(alpha * gate)`` (``swiglu_limit``, ``swiglu_alpha``), run by the
  fused MoE layer.

Checkpoints hold the experts stacked as transformers writes them (``mlp.experts.gate_up_proj``
[E, H, 2I] with gate and up in alternate columns, ``down_proj`` [E, I, H], and their ``_bias``);
MXFP4-quantized checkpoints (``quantization_config`` with ``quant_method: mxfp4``) are refused.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from gridserve.services.worker.checkpoint import CheckpointTensor
from gridserve.services.worker.fused_moe import FusedMoE, InterleavedExpertTensors, topk_softmax
from gridserve.services.worker.models.llama import (
    DecoderSpec,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    llama_spec,
)
from gridserve.services.worker.parallel_layers import add_prefix
from gridserve.services.worker.parallel_state import ParallelState
from gridserve.services.worker.sink_attention import SinkAttention
from gridserve.services.worker.weight_loader import LLAMA_STACKED, ROTARY_BUFFERS, WeightMap
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.parallel import even_shard


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's expert activation over ``[rows, 2I]`` (gate columns, then up columns)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssAttention(LlamaAttention):
    """Llama's attention with ``SinkAttention`` in place of ``PagedAttention`` (this rank's heads' sinks)."""

    def __init__(self, hf, spec: DecoderSpec, layer: int, rotary, state: ParallelState, prefix: str = "") -> None:
        super().__init__(hf, spec, layer, rotary, state, prefix)
        heads = even_shard(hf.num_attention_heads, state.tp_size, state.tp_rank, "num_attention_heads")
        self.attn = SinkAttention(self.num_heads, self.head_dim, self.num_kv_heads, self.attn.scale, heads,
                                  sliding_window=spec.windows[layer])


class GptOssMoE(nn.Module):
    """The biased router, the experts (this rank's share of each), one all-reduce (with TP)."""

    def __init__(self, hf, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix  # the router stays float; the experts quantize as ``FusedMoE``
        experts, top_k = hf.num_local_experts, hf.num_experts_per_tok
        if not 1 <= top_k <= experts:
            raise ConfigError("model.hf_config.num_experts_per_tok",
                              f"must be in [1, num_local_experts={experts}], got {top_k}")
        self.state = state
        self.top_k = top_k
        activation = functools.partial(clamped_swiglu, limit=float(getattr(hf, "swiglu_limit", 7.0)),
                                       alpha=float(getattr(hf, "swiglu_alpha", 1.702)))
        self.router = nn.Linear(hf.hidden_size, experts, bias=True)  # replicated
        self.experts = FusedMoE(experts, hf.hidden_size, hf.intermediate_size, state, field="intermediate_size",
                                bias=True, activation=activation,
                                experts_field="model.hf_config.num_local_experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = topk_softmax(self.router(x), self.top_k)
        return self.state.all_reduce(self.experts(x, weights, expert_ids))


class GptOssDecoderLayer(LlamaDecoderLayer):
    mlp_class = GptOssMoE

    def __init__(self, hf, spec: DecoderSpec, layer: int, rotary, state: ParallelState, prefix: str = "") -> None:
        super().__init__(hf, spec, layer, rotary, state, prefix)
        # Llama's attention (built by the base class, on the meta device) replaced by the one with sinks
        self.self_attn = GptOssAttention(hf, spec, layer, rotary, state, add_prefix(prefix, "self_attn"))


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss (``openai/gpt-oss-20b`` / ``-120b`` in bf16): see the module docstring."""

    layer_class = GptOssDecoderLayer
    weight_map = WeightMap(skip=ROTARY_BUFFERS, stacked=LLAMA_STACKED,
                           rename=((r"\.self_attn\.sinks$", ".self_attn.attn.sinks"),))

    def __init__(self, *, config: GridserveConfig, prefix: str = "") -> None:
        _refuse_mxfp4(config.model.hf_config)
        super().__init__(config=config, prefix=prefix)

    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        layer_types = tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(hf.num_hidden_layers))
        return llama_spec(hf, layer_types=layer_types, default_theta=150000.0,
                          qkv_bias=bool(getattr(hf, "attention_bias", True)),
                          o_proj_bias=bool(getattr(hf, "attention_bias", True)),
                          norm_eps=getattr(hf, "rms_norm_eps", 1e-5))

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """The experts' stacked tensors by ``InterleavedExpertTensors``, the rest by the Llama loader."""
        experts = InterleavedExpertTensors(self, self._target)
        return super().load_weights(experts.others(weights)) | experts.loaded


def _refuse_mxfp4(hf_config: dict) -> None:
    """An MXFP4 checkpoint (the hub's gpt-oss default) holds packed expert blocks this model cannot read."""
    quant = hf_config.get("quantization_config") or {}
    if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":
        raise ConfigError("model.hf_config.quantization_config",
                          "MXFP4-quantized gpt-oss checkpoints are not supported (quant_method 'mxfp4'); "
                          "use a bf16 checkpoint")

"""Llama-family decoder (Llama, Mistral, Qwen2): RMSNorm, RoPE, GQA, SwiGLU, paged attention.

Q/K/V and gate/up projections are merged into one GEMM each; ``load_weights`` maps the
Hugging Face parameter names onto the merged layout.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from gridserve.kernels import silu_and_mul
from gridserve.services.worker.attention import AttentionMetadata, PagedAttention
from gridserve.services.worker.layers import RMSNorm, RotaryEmbedding, rope_parameters
from gridserve.services.worker.models.hf_config import hf_config_of
from gridserve.shared.config import GridserveConfig

# HF name fragment -> (merged parameter, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, hf, qkv_bias: bool) -> None:
        super().__init__()
        self.num_heads = hf.num_attention_heads
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(hf.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hf.hidden_size, bias=getattr(hf, "attention_bias", False))
        self.shard_sizes = (self.q_size, self.kv_size, self.kv_size)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, self.head_dim, hf.max_position_embeddings, rope_parameters(hf)
        )
        self.attn = PagedAttention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.shard_sizes, dim=-1)
        q, k = self.rotary_emb(positions, q, k, self.num_heads, self.num_kv_heads)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, hf) -> None:
        super().__init__()
        bias = getattr(hf, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(hf.hidden_size, 2 * hf.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(hf.intermediate_size, hf.hidden_size, bias=bias)
        self.shard_sizes = (hf.intermediate_size, hf.intermediate_size)
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"model.hf_config.hidden_act: only silu is supported, got {hf.hidden_act!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf, qkv_bias: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hf, qkv_bias)
        self.mlp = LlamaMLP(hf)
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


class LlamaModel(nn.Module):
    def __init__(self, hf, qkv_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(hf.vocab_size, hf.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(hf, qkv_bias) for _ in range(hf.num_hidden_layers))
        self.norm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral decoder with an LM head (tied to the embedding when the config says so)."""

    qkv_bias = False

    def __init__(self, *, config: GridserveConfig, prefix: str = "") -> None:
        super().__init__()
        hf = hf_config_of(config)
        self.prefix = prefix
        self.model = LlamaModel(hf, self.qkv_bias or getattr(hf, "attention_bias", False))
        self.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(hf.hidden_size, hf.vocab_size, bias=False)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into this model; return the names of parameters loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            target, shard = _stacked_target(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[target]
            if shard is None:
                param.data.copy_(tensor)
            else:
                module = self.get_submodule(target.rsplit(".", 2)[0])
                sizes = module.shard_sizes
                offset = sum(sizes[:shard])
                param.data.narrow(0, offset, sizes[shard]).copy_(tensor)
            loaded.add(target)
        return loaded


def _stacked_target(name: str) -> tuple[str, int | None]:
    for fragment, (merged, shard) in _STACKED.items():
        if f".{fragment}." in name:
            return name.replace(fragment, merged), shard
    return name, None


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama architecture (sliding-window attention is not used at these lengths)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama architecture with biases on the Q/K/V projections."""

    qkv_bias = True

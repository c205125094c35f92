"""CLIP's vision transformer, as a vision-language model's image encoder (Llava's vision tower).

Patch embedding (a strided convolution), a CLS token and learned positions, a pre-norm, then
pre-norm encoder layers (full attention over the image's patches, a quick-GELU MLP). Only the
layers up to the one whose output the language model reads (``vision_feature_layer``) are built
and loaded. With tensor parallelism the attention heads and the MLP are split like the language
model's (column-parallel Q/K/V and ``fc1``, row-parallel ``out_proj`` and ``fc2``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from gridserve.services.worker.checkpoint import CheckpointTensor
from gridserve.services.worker.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    add_prefix,
)
from gridserve.services.worker.parallel_state import ParallelState
from gridserve.services.worker.weight_loader import LLAMA_STACKED, WeightMap, load_weights
from gridserve.shared.errors import ConfigError
from gridserve.shared.parallel import Shard, even_shard

_WEIGHT_MAP = WeightMap(rename=((r"encoder\.layers\.", "layers."),), stacked=LLAMA_STACKED[:3])
_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str, field: str):
    if name not in _ACTIVATIONS:
        raise ConfigError(field, f"unsupported activation {name!r}; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class CLIPAttention(nn.Module):
    """Full (non-causal) multi-head attention over one image's tokens; heads split across TP ranks."""

    def __init__(self, hf, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        heads = even_shard(hf.num_attention_heads, state.tp_size, state.tp_rank, "vision_config.num_attention_heads")
        self.head_dim = hf.hidden_size // hf.num_attention_heads
        self.num_heads = heads.size
        d = self.head_dim
        shard = Shard(heads.start * d, heads.size * d, heads.total * d)
        self.qkv_proj = ColumnParallelLinear(hf.hidden_size, [shard] * 3, bias=True,
                                             prefix=add_prefix(prefix, "qkv_proj"))
        self.out_proj = RowParallelLinear(shard, hf.hidden_size, bias=True, state=state,
                                          prefix=add_prefix(prefix, "out_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (t.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class CLIPMLP(nn.Module):
    def __init__(self, hf, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        inter = even_shard(hf.intermediate_size, state.tp_size, state.tp_rank, "vision_config.intermediate_size")
        self.act = activation(getattr(hf, "hidden_act", "quick_gelu"), "model.hf_config.vision_config.hidden_act")
        self.fc1 = ColumnParallelLinear(hf.hidden_size, [inter], bias=True, prefix=add_prefix(prefix, "fc1"))
        self.fc2 = RowParallelLinear(inter, hf.hidden_size, bias=True, state=state, prefix=add_prefix(prefix, "fc2"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, hf, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        eps = getattr(hf, "layer_norm_eps", 1e-5)
        self.layer_norm1 = nn.LayerNorm(hf.hidden_size, eps=eps)
        self.self_attn = CLIPAttention(hf, state, add_prefix(prefix, "self_attn"))
        self.layer_norm2 = nn.LayerNorm(hf.hidden_size, eps=eps)
        self.mlp = CLIPMLP(hf, state, add_prefix(prefix, "mlp"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, hf) -> None:
        super().__init__()
        self.patch_size = hf.patch_size
        self.class_embedding = nn.Parameter(torch.empty(hf.hidden_size))
        self.patch_embedding = nn.Conv2d(getattr(hf, "num_channels", 3), hf.hidden_size, hf.patch_size,
                                         stride=hf.patch_size, bias=False)
        self.num_positions = (hf.image_size // hf.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(self.num_positions, hf.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # [images, patches, hidden]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1)
        if x.shape[1] != self.num_positions:
            raise ValueError(f"an image of {x.shape[1] - 1} patches; the vision tower takes {self.num_positions - 1}")
        return x + self.position_embedding.weight


class CLIPVisionModel(nn.Module):
    """The vision tower up to ``feature_layer`` (``hidden_states[feature_layer]`` of transformers:
    0 is the pre-normed embeddings, ``-1`` the last layer's output; ``post_layernorm`` is unused)."""

    def __init__(self, hf, feature_layer: int, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        if not isinstance(feature_layer, int):
            raise ConfigError("model.hf_config.vision_feature_layer",
                              f"only a single layer is supported, got {feature_layer!r}")
        depth = feature_layer if feature_layer >= 0 else hf.num_hidden_layers + 1 + feature_layer
        if not 0 <= depth <= hf.num_hidden_layers:
            raise ConfigError("model.hf_config.vision_feature_layer",
                              f"{feature_layer} is outside the tower's {hf.num_hidden_layers} layers")
        self.prefix = prefix
        self.embeddings = CLIPVisionEmbeddings(hf)
        self.pre_layrnorm = nn.LayerNorm(hf.hidden_size, eps=getattr(hf, "layer_norm_eps", 1e-5))
        self.layers = nn.ModuleList(CLIPEncoderLayer(hf, state, add_prefix(prefix, f"encoder.layers.{i}"))
                                    for i in range(depth))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.layers:
            x = layer(x)
        return x

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Tensors named as in ``CLIPVisionModel`` without ``vision_model.``; layers past the
        feature layer and ``post_layernorm`` are skipped unread."""
        params = {name for name, _ in self.named_parameters()}
        return load_weights(self, weights, _WEIGHT_MAP, lambda name: name if name in params else None)

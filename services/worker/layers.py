"""Small building blocks shared by the model implementations."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gridserve.kernels import fused_add_rms_norm, rms_norm, rotary_embedding
from gridserve.shared.errors import ConfigError


class RMSNorm(nn.Module):
    """RMSNorm whose ``forward(x, residual)`` also adds the residual in the same pass."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


def rope_parameters(hf: Any) -> dict:
    """The RoPE settings of an HF config, whether in transformers 5's or 4's spelling."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a cos/sin table built lazily on the positions' device.

    Supports the ``default``, ``linear`` and ``llama3`` rope types.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, params: dict, is_neox: bool = True):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.is_neox = is_neox
        self.inv_freq = _inv_freq(rotary_dim, params)
        self._cache: torch.Tensor | None = None

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        if self._cache is None or self._cache.device != device:
            t = torch.arange(self.max_position, dtype=torch.int64, device="cpu").float()
            freqs = torch.outer(t, self.inv_freq)
            self._cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
        return self._cache

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, num_heads: int, num_kv_heads: int):
        t = q.shape[0]
        q, k = rotary_embedding(
            positions, q.view(t, num_heads, -1), k.view(t, num_kv_heads, -1),
            self.cos_sin_cache(q.device), self.is_neox,
        )
        return q.reshape(t, -1), k.reshape(t, -1)


def _inv_freq(dim: int, params: dict) -> torch.Tensor:
    base = float(params.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    kind = params.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    raise ConfigError("model.hf_config.rope_parameters.rope_type", f"unsupported rope type {kind!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)

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


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint holds ``w`` (initialised to 0) and the layer scales by ``1 + w``.

    As transformers computes it: normalised and scaled in float32, then cast (``(x * (1 + w)).to``),
    so a 16-bit model rounds once, after the scale. A float32 model takes the kernels' path.
    ``1 + w`` (float32) is computed once and kept until the weight changes (a load or a weight
    sync writes it in place, which bumps its version; sleep and wake give it new storage); a weight
    made under ``torch.inference_mode`` has no version to watch and is read on every call.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self._scale: torch.Tensor | None = None
        self._scale_of: tuple[int, int] | None = None

    def scale(self) -> torch.Tensor:
        """``1 + w`` in float32, recomputed only when ``weight`` was written or replaced."""
        weight = self.weight
        key = (weight.data_ptr(), -1 if weight.is_inference() else weight._version)
        if self._scale is None or key != self._scale_of or key[1] < 0:
            self._scale = weight.detach().float() + 1.0
            self._scale_of = key
        return self._scale

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.dtype == torch.float32:
            if residual is None:
                return rms_norm(x, self.scale(), self.eps)
            return fused_add_rms_norm(x, residual, self.scale(), self.eps)
        if residual is not None:
            residual = x + residual
            x = residual
        h = x.float()
        out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale()).to(x.dtype)
        return out if residual is None else (out, residual)


class BiasFreeLayerNorm(nn.Module):
    """LayerNorm with a weight and no bias (Cohere), in float32 as transformers computes it.

    ``shape`` may be ``(heads, head_dim)``: one weight row per head, each head normalised over its
    own ``head_dim`` (Cohere's Q/K norms). ``forward(x, residual)`` adds the residual first and
    returns ``(normed, residual)``, like ``RMSNorm``.
    """

    def __init__(self, shape: int | tuple[int, ...], eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            residual = x + residual
            x = residual
        h = x.float()
        centred = h - h.mean(-1, keepdim=True)
        normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.weight.float() * normed).to(x.dtype)
        return out if residual is None else (out, residual)


# RoPE types whose ``original_max_position_embeddings`` transformers fills in (``standardize_rope_params``).
_SCALED_ROPE = ("llama3", "yarn", "longrope")
# The per-layer-type keys of a nested ``rope_parameters`` (Gemma 3).
ROPE_LAYER_TYPES = ("full_attention", "sliding_attention")


def rope_parameters(hf: Any, layer_type: str | None = None, default_theta: float = 10000.0) -> dict:
    """The RoPE settings of an HF config, whether in transformers 5's or 4's spelling.

    ``layer_type`` picks one entry of a ``rope_parameters`` nested by layer type (Gemma 3's
    ``{"sliding_attention": {...}, "full_attention": {...}}``). ``default_theta`` is the base when
    the config names none (the architecture's own default). A top-level ``partial_rotary_factor``
    and ``original_max_position_embeddings`` are folded in as transformers does.
    """
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if any(isinstance(params.get(key), dict) for key in ROPE_LAYER_TYPES):
        params = dict(params.get(layer_type or "full_attention") or {})
    if not params:
        params = dict(getattr(hf, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf, "rope_theta", None) or default_theta)
    params.setdefault("rope_type", params.pop("type", "default"))
    if getattr(hf, "partial_rotary_factor", None) is not None:
        params.setdefault("partial_rotary_factor", hf.partial_rotary_factor)
    if params["rope_type"] in _SCALED_ROPE:
        original = getattr(hf, "original_max_position_embeddings", None)
        if original:
            params["original_max_position_embeddings"] = original
        else:
            params.setdefault("original_max_position_embeddings", getattr(hf, "max_position_embeddings", None))
    return params


def rotary_dim(head_size: int, params: dict) -> int:
    """How many leading dimensions of each head RoPE rotates (``partial_rotary_factor``)."""
    return int(head_size * float(params.get("partial_rotary_factor", 1.0)))


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a cos/sin table built lazily on the positions' device.

    Supports the ``default``, ``linear``, ``llama3``, ``yarn`` and ``longrope`` rope types (as
    transformers' ``modeling_rope_utils`` computes them). ``yarn`` and ``longrope`` also scale cos
    and sin by their attention factor. ``longrope`` rotates positions below
    ``original_max_position_embeddings`` by the short factors and the rest by the long ones: a
    position's rotation depends on the position alone (transformers' model switches all of a forward
    pass to the long factors once the sequence outgrows the original length; Phi-3's module says more).
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, params: dict, is_neox: bool = True):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.is_neox = is_neox
        self.inv_freq = _inv_freq(rotary_dim, params, max_position)
        self.long_inv_freq, self.long_from = _long_inv_freq(rotary_dim, params, max_position)
        self.attention_factor = _attention_factor(params, max_position)
        self._cache: torch.Tensor | None = None

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        if self._cache is None or self._cache.device != device:
            t = torch.arange(self.max_position, dtype=torch.int64, device="cpu").float()
            freqs = torch.outer(t, self.inv_freq)
            if self.long_inv_freq is not None:
                freqs[self.long_from :] = torch.outer(t[self.long_from :], self.long_inv_freq)
            cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
            self._cache = (cache * self.attention_factor if self.attention_factor != 1.0 else cache).to(device)
        return self._cache

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, num_heads: int, num_kv_heads: int):
        t = q.shape[0]
        q, k = rotary_embedding(
            positions, q.view(t, num_heads, -1), k.view(t, num_kv_heads, -1),
            self.cos_sin_cache(q.device), self.is_neox,
        )
        return q.reshape(t, -1), k.reshape(t, -1)


def _inv_freq(dim: int, params: dict, max_position: int | None = None) -> torch.Tensor:
    base = float(params.get("rope_theta", 10000.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (base**exponents)
    kind = params.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    if kind == "yarn":
        return _yarn_inv_freq(base**exponents, dim, params, max_position)
    if kind == "longrope":
        return 1.0 / (_factors(params, "short_factor", dim) * base**exponents)
    raise ConfigError("model.hf_config.rope_parameters.rope_type",
                      f"unsupported rope type {kind!r}; supported: default, linear, llama3, yarn, longrope")


def _long_inv_freq(dim: int, params: dict, max_position: int) -> tuple[torch.Tensor | None, int]:
    """longrope's frequencies for positions from ``original_max_position_embeddings`` on; else (None, max)."""
    if params.get("rope_type") != "longrope":
        return None, max_position
    base = float(params.get("rope_theta", 10000.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    original = int(params["original_max_position_embeddings"])
    return 1.0 / (_factors(params, "long_factor", dim) * base**exponents), min(original, max_position)


def _factors(params: dict, key: str, dim: int) -> torch.Tensor:
    factors = params.get(key)
    if not isinstance(factors, (list, tuple)) or len(factors) != dim // 2:
        raise ConfigError(f"model.hf_config.rope_parameters.{key}",
                          f"must be a list of {dim // 2} numbers (rotary dim / 2), got {factors!r}")
    return torch.tensor([float(f) for f in factors], dtype=torch.float32, device="cpu")


def _scaling_factor(params: dict, max_position: int | None) -> float:
    """``factor``, or (as transformers) ``max_position_embeddings / original_max_position_embeddings``."""
    factor = params.get("factor")
    if factor is None:
        factor = (max_position or 0) / float(params["original_max_position_embeddings"])
    return float(factor)


def _attention_factor(params: dict, max_position: int) -> float:
    """The factor yarn and longrope apply to cos and sin (1.0 for the other types)."""
    kind = params.get("rope_type")
    if kind not in ("yarn", "longrope"):
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _scaling_factor(params, max_position)
    if kind == "longrope":
        original = float(params["original_max_position_embeddings"])
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(wavelengths: torch.Tensor, dim: int, p: dict, max_position: int | None) -> torch.Tensor:
    """YaRN: interpolated (``/ factor``) low frequencies, extrapolated high ones, a linear ramp between.
    ``wavelengths`` are ``base ** (2i / dim)``."""
    base, factor = float(p.get("rope_theta", 10000.0)), _scaling_factor(p, max_position)
    original = float(p["original_max_position_embeddings"])
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolated_share = 1 - ramp
    interpolated, extrapolated = 1.0 / (factor * wavelengths), 1.0 / wavelengths
    return interpolated * (1 - extrapolated_share) + extrapolated * extrapolated_share


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

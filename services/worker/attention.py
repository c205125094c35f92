"""Paged attention as a model layer. The metadata that describes one step's batch
(``AttentionMetadata``) and the backends that do the work (``AttentionBackend``: torch reference,
C++ CPU, Triton) are the kernels' (``gridserve.kernels.attention_backend``).

Score modifiers follow Hugging Face transformers exactly (``gridserve.kernels.reference``):
``sliding_window`` (query ``i`` sees key ``j`` iff ``j <= i`` and ``i - j < sliding_window``; in a
non-causal layer iff ``|i - j| < sliding_window``),
``logits_soft_cap`` (``s = cap * tanh(s / cap)`` on the scaled scores, Gemma 2) and
``alibi_slopes`` (``s += slope[head] * (j - i)``, not scaled: Bloom; Falcon passes
``alibi_slopes(n) * scale``). Under tensor parallelism each rank passes the slopes of its own query
heads: ``alibi_slopes(total_heads)[shard.start:shard.end]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gridserve.kernels.attention_backend import AttentionMetadata, select_attention_backend
from gridserve.kernels.reference import alibi_slopes, attend_positions, query_chunks, score_mods
from gridserve.shared.kv_cache_spec import FULL, SLIDING_WINDOW, LayerKVCacheSpec

__all__ = ["AttentionMetadata", "PagedAttention", "alibi_slopes"]


class PagedAttention(nn.Module):
    """Writes the step's K/V into this layer's cache blocks, then attends over each sequence's blocks.

    ``kv_cache`` is bound by the model runner once the cache is allocated; before that (the memory
    profiling run) every sequence is treated as a fresh prefill with no history. The cache may be
    narrower than the activations (``kv_cache_dtype``); an fp8 cache stores ``K / k_scale`` and
    ``V / v_scale`` with per-tensor scales (1.0 unless set, as vLLM does without calibration).

    ``sliding_window`` (None = full causal), ``logits_soft_cap`` (None = none) and ``alibi_slopes``
    ([num_heads] of this rank, None = none) modify the scores as the module docstring says. The
    slopes are kept in float32 on the CPU (a plain attribute, so neither the meta-device build nor
    ``model.to(dtype)`` touches them) and copied once to each device that attends.

    ``causal=False`` (an encoder: BERT, XLM-R; a decoder embedder with bidirectional attention:
    EmbeddingGemma) lets every token of a sequence see every other one, or those less than
    ``sliding_window`` away on either side. Such a layer keeps no KV cache: it attends on the
    no-cache path only, each packed sequence whole (``query_start_loc``, no padding). It takes a
    window and a soft cap, not ALiBi (whose sign ahead of the query no model here defines).
    """

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float, *,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 alibi_slopes: torch.Tensor | None = None, causal: bool = True) -> None:
        super().__init__()
        if not causal and alibi_slopes is not None:
            raise ValueError("PagedAttention: non-causal attention takes no ALiBi slopes")
        self.causal = causal
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = _positive(sliding_window, "sliding_window", int)
        self.logits_soft_cap = _positive(logits_soft_cap, "logits_soft_cap", float)
        self.alibi_slopes = _slopes(alibi_slopes, num_heads)
        self._device_slopes: torch.Tensor | None = None
        self.kv_cache = torch.empty(0)
        self.kv_cache_group = 0  # which block table this layer reads (set with ``kv_cache``)
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.batch_invariant = False  # every row through one per-token kernel (``batch_invariant.enable``)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_size)
        k = k.view(-1, self.num_kv_heads, self.head_size)
        v = v.view(-1, self.num_kv_heads, self.head_size)
        mods = self._mods(q.device)
        if self.kv_cache.numel() == 0:
            out = self._no_cache(q, k, v, meta, mods)
        elif not self.causal:
            raise RuntimeError("PagedAttention: a non-causal (encoder) layer attends without a KV cache; "
                               "none may be bound to it")
        else:
            if self.kv_cache_group:
                meta = meta.group(self.kv_cache_group)
            backend = select_attention_backend(q, self.batch_invariant)
            backend.write_kv(k, v, self.kv_cache, meta, self.k_scale, self.v_scale)
            out = backend.attend(q, self.kv_cache, meta, self.scale, self.k_scale, self.v_scale, **mods)
        return out.reshape(-1, self.num_heads * self.head_size)

    def kv_cache_spec(self, layer_name: str, block_size: int, dtype_bytes: int) -> LayerKVCacheSpec:
        """What this layer keeps per token on this rank: K and V of its KV heads, all of them or,
        with a window, the window's (a layer with another cache layout overrides this and
        ``kv_cache_shape``)."""
        kind = SLIDING_WINDOW if self.sliding_window else FULL
        return LayerKVCacheSpec(layer_name, kind, block_size, 2 * self.num_kv_heads * self.head_size * dtype_bytes,
                                sliding_window=self.sliding_window or 0, num_kv_heads=self.num_kv_heads,
                                head_size=self.head_size)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """This layer's KV tensor (only the KV heads this rank holds)."""
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_size)

    def _mods(self, device: torch.device) -> dict:
        """The backends' keywords: ``sliding_window`` / ``soft_cap`` (0 = off) and the slopes on ``device``."""
        slopes = None
        if self.alibi_slopes is not None:
            if self._device_slopes is None or self._device_slopes.device != device:
                self._device_slopes = self.alibi_slopes.to(device)
            slopes = self._device_slopes
        return {"sliding_window": self.sliding_window or 0, "soft_cap": self.logits_soft_cap or 0.0,
                "alibi_slopes": slopes}

    def _no_cache(self, q, k, v, meta: AttentionMetadata, mods: dict) -> torch.Tensor:
        """Each sequence as a fresh prefill (positions from 0), without the cache; causal unless
        the layer is not (then each token sees its whole sequence, or its window either side)."""
        out = torch.empty_like(q)
        bounds = meta.query_start_loc.tolist()
        seq_mods = score_mods(**mods, causal=self.causal)
        for start, end in zip(bounds[:-1], bounds[1:]):
            if not seq_mods.plain:
                self._no_cache_mods(q[start:end], k[start:end], v[start:end], seq_mods, out[start:end])
            elif not self.causal:  # 4-D, so that the CPU takes SDPA's flash kernel (3-D: its math path)
                o = F.scaled_dot_product_attention(
                    q[start:end].transpose(0, 1)[None], k[start:end].transpose(0, 1)[None],
                    v[start:end].transpose(0, 1)[None], scale=self.scale,
                    enable_gqa=self.num_heads != self.num_kv_heads,
                )
                out[start:end] = o[0].transpose(0, 1)
            else:
                o = F.scaled_dot_product_attention(
                    q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1),
                    is_causal=True, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
                )
                out[start:end] = o.transpose(0, 1)
        return out

    def _no_cache_mods(self, q, k, v, mods, out) -> None:
        """One fresh sequence with score modifiers (causal or not, as ``mods`` says), in chunks of
        queries over the keys they see."""
        device = q.device
        for a, b, lo, hi in query_chunks(0, q.shape[0], self.num_heads, mods):
            o = attend_positions(
                q[a:b].transpose(0, 1).unsqueeze(0), k[lo:hi].transpose(0, 1).unsqueeze(0),
                v[lo:hi].transpose(0, 1).unsqueeze(0), torch.arange(a, b, device=device).unsqueeze(0),
                torch.arange(lo, hi, device=device).unsqueeze(0), self.scale, mods,
            )
            out[a:b] = o[0].transpose(0, 1)


def _positive(value, name: str, kind: type):
    """``value`` as ``kind`` when set; None (off) stays None; zero or negative is refused."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"PagedAttention {name} must be a positive number or None, got {value!r}")
    if kind is int and int(value) != value:
        raise ValueError(f"PagedAttention {name} must be an integer, got {value!r}")
    return kind(value)


def _slopes(slopes: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    if slopes is None:
        return None
    if slopes.device.type == "meta":
        raise ValueError("PagedAttention alibi_slopes is a meta tensor (no values): build it on the CPU, "
                         "e.g. with alibi_slopes(num_heads), which always does")
    if slopes.shape != (num_heads,):
        raise ValueError(f"PagedAttention alibi_slopes must have one slope per query head of this rank "
                         f"({num_heads}), got shape {tuple(slopes.shape)}")
    return slopes.detach().to("cpu", torch.float32).clone()

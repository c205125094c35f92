"""Paged attention as a model layer. The metadata that describes one step's batch
(``AttentionMetadata``) and the backends that do the work (``AttentionBackend``: torch reference,
C++ CPU, Triton) are the kernels' (``gridserve.kernels.attention_backend``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gridserve.kernels.attention_backend import AttentionMetadata, select_attention_backend

__all__ = ["AttentionMetadata", "PagedAttention"]


class PagedAttention(nn.Module):
    """Writes the step's K/V into this layer's cache blocks, then attends over each sequence's blocks.

    ``kv_cache`` is bound by the model runner once the cache is allocated; before that (the memory
    profiling run) every sequence is treated as a fresh prefill with no history. The cache may be
    narrower than the activations (``kv_cache_dtype``); an fp8 cache stores ``K / k_scale`` and
    ``V / v_scale`` with per-tensor scales (1.0 unless set, as vLLM does without calibration).
    """

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.kv_cache = torch.empty(0)
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.batch_invariant = False  # every row through one per-token kernel (``batch_invariant.enable``)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_size)
        k = k.view(-1, self.num_kv_heads, self.head_size)
        v = v.view(-1, self.num_kv_heads, self.head_size)
        if self.kv_cache.numel() == 0:
            out = self._no_cache(q, k, v, meta)
        else:
            backend = select_attention_backend(q, self.batch_invariant)
            backend.write_kv(k, v, self.kv_cache, meta, self.k_scale, self.v_scale)
            out = backend.attend(q, self.kv_cache, meta, self.scale, self.k_scale, self.v_scale)
        return out.reshape(-1, self.num_heads * self.head_size)

    def _no_cache(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        bounds = meta.query_start_loc.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1),
                is_causal=True, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[start:end] = o.transpose(0, 1)
        return out

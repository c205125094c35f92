"""Multi-head latent attention (MLA, DeepSeek-V2 / V3) as a model layer over a paged latent cache.

MLA caches one vector per token for all heads: the normalised latent ``c_kv`` (``kv_lora_rank``
wide) and the rotated, head-shared rope key ``k_pe`` (``qk_rope_head_dim``), side by side in a
block ``[block_size, kv_lora_rank + qk_rope_head_dim]``. At attention time each sequence's latents
are gathered through its block table and expanded by ``kv_b_proj`` into this rank's heads' ``k_nope``
and ``v``; a head's key is ``[k_nope, k_pe]`` and its query ``[q_nope, q_pe]`` (``qk_head_dim``).
The cache is the same on every tensor-parallel rank (the latent is not split by heads), so its
bytes per token are not divided by the TP size.

This is the torch reference: a loop over sequences that expands every cached latent each step
(prefill-style). Still to come: a C++ / Triton MLA kernel, and the decode-time weight absorption
(``q_nope @ W_uk`` against the latents directly, ``W_uv`` folded into the output) that avoids
expanding the cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gridserve.kernels.attention_backend import AttentionMetadata
from gridserve.kernels.reference import FP8_DTYPES, to_cache_dtype
from gridserve.shared.kv_cache_spec import MLA, LayerKVCacheSpec

# ``kv_b_proj``: latents [n, kv_lora_rank] -> this rank's heads' [n, heads * (qk_nope + v)]
Expand = Callable[[torch.Tensor], torch.Tensor]


class MLAAttention(nn.Module):
    """Writes the step's latents into this layer's cache blocks, then attends over each sequence's.

    The interface is ``PagedAttention``'s as the model runner sees it: ``kv_cache_spec`` /
    ``kv_cache_shape``, and ``kv_cache`` / ``kv_cache_group`` bound once the cache is allocated;
    before that (the memory profiling run) each sequence attends over its own new tokens only.
    """

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale
        self.kv_cache = torch.empty(0)
        self.kv_cache_group = 0

    @property
    def entry_size(self) -> int:
        """One token's cache entry: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def kv_cache_spec(self, layer_name: str, block_size: int, dtype_bytes: int) -> LayerKVCacheSpec:
        """One latent + rope key per token, the same on every TP rank."""
        return LayerKVCacheSpec(layer_name, MLA, block_size, self.entry_size * dtype_bytes,
                                kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.entry_size)

    def forward(self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, meta: AttentionMetadata,
                expand: Expand) -> torch.Tensor:
        """``q`` [tokens, heads * qk_head_dim] (rope part rotated), ``latent`` [tokens, kv_lora_rank]
        (normalised), ``k_pe`` [tokens, qk_rope_head_dim] (rotated); returns [tokens, heads * v_head_dim]."""
        q = q.view(-1, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        entries = torch.cat((latent, k_pe), dim=-1)
        out = q.new_empty(q.shape[0], self.num_heads, self.v_head_dim)
        bounds = meta.query_start_loc.tolist()
        if self.kv_cache.numel() == 0:
            for start, end in zip(bounds[:-1], bounds[1:]):
                out[start:end] = self._attend(q[start:end], entries[start:end], expand)
            return out.view(q.shape[0], -1)
        if self.kv_cache_group:
            meta = meta.group(self.kv_cache_group)
        flat = self.kv_cache.view(-1, self.entry_size)
        _write(flat, meta.slot_mapping, entries)
        block_size = self.kv_cache.shape[1]
        for i, (start, end, seq_len) in enumerate(zip(bounds[:-1], bounds[1:], meta.seq_lens.tolist())):
            positions = torch.arange(seq_len, device=q.device)
            slots = meta.block_table[i, positions // block_size].long() * block_size + positions % block_size
            out[start:end] = self._attend(q[start:end], flat[slots].to(q.dtype), expand)
        return out.view(q.shape[0], -1)

    def _attend(self, q: torch.Tensor, entries: torch.Tensor, expand: Expand) -> torch.Tensor:
        """One sequence's new queries [n, heads, qk_head_dim] (its last ``n`` positions) over its
        ``entries`` [seq_len, entry_size], causally; [n, heads, v_head_dim]."""
        seq_len, n = entries.shape[0], q.shape[0]
        latent, k_pe = entries.split((self.kv_lora_rank, self.qk_rope_head_dim), dim=-1)
        kv = expand(latent).view(seq_len, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split((self.qk_nope_head_dim, self.v_head_dim), dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)), dim=-1)
        # query i sits at position seq_len - n + i and sees keys 0 .. that position
        visible = torch.arange(seq_len, device=q.device) <= torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=visible, scale=self.scale)
        return o.transpose(0, 1)


def _write(flat: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor) -> None:
    """``flat[slots] = entries`` in the cache's dtype (an fp8 cache: unscaled, copied as bytes)."""
    entries = to_cache_dtype(entries, flat.dtype, 1.0)
    if flat.dtype in FP8_DTYPES:  # index_copy_ has no fp8 kernel
        flat, entries = flat.view(torch.uint8), entries.view(torch.uint8)
    flat.index_copy_(0, slots, entries)

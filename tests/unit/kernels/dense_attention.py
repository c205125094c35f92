"""An independent answer for the attention kernels' score modifiers: every sequence's K/V read
position by position through the block table, every score computed densely in float64 with the
Hugging Face rules written out (causal, ``i - j < window``, ``cap * tanh(s / cap)``,
``+ slope * (j - i)``), and a builder of paged batches whose blocks are scattered over the cache."""

from __future__ import annotations

import torch


def paged_batch(contexts, q_lens, heads, kv_heads, head_size, block_size=16, dtype=torch.float32,
                cache_dtype=None, seed=0):
    """(query, kv_cache, query_start_loc, seq_lens, block_table), blocks in random order."""
    gen = torch.Generator().manual_seed(seed + sum(contexts) * 31 + heads * 7 + head_size + block_size)
    blocks = [(c + block_size - 1) // block_size for c in contexts]
    num_blocks = sum(blocks) + 5  # spare blocks (block 0, the null block, too) hold noise
    scattered = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(contexts), max(blocks) + 2, dtype=torch.int32)
    for seq, n in enumerate(blocks):
        block_table[seq, :n] = torch.tensor(scattered[:n])
        scattered = scattered[n:]
    kv_cache = (torch.randn(2, num_blocks, block_size, kv_heads, head_size, generator=gen) * 1.5).to(
        cache_dtype or dtype)
    query_start_loc = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    query = (torch.randn(sum(q_lens), heads, head_size, generator=gen) * 1.5).to(dtype)
    return query, kv_cache, query_start_loc, torch.tensor(contexts, dtype=torch.int32), block_table


def dense_attention(query, kv_cache, query_start_loc, seq_lens, block_table, scale, *, window=0,
                    soft_cap=0.0, slopes=None) -> torch.Tensor:
    """Float64 attention of each new token over its sequence (the last ``q_len`` positions are new)."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    block_size = kv_cache.shape[2]
    group = query.shape[1] // kv_cache.shape[3]
    for i in range(seq_lens.shape[0]):
        ctx, a, b = int(seq_lens[i]), int(query_start_loc[i]), int(query_start_loc[i + 1])
        pos = torch.arange(ctx)
        blocks = block_table[i][pos // block_size].long()
        k = kv_cache[0, blocks, pos % block_size].double().repeat_interleave(group, 1)  # [ctx, H, d]
        v = kv_cache[1, blocks, pos % block_size].double().repeat_interleave(group, 1)
        q_pos = torch.arange(ctx - (b - a), ctx)
        s = torch.einsum("thd,jhd->thj", query[a:b].double(), k) * scale
        if soft_cap:
            s = soft_cap * torch.tanh(s / soft_cap)
        rel = (pos[None, :] - q_pos[:, None]).double()  # j - i
        if slopes is not None:
            s = s + slopes.double()[None, :, None] * rel[:, None, :]
        visible = rel <= 0
        if window:
            visible &= rel > -window
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        out[a:b] = torch.einsum("thj,jhd->thd", torch.softmax(s, -1), v)
    return out


def upcast(batch):
    """The batch with floating tensors in float32 (what a 16-bit kernel's answer is compared on)."""
    return tuple(t.float() if t.is_floating_point() else t for t in batch)

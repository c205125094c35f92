"""Torch reference implementations of gridserve's kernels: the CPU path and the tests' ground truth.

Paged KV-cache layout (one tensor per layer)::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]   (0 = keys, 1 = values)

Attention metadata for a step holding ``num_seqs`` sequences and ``num_tokens`` packed new tokens:

    query_start_loc: [num_seqs + 1] int32   cumulative query lengths (packed layout)
    seq_lens:        [num_seqs] int32       context length of each sequence *including* new tokens
    block_table:     [num_seqs, max_blocks] int32, padded with block 0 (the null block)
    slot_mapping:    [num_tokens] int64     block_id * block_size + offset of each new token

A sequence's new tokens are its last ``q_len`` positions: causal among themselves, full attention
to the cached prefix.

The cache may be stored in a narrower dtype than the model computes in (``kv_cache_dtype``): 16-bit
values are cast on write and read; fp8 values hold ``key / k_scale`` and ``value / v_scale``
(per-tensor scales, saturated to the format's range) and are multiplied back when read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_DECODE_GROUP = 16  # decode sequences per attention call
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as stored in a cache of ``dtype``: fp8 holds ``x / scale``, saturated to its range."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def from_cache(kv: torch.Tensor, dtype: torch.dtype, k_scale: float, v_scale: float) -> torch.Tensor:
    """Gathered ``[2, ...]`` K/V in the compute ``dtype`` (fp8 values multiplied by their scale)."""
    if kv.dtype not in FP8_DTYPES:
        return kv.to(dtype)
    out = kv.to(torch.float32)
    out[0] *= k_scale
    out[1] *= v_scale
    return out.to(dtype)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Write packed ``key`` / ``value`` ([num_tokens, num_kv_heads, head_size]) into their slots."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    key = to_cache_dtype(key, kv_cache.dtype, k_scale)
    value = to_cache_dtype(value, kv_cache.dtype, v_scale)
    if kv_cache.dtype in FP8_DTYPES:  # index_copy_ has no fp8 kernel: copy the bytes
        flat, key, value = flat.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def _gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int, dtype: torch.dtype,
               k_scale: float, v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = kv_cache[:, block_ids]  # [2, n, block_size, kvh, d]
    flat = from_cache(blocks.reshape(2, -1, *kv_cache.shape[3:])[:, :length], dtype, k_scale, v_scale)
    return flat[0], flat[1]


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of packed queries ([num_tokens, num_heads, head_size]) over their paged KV.

    Decode rows (one query token) are batched into a single masked call; longer rows (prefill and
    chunked prefill) run one sequence at a time.
    """
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    gqa = num_heads != num_kv_heads
    out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [qsl[i + 1] - qsl[i] for i in range(len(lens))]
    # Decode rows in groups of similar context length: one masked call per group, little padding.
    decode = sorted((i for i, n in enumerate(q_lens) if n == 1), key=lambda i: lens[i])
    for first in range(0, len(decode), _DECODE_GROUP):
        group = decode[first : first + _DECODE_GROUP]
        _decode_batch(query, kv_cache, qsl, lens, block_table, group, scale, gqa, out, (k_scale, v_scale))
    longer = [i for i, n in enumerate(q_lens) if n > 1]
    prefill_rows(query, kv_cache, qsl, lens, block_table, longer, scale, out, (k_scale, v_scale))
    return out


def prefill_rows(query, kv_cache, qsl, lens, block_table, rows, scale, out, kv_scales=(1.0, 1.0)) -> None:
    """Attention of the sequences ``rows`` (prefill or chunked prefill), one SDPA call each.

    ``qsl`` and ``lens`` are ``query_start_loc`` / ``seq_lens`` as lists; results go into ``out``.
    """
    gqa = query.shape[1] != kv_cache.shape[3]
    block_size = kv_cache.shape[2]
    for i in rows:
        start, ctx = qsl[i], lens[i]
        q_len = qsl[i + 1] - start
        blocks = block_table[i, : (ctx + block_size - 1) // block_size]
        k, v = _gather_kv(kv_cache, blocks, ctx, query.dtype, *kv_scales)
        # 4-D [1, heads, len, d]: CPU SDPA takes its fused path only for batched inputs
        q = query[start : start + q_len].transpose(0, 1).unsqueeze(0)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        if q_len == ctx:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            positions = torch.arange(ctx - q_len, ctx, device=query.device).unsqueeze(1)
            mask = torch.arange(ctx, device=query.device).unsqueeze(0) <= positions
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start : start + q_len] = o[0].transpose(0, 1)


def _decode_batch(query, kv_cache, qsl, lens, block_table, rows, scale, gqa, out, kv_scales) -> None:
    block_size = kv_cache.shape[2]
    ctx = [lens[i] for i in rows]
    max_ctx = max(ctx)
    n_blocks = (max_ctx + block_size - 1) // block_size
    device = query.device
    idx = torch.tensor(rows, device=device)
    tables = block_table[idx, :n_blocks]  # [b, n_blocks]
    kv = kv_cache[:, tables]  # [2, b, n_blocks, block_size, kvh, d]
    kv = kv.reshape(2, len(rows), n_blocks * block_size, *kv_cache.shape[3:])[:, :, :max_ctx]
    kv = from_cache(kv, query.dtype, *kv_scales)
    k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [b, kvh, L, d]
    positions = torch.tensor([qsl[i] for i in rows], device=device)
    q = query[positions].unsqueeze(2)  # [b, h, 1, d]
    lengths = torch.tensor(ctx, device=device).unsqueeze(1)
    mask = (torch.arange(max_ctx, device=device).unsqueeze(0) < lengths)[:, None, None, :]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    out[positions] = o.squeeze(2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back to the input dtype before the weight (as HF Llama)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; return rms_norm(residual), residual``."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` / ``key`` ([num_tokens, heads, head_size]) by their positions.

    ``cos_sin_cache`` is [max_position, rotary_dim] holding cos in the first half and sin in the
    second; neox style rotates the two halves of the head, GPT-J style rotates interleaved pairs.
    Dimensions past ``rotary_dim`` pass through unchanged.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [t, rot/2]
    return _rotate(query, cos, sin, is_neox), _rotate(key, cos, sin, is_neox)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    rot_dim = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    if is_neox:
        x1, x2 = x_rot.chunk(2, dim=-1)
        cos2, sin2 = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        rotated = x_rot * cos2 + torch.cat((-x2, x1), -1) * sin2
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    return torch.cat((rotated, x_pass), -1) if x_pass.numel() else rotated


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for a merged gate/up projection of width ``2 * d``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up

"""Paged MLA decode in Triton (contract and torch reference: ``gridserve.kernels.mla``).

One program per (query token, block of ``BLOCK_H`` heads): every head reads the same cache entries
(MLA is MQA over ``[c_kv, k_pe]``), so a tile of ``TILE_N`` positions is loaded once for the block
of heads. The scores are two dots, the latent part (``RANK_PAD`` columns) and the rope part
(``ROPE_PAD``), so neither is padded up to the power of two above their sum (512 + 64 stays 512 +
64, not 1,024); an online softmax walks the tiles; the output is the weighted sum of the latents.
The token's sequence is found by binary search over ``query_start_loc`` (no host sync). fp8 caches
hold unscaled values. No split-K yet: a single long sequence runs on ``heads / BLOCK_H`` programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gridserve.kernels.triton_ops._common import compute_in_fp32, pow2

LOG2E = 1.4426950408889634
BLOCK_H = 16  # heads per program: the smallest M of a tensor-core dot
TILE_N = 32


@triton.jit
def _find_seq(query_start_loc_ptr, token, num_seqs):
    """The last sequence whose first token (``query_start_loc[i]``) <= token."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) <= token:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _mla_decode_kernel(
    out_ptr, q_ptr, cache_ptr, query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    scale_log2, num_seqs, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_bt,
    RANK: tl.constexpr, ROPE: tl.constexpr, RANK_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, TILE_N: tl.constexpr, FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    token = tl.program_id(0)
    head_block = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, token, num_seqs)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    span = tl.load(seq_lens_ptr + seq) - q_len + (token - q_start) + 1  # positions [0, span)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    r = tl.arange(0, RANK_PAD)
    e = tl.arange(0, ROPE_PAD)
    r_ok = r < RANK
    e_ok = e < ROPE
    q_row = q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + r[None, :], mask=head_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(q_row + RANK + e[None, :], mask=head_ok[:, None] & e_ok[None, :], other=0.0)
    if FP32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - 1.0e30
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], dtype=tl.float32)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start in range(0, span, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_ok = pos < span
        page = tl.load(table + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
        row = cache_ptr + page * stride_cb + (pos % PAGE) * stride_cs  # [TILE_N] entry starts
        c = tl.load(row[:, None] + r[None, :], mask=pos_ok[:, None] & r_ok[None, :], other=0.0)
        pe = tl.load(row[:, None] + RANK + e[None, :], mask=pos_ok[:, None] & e_ok[None, :], other=0.0)
        if FP32:
            c = c.to(tl.float32)
            pe = pe.to(tl.float32)
        else:
            c = c.to(q_lat.dtype)
            pe = pe.to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
        s = tl.where(pos_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_row = out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + r[None, :]
    tl.store(o_row, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & r_ok[None, :])


def mla_decode(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
               seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
               kv_lora_rank: int) -> torch.Tensor:
    """``gridserve.kernels.mla.reference_mla_decode`` in one Triton kernel."""
    num_tokens, num_heads, entry = query.shape
    if kv_cache.dim() != 3 or kv_cache.shape[2] != entry or not 0 < kv_lora_rank < entry:
        raise ValueError(f"mla_decode: query {tuple(query.shape)}, cache {tuple(kv_cache.shape)} and "
                         f"kv_lora_rank {kv_lora_rank} disagree")
    if kv_cache.stride(-1) != 1:
        raise ValueError("mla_decode: kv_cache must be contiguous in its last dimension")
    query = query if query.stride(-1) == 1 else query.contiguous()
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=query.dtype, device=query.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    rope = entry - kv_lora_rank
    fp32 = compute_in_fp32(query, kv_cache)
    grid = (num_tokens, triton.cdiv(num_heads, BLOCK_H))
    _mla_decode_kernel[grid](
        out, query, kv_cache, query_start_loc, seq_lens, block_table,
        float(scale) * LOG2E, num_seqs, num_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        RANK=kv_lora_rank, ROPE=rope, RANK_PAD=pow2(kv_lora_rank, 16), ROPE_PAD=pow2(rope, 16),
        PAGE=kv_cache.shape[1], BLOCK_H=BLOCK_H, TILE_N=TILE_N, FP32=fp32,
        DOT_PRECISION="ieee" if fp32 else "tf32",
    )
    return out

"""Paged attention: one kernel for decode, prefill and chunked prefill, plus a split-K reduction.

Work is cut into programs ``(q_block, kv_head, split)``. A q-block is up to ``BLOCK_Q`` consecutive
new tokens of one sequence; its ``BLOCK_M = BLOCK_Q * group`` rows are those tokens times the
query heads that share ``kv_head`` (GQA / MQA packing), so each K/V tile is loaded once per group.
Sequence ``i`` owns q-blocks ``query_start_loc[i] // BLOCK_Q + i ...``: the kernel finds its
sequence by binary search, so the host never reads the lengths (no ``.tolist()``, no sync).

The program walks the sequence's KV positions in tiles of ``TILE_N`` through the block table with
an online softmax; positions past a query's own position are masked (causal among the new tokens,
full attention to the cached prefix). With ``NUM_SPLITS > 1`` (decode with few sequences) each
program covers one slice of the context and writes a partial result, which a second kernel merges.

Score modifiers (``gridserve.kernels.reference``'s semantics), each a constexpr switch so a plain
model compiles the kernel it had: a sliding window starts the walk at the tile holding the block's
first visible position (tiles wholly before it are never read) and masks ``q_pos - kv_pos >=
window``; the soft cap (``cap * tanh(s / cap)``) and ALiBi (``+ slope * (kv_pos - q_pos)``) apply to
the scaled scores before the change to base 2. Attention sinks (gpt-oss, ``SINKS``): one logit per
query head joins the softmax's denominator after the walk (with split-K, in the reduction), the
running max raised to it first so nothing overflows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gridserve.kernels.triton_ops._common import compute_in_fp32, fp8_max, num_sms, pow2

LOG2E = 1.4426950408889634
LOG2E_K = tl.constexpr(LOG2E)  # the same, for use inside kernels
NEG_BIG = tl.constexpr(-1.0e30)  # initial running max: finite, so masked rows never see inf - inf
MAX_SPLITS = 16
SPLIT_MIN_TOKENS = 256  # do not split contexts (bounded by the block table) shorter than this


@dataclass(frozen=True)
class AttentionPlan:
    """Launch shape: rows per program, KV positions per tile, and context splits (1 = none).

    The defaults in ``plan_attention`` compile for sm_80 and sm_90 without register spills
    (checked with ``tests/unit/kernels/compile_for_gpu.py``); they are not yet tuned on a GPU.
    """

    block_m: int
    tile_n: int
    num_splits: int = 1
    num_warps: int = 4


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence whose first q-block (``query_start_loc[i] // BLOCK_Q + i``) <= q_block."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    """tanh in float32 to ~1e-7 (Cephes' tanhf): an odd polynomial below |x| = 0.625, where
    (1 - e) / (1 + e) with e = exp(-2|x|) would cancel; that quotient above."""
    ax = tl.abs(x)
    z = x * x
    p = -5.70498872745e-3 * z + 2.06390887954e-2
    p = p * z - 5.37397155531e-2
    p = p * z + 1.33314422036e-1
    p = p * z - 3.33332819422e-1
    small = x + x * z * p
    e = tl.exp(-2.0 * ax)
    large = (1.0 - e) / (1.0 + e)
    return tl.where(ax < 0.625, small, tl.where(x < 0, -large, large))


@triton.jit
def _paged_attention_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr, alibi_ptr, sinks_ptr,
    scale, scale_log2, num_seqs, num_heads, k_scale, v_scale, sliding_window, soft_cap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr, SINKS: tl.constexpr,
):
    """Attention of one q-block's rows (tokens x grouped heads) over one slice of its context.

    ``KV_FP8``: the cache holds fp8 ``K / k_scale`` and ``V / v_scale``; tiles are widened and
    rescaled as they load (to float32, then to the query's dtype unless computing in float32).
    ``WINDOW`` / ``SOFT_CAP`` / ``ALIBI``: whether ``sliding_window`` / ``soft_cap`` / the slopes at
    ``alibi_ptr`` apply (module docstring); ``SINKS``: the per-head logits at ``sinks_ptr`` join
    the denominator (here without split-K, in the reduction with it)."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_q = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_q >= q_len:
        return
    prefix = tl.load(seq_lens_ptr + seq) - q_len  # cached tokens before the new ones

    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = prefix + q_idx
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    row_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_mask, other=0.0,
    )
    if FP32:
        q = q.to(tl.float32)

    # KV positions this program reads: up to the block's last query, or one split's slice of them;
    # with a window, from the tile holding the first query's first visible position.
    kv_end = prefix + tl.minimum(first_q + BLOCK_Q, q_len)
    kv_start = 0
    if WINDOW:
        kv_start = tl.maximum(prefix + first_q - sliding_window + 1, 0) // TILE_N * TILE_N
    kv_lo = kv_start
    kv_hi = kv_end
    if NUM_SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), TILE_N) * TILE_N
        kv_lo = kv_start + split * chunk
        kv_hi = tl.minimum(kv_lo + chunk, kv_end)
    if ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0).to(tl.float32)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + NEG_BIG
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    for start in range(kv_lo, kv_hi, TILE_N):
        kv_pos = start + tl.arange(0, TILE_N)
        kv_ok = kv_pos < kv_hi
        page = tl.load(table + kv_pos // PAGE, mask=kv_ok, other=0).to(tl.int64)
        slot = page * stride_cb + (kv_pos % PAGE) * stride_cs
        k = tl.load(  # [HEAD_PAD, TILE_N]: already transposed for q @ k
            k_base + slot[None, :] + dims[:, None], mask=kv_ok[None, :] & dim_ok[:, None], other=0.0
        )
        v = tl.load(
            v_base + slot[:, None] + dims[None, :], mask=kv_ok[:, None] & dim_ok[None, :], other=0.0
        )
        if KV_FP8:
            k = k.to(tl.float32) * k_scale
            v = v.to(tl.float32) * v_scale
            if not FP32:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
        if FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q.to(k.dtype), k, input_precision=DOT_PRECISION)
        if SOFT_CAP or ALIBI:
            s = s * scale
            if SOFT_CAP:
                s = soft_cap * _tanh(s / soft_cap)
            if ALIBI:
                s += slope[:, None] * (kv_pos[None, :] - q_pos[:, None]).to(tl.float32)
            s = s * LOG2E_K
        else:
            s = s * scale_log2
        visible = row_ok[:, None] & kv_ok[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if WINDOW:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        if SINKS:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E_K
            m_sink = tl.maximum(m_i, sink)
            alpha = tl.math.exp2(m_i - m_sink)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.math.exp2(sink - m_sink)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_offsets = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:  # partials [num_tokens, num_heads, NUM_SPLITS, (HEAD_SIZE)], an empty slice has sum 0
        part = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_SIZE + dims[None, :], acc, mask=row_mask)


@triton.jit
def _reduce_splits_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, sinks_ptr,
    stride_ot, stride_oh, num_heads,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, SINKS: tl.constexpr,
):
    """One program per (token, head): rescale each slice to the global max (the head's sink logit
    included with ``SINKS``) and normalize."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    part = (token * num_heads + head) * NUM_SPLITS + splits
    in_range = splits < NUM_SPLITS
    m = tl.load(part_max_ptr + part, mask=in_range, other=NEG_BIG)
    l_s = tl.load(part_sum_ptr + part, mask=in_range, other=0.0)
    used = l_s > 0
    top = tl.max(m, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E_K
        top = tl.maximum(top, sink)
    weight = tl.where(used, tl.math.exp2(m - top), 0.0)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_SIZE + dims[None, :],
        mask=used[:, None] & dim_ok[None, :], other=0.0,
    )
    denominator = tl.sum(l_s * weight, 0)
    if SINKS:
        denominator += tl.math.exp2(sink - top)
    out = tl.sum(acc * weight[:, None], 0) / denominator
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty), mask=dim_ok,
    )


def plan_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_seqs: int,
    max_query_len: int | None,
    sliding_window: int = 0,
) -> AttentionPlan:
    """Pick tile sizes and the split count from shapes alone (nothing is read back from the GPU).

    A step is treated as decode when ``max_query_len == 1`` or, without it, when there is one
    token per sequence; the plan only affects speed, never the result. A sliding window bounds
    the positions a decode row reads, hence its splits.
    """
    num_tokens, num_heads, head_size = query.shape
    group = num_heads // kv_cache.shape[3]
    decode = max_query_len == 1 if max_query_len is not None else num_tokens == num_seqs
    fp32 = torch.float32 in (query.dtype, kv_cache.dtype)  # FMA dot products: smaller tiles
    if not decode and fp32:
        return AttentionPlan(block_m=max(32, pow2(group)), tile_n=16)
    if not decode:
        return AttentionPlan(
            block_m=max(64, pow2(group)), tile_n=64 if head_size <= 64 else 32, num_warps=8
        )
    programs = max(num_seqs * kv_cache.shape[3], 1)
    longest = block_table.shape[1] * kv_cache.shape[2]  # upper bound on any context length
    if sliding_window > 0:
        longest = min(longest, sliding_window + 64)  # + the tile the window starts in
    splits = min(
        math.ceil(2 * num_sms(query.device) / programs),
        MAX_SPLITS,
        math.ceil(longest / SPLIT_MIN_TOKENS),
    )
    # Decode tiles of 64 KV positions, 4 warps: measured best on an H200 at batch 256 (fp16 3.8 TB/s,
    # 89% of a device copy, vs 2.8 with 32; fp32 1.2 TB/s vs 0.76 with 16; 2 warps spill in fp32).
    return AttentionPlan(block_m=pow2(group, minimum=16), tile_n=64, num_splits=max(splits, 1))


def run_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    plan: AttentionPlan,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the attention kernel (and the split reduction) with an explicit plan."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) is not a multiple of num_kv_heads ({num_kv_heads})")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last (head_size) dimension")
    query = query if query.stride(-1) == 1 else query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_q = plan.block_m // group
    if block_q < 1:
        raise ValueError(f"block_m={plan.block_m} is smaller than the GQA group ({group})")
    splits = plan.num_splits
    if splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, splits, head_size, dtype=torch.float32,
                               device=query.device)
        part_max = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    fp32 = compute_in_fp32(query, kv_cache)
    if alibi_slopes is not None:
        if alibi_slopes.shape != (num_heads,):
            raise ValueError(f"alibi_slopes must hold num_heads ({num_heads}) slopes, got {tuple(alibi_slopes.shape)}")
        alibi_slopes = alibi_slopes.to(device=query.device, dtype=torch.float32).contiguous()
    if sinks is not None:
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must hold num_heads ({num_heads}) logits, got {tuple(sinks.shape)}")
        sinks = sinks.detach().to(device=query.device, dtype=torch.float32).contiguous()
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, splits)
    _paged_attention_kernel[grid](
        out, part_acc, part_max, part_sum,
        query, k_cache, v_cache,
        query_start_loc, seq_lens, block_table, alibi_slopes if alibi_slopes is not None else out,
        sinks if sinks is not None else out,
        float(scale), scale * LOG2E, num_seqs, num_heads, float(k_scale), float(v_scale),
        int(sliding_window), float(soft_cap) if soft_cap > 0 else 1.0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        GROUP=group, PAGE=kv_cache.shape[2], HEAD_SIZE=head_size, HEAD_PAD=pow2(head_size),
        BLOCK_M=plan.block_m, BLOCK_Q=block_q, TILE_N=plan.tile_n,
        NUM_SPLITS=splits, FP32=fp32, DOT_PRECISION="ieee" if fp32 else "tf32",
        KV_FP8=fp8_max(kv_cache.dtype) > 0,
        WINDOW=sliding_window > 0, SOFT_CAP=soft_cap > 0, ALIBI=alibi_slopes is not None,
        SINKS=sinks is not None, num_warps=plan.num_warps,
    )
    if splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, sinks if sinks is not None else out,
            out.stride(0), out.stride(1), num_heads,
            NUM_SPLITS=splits, SPLITS_PAD=pow2(splits),
            HEAD_SIZE=head_size, HEAD_PAD=pow2(head_size), SINKS=sinks is not None,
        )
    return out


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
    *,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed queries ([num_tokens, num_heads, head_size]) over their paged KV.

    Same contract as the reference; decode, prefill and chunked prefill rows may be mixed; the
    cache may be narrower than the query (16-bit or fp8 with per-tensor scales); the score
    modifiers are the reference's; ``sinks`` ([num_heads] logits or None): attention sinks, as
    ``services/worker/sink_attention.py`` defines them.
    """
    plan = plan_attention(query, kv_cache, block_table, seq_lens.shape[0], max_query_len, sliding_window)
    return run_paged_attention(query, kv_cache, query_start_loc, seq_lens, block_table, scale, plan,
                               k_scale, v_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                               alibi_slopes=alibi_slopes, sinks=sinks)

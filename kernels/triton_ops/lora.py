"""Batched multi-LoRA on the GPU: ``y[t] += B_s @ (A_s @ x[t])`` for each token's adapter slot ``s``.

The punica / S-LoRA "shrink then expand" scheme over a segmented (SGMV) layout:

1. **Group** (torch, on the device, no host sync): a stable ``argsort`` of ``token_slots`` lays the
   tokens out slot by slot, ``-1`` (no adapter) first; ``searchsorted`` finds each slot's segment
   ``[seg_start, seg_end)`` of sorted positions. Segment ``s`` owns row tiles from
   ``(seg_start[s] - seg_start[0]) // BLOCK_M + s`` (the paged-attention q-block trick), so
   ``T // BLOCK_M + S`` programs always suffice and each program's tile holds rows of *one* slot:
   it loads that slot's A or B tile once for all its rows, and the ``tl.dot`` is a real GEMM
   (decode batches sharing an adapter fill the tile). Which program owns which slot and rows is a
   small table built with torch ops, so the launch depends only on shapes (CUDA-graph friendly).
   The alternative, one slot load per row, would reread a slot's A / B per token and turn the GEMMs
   into matrix-vector products.
2. **Shrink** ``_lora_shrink_kernel``, programs ``(tile, split, rank block)``: ``x[rows] @ A_s^T``
   over a slice of the input dimension, float32 accumulation, into a float32 buffer
   ``[split, T, R]`` indexed by sorted position. Split-K gives decode-sized batches (few tiles,
   long ``in``) enough programs; the partials are then summed by one torch ``sum`` (deterministic,
   no atomics; ``split * T * R`` floats, small next to A).
3. **Expand** ``_lora_expand_kernel``, programs ``(tile, out block)``: multiplies the buffer's
   rows by ``B_s^T`` and adds the result to ``y[token]`` in float32, one read-modify-write of
   each ``y`` element, stored in ``y``'s dtype. Rows of ``-1`` tokens are never read or written.

Precision: float32 accumulation everywhere. With 16-bit operands on a GPU the shrink dot takes
``x`` and ``A`` as they are (A cast to x's dtype if they differ) and the expand dot takes the
float32 intermediate rounded to B's dtype, as punica does and as a torch ``(x @ A.T) @ B.T`` in
that dtype does; any float32 operand (and every CPU / interpreter run, whose 16-bit arithmetic is
wrong) computes in float32 with IEEE dot products.

Slots ``>= S`` fall in no segment and are skipped (not checked: that would need a host sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gridserve.kernels.triton_ops._common import compute_in_fp32, num_sms, pow2

MAX_SPLIT_K = 16


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, buf_ptr, order_ptr, prog_slot_ptr, prog_start_ptr, prog_end_ptr,
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_bsplit, stride_bt,
    in_features, rank, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``buf[split, pos, r] = sum_k x[order[pos], k] * A[slot, r, k]`` over this split's ``k``.

    ``pos`` runs over this program's rows ``[start, end)`` of one slot's segment (sorted order)."""
    prog = tl.program_id(0)
    split = tl.program_id(1)
    r_block = tl.program_id(2)
    start = tl.load(prog_start_ptr + prog)
    end = tl.load(prog_end_ptr + prog)
    if start >= end:  # a spare tile (segments shorter than their share of the grid)
        return
    slot = tl.load(prog_slot_ptr + prog).to(tl.int64)
    pos = start + tl.arange(0, BLOCK_M)
    row_ok = pos < end
    token = tl.load(order_ptr + pos, mask=row_ok, other=0).to(tl.int64)
    ranks = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_ok = ranks < rank
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_features)
    x_rows = x_ptr + token[:, None] * stride_xt
    a_cols = a_ptr + slot * stride_as + ranks[None, :] * stride_ar  # A_s^T tile: [BLOCK_K, BLOCK_R]
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        x = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_cols + ks[:, None] * stride_ak, mask=k_ok[:, None] & rank_ok[None, :], other=0.0)
        if FP32:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        else:
            a = a.to(x.dtype)
        acc += tl.dot(x, a, input_precision=DOT_PRECISION)
    out = buf_ptr + split * stride_bsplit + pos[:, None].to(tl.int64) * stride_bt + ranks[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & rank_ok[None, :])


@triton.jit
def _lora_expand_kernel(
    y_ptr, b_ptr, buf_ptr, order_ptr, prog_slot_ptr, prog_start_ptr, prog_end_ptr,
    stride_yt, stride_yn, stride_bs, stride_bn, stride_br, stride_bt,
    out_features, rank,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``y[order[pos], n] += sum_r buf[pos, r] * B[slot, n, r]`` for this program's rows and columns."""
    prog = tl.program_id(0)
    n_block = tl.program_id(1)
    start = tl.load(prog_start_ptr + prog)
    end = tl.load(prog_end_ptr + prog)
    if start >= end:
        return
    slot = tl.load(prog_slot_ptr + prog).to(tl.int64)
    pos = start + tl.arange(0, BLOCK_M)
    row_ok = pos < end
    token = tl.load(order_ptr + pos, mask=row_ok, other=0).to(tl.int64)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < out_features
    b_cols = b_ptr + slot * stride_bs + cols[None, :] * stride_bn  # B_s^T tile: [BLOCK_R, BLOCK_N]
    buf_rows = buf_ptr + pos[:, None].to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        rank_ok = ranks < rank
        h = tl.load(buf_rows + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
        b = tl.load(b_cols + ranks[:, None] * stride_br, mask=rank_ok[:, None] & col_ok[None, :], other=0.0)
        if FP32:
            b = b.to(tl.float32)
        else:
            h = h.to(b.dtype)  # the intermediate in B's dtype, as punica and torch do
        acc += tl.dot(h, b, input_precision=DOT_PRECISION)
    y_offsets = token[:, None] * stride_yt + cols[None, :] * stride_yn
    mask = row_ok[:, None] & col_ok[None, :]
    y = tl.load(y_ptr + y_offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + y_offsets, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class LoraSegments:
    """Tokens grouped by slot, cut into row tiles of ``block_m``: one row of each table per program.

    ``order[pos]`` is the token at sorted position ``pos``; program ``p`` handles positions
    ``[prog_start[p], prog_end[p])`` (empty for a spare program), all of slot ``prog_slot[p]``.
    Depends only on ``token_slots`` and the slot count, so a step can build it once and pass it to
    every layer's call."""

    order: torch.Tensor
    prog_slot: torch.Tensor
    prog_start: torch.Tensor
    prog_end: torch.Tensor
    num_tokens: int
    num_slots: int
    block_m: int


def default_block_m(num_tokens: int) -> int:
    """Rows per tile: 16 (the smallest ``tl.dot`` tile) for decode-sized batches, 64 for prefill."""
    return 16 if num_tokens <= 256 else 64


def lora_segments(token_slots: torch.Tensor, num_slots: int, block_m: int | None = None) -> LoraSegments:
    """Sort ``token_slots`` ([T], int, ``-1`` = no adapter) into per-slot tiles, on its device, no sync."""
    num_tokens = token_slots.shape[0]
    block_m = block_m or default_block_m(num_tokens)
    device = token_slots.device
    slots = token_slots.to(torch.int64)
    sorted_slots, order = torch.sort(slots, stable=True)
    slot_ids = torch.arange(num_slots, device=device, dtype=torch.int64)
    seg_start = torch.searchsorted(sorted_slots, slot_ids)
    seg_end = torch.searchsorted(sorted_slots, slot_ids, right=True)
    # Segment s owns tiles [tile_base[s], tile_base[s] + cdiv(len_s, block_m)), counted from the
    # first slotted token: bases strictly increase from 0, and the last segment's tiles end by
    # num_tokens // block_m + num_slots.
    tile_base = (seg_start - seg_start[:1]) // block_m + slot_ids
    num_programs = num_tokens // block_m + num_slots
    progs = torch.arange(num_programs, device=device, dtype=torch.int64)
    seg = torch.searchsorted(tile_base, progs, right=True) - 1  # >= 0: tile_base[0] == 0
    start = seg_start[seg] + (progs - tile_base[seg]) * block_m
    end = torch.minimum(start + block_m, seg_end[seg])
    return LoraSegments(
        order=order.to(torch.int32) if num_tokens < 2**31 else order,
        prog_slot=seg.to(torch.int32),
        prog_start=start.to(torch.int32),
        prog_end=end.to(torch.int32),
        num_tokens=num_tokens, num_slots=num_slots, block_m=block_m,
    )


@dataclass(frozen=True)
class LoraPlan:
    """Tile sizes and the split-K factor of one call (picked from shapes only)."""

    block_k: int
    block_n: int
    block_r: int
    split_k: int
    num_warps: int = 4


def plan_lora(segments: LoraSegments, in_features: int, rank: int, device: torch.device) -> LoraPlan:
    """Split K until the shrink has about two programs per SM (and every split has work)."""
    block_k = 64
    block_r = min(pow2(rank, 16), 64)
    shrink_programs = (segments.num_tokens // segments.block_m + segments.num_slots) * triton.cdiv(rank, block_r)
    want = triton.cdiv(2 * num_sms(device), max(shrink_programs, 1))
    split_k = max(1, min(want, triton.cdiv(in_features, block_k), MAX_SPLIT_K))
    # 8 warps for 64-row tiles and for ranks over one rank block (the expand's pipelined rank
    # loop spills at 4): no spills for sm_90 in any of these plans.
    num_warps = 8 if segments.block_m >= 64 or rank > block_r else 4
    return LoraPlan(block_k=block_k, block_n=64, block_r=block_r, split_k=split_k, num_warps=num_warps)


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    segments: LoraSegments | None = None,
    plan: LoraPlan | None = None,
) -> None:
    """``y[t] += lora_b[s] @ (lora_a[s] @ x[t])`` in place for every token with ``s = token_slots[t] >= 0``.

    ``x`` [T, in], ``y`` [T, out] (any strides, e.g. a column slice of a fused projection),
    ``lora_a`` [S, R, in], ``lora_b`` [S, out, R] (scaling folded in), ``token_slots`` [T] int.
    Rows with slot ``-1`` are left untouched. ``segments`` (from :func:`lora_segments` on the same
    ``token_slots``) lets a step group its tokens once for all layers; ``plan`` overrides tile sizes.
    """
    num_tokens, in_features = x.shape
    num_slots, rank, a_in = lora_a.shape
    out_features = y.shape[1]
    if y.shape[0] != num_tokens or token_slots.shape != (num_tokens,):
        raise ValueError(f"y {tuple(y.shape)} / token_slots {tuple(token_slots.shape)} do not match x {tuple(x.shape)}")
    if a_in != in_features or lora_b.shape != (num_slots, out_features, rank):
        raise ValueError(
            f"lora_a {tuple(lora_a.shape)} / lora_b {tuple(lora_b.shape)} do not match "
            f"x {tuple(x.shape)} -> y {tuple(y.shape)}"
        )
    if min(num_tokens, num_slots, rank, in_features, out_features) == 0:
        return
    if segments is None:
        segments = lora_segments(token_slots, num_slots)
    elif (segments.num_tokens, segments.num_slots) != (num_tokens, num_slots):
        raise ValueError("segments were built for another batch or slot count")
    plan = plan or plan_lora(segments, in_features, rank, x.device)
    block_m = segments.block_m
    fp32 = compute_in_fp32(x, lora_a, lora_b)
    precision = "ieee" if fp32 else "tf32"  # only float32 operands read it: 16-bit dots are exact
    parts = torch.empty(plan.split_k, num_tokens, rank, dtype=torch.float32, device=x.device)
    num_programs = segments.prog_slot.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(in_features, plan.split_k), plan.block_k) * plan.block_k
    tables = (segments.order, segments.prog_slot, segments.prog_start, segments.prog_end)
    _lora_shrink_kernel[(num_programs, plan.split_k, triton.cdiv(rank, plan.block_r))](
        x, lora_a, parts, *tables,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        parts.stride(0), parts.stride(1),
        in_features, rank, k_per_split,
        BLOCK_M=block_m, BLOCK_K=plan.block_k, BLOCK_R=plan.block_r,
        FP32=fp32, DOT_PRECISION=precision, num_warps=plan.num_warps,
    )
    # Splits summed once here (torch's sum is deterministic), not by every expand program, which
    # would reread split_k partials per block of output columns. Rows of -1 tokens hold garbage.
    buf = parts[0] if plan.split_k == 1 else parts.sum(0)
    _lora_expand_kernel[(num_programs, triton.cdiv(out_features, plan.block_n))](
        y, lora_b, buf, *tables,
        y.stride(0), y.stride(1), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), buf.stride(0),
        out_features, rank,
        BLOCK_M=block_m, BLOCK_N=plan.block_n, BLOCK_R=plan.block_r,
        FP32=fp32, DOT_PRECISION=precision, num_warps=plan.num_warps,
    )

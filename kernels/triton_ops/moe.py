"""The fused-MoE layer's grouped GEMM on the GPU: rows sorted by expert times their expert's weight.

``moe_grouped_gemm(a, weight, counts, bias)``: ``a`` [rows, K] holds the MoE layer's (token,
expert) assignments gathered in expert order, expert ``e``'s ``counts[e]`` rows after expert
``e - 1``'s; row ``r`` of the result [rows, N] is ``a[r] @ weight[e].T (+ bias[e])`` for the expert
``e`` it belongs to. ``weight`` is the layer's stacked ``[E, N, K]`` (``gate_up_proj`` [E, 2I, H],
then ``down_proj`` [E, H, I]), ``bias`` an optional ``[E, N]``.

1. **Tiles** (torch, on the device, no host sync): expert ``e``'s rows ``[start_e, end_e)``
   (``cumsum`` of ``counts``) are cut into row tiles of ``BLOCK_M``; expert ``e`` owns tiles from
   ``start_e // BLOCK_M + e`` (the LoRA kernel's segment trick, instead of vLLM's
   ``moe_align_block_size`` padding of every expert to the tile size), so ``rows // BLOCK_M + E``
   programs always suffice and each program's rows belong to one expert. A program's expert and
   rows are one row of a small table (``moe_tiles``), so the launch depends only on shapes
   (CUDA-graph friendly); an expert without rows, or a spare tile, is a program that returns at
   once.
2. **GEMM** ``_moe_grouped_gemm_kernel``, programs ``(tile, output-column block)``: the tile's rows
   of ``a`` times the tile's expert's ``weight^T`` columns, float32 accumulation over ``K`` in
   blocks of ``BLOCK_K``, plus the bias in float32, stored once in ``a``'s dtype. Each program reads
   its expert's ``[BLOCK_N, K]`` slab once for all its rows: decode (one row per expert) is bound by
   reading the active experts' weights, as the layer is on any device.

Precision: with 16-bit operands on a GPU the dot takes ``a`` and ``weight`` as they are (the weight
cast to ``a``'s dtype if they differ), like torch's ``mm`` in that dtype; any float32 operand (and
every CPU / interpreter run, whose 16-bit arithmetic is wrong) computes in float32 with IEEE dots.

Counts are not checked against ``rows`` (that would need a host sync): rows past
``sum(counts)`` are left unwritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from gridserve.kernels.triton_ops._common import compute_in_fp32


@triton.jit
def _moe_grouped_gemm_kernel(
    a_ptr, w_ptr, bias_ptr, out_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_om, stride_on,
    n_features, k_features,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``out[r, n] = sum_k a[r, k] * w[e, n, k] (+ bias[e, n])`` for this tile's rows ``r`` of expert ``e``."""
    tile = tl.program_id(0)
    n_block = tl.program_id(1)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    if start >= end:  # a spare tile, or the tile of an expert without rows
        return
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < end
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_features
    a_rows = a_ptr + rows[:, None] * stride_am
    w_cols = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn  # W_e^T: [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_features
        a = tl.load(a_rows + ks[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        else:
            w = w.to(a.dtype)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_be + cols * stride_bn, mask=col_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class MoeTiles:
    """Rows grouped by expert, cut into row tiles of ``block_m``: one entry of each table per program.

    Program ``p`` handles rows ``[tile_start[p], tile_end[p])`` (empty for a spare program), all of
    expert ``tile_expert[p]``. Depends only on ``counts``, so one table serves both projections."""

    tile_expert: torch.Tensor
    tile_start: torch.Tensor
    tile_end: torch.Tensor
    num_rows: int
    num_experts: int
    block_m: int


def default_block_m(num_rows: int, num_experts: int) -> int:
    """Rows per tile: 16 (the smallest ``tl.dot`` tile) while the average expert has fewer than 32
    rows (decode: most tiles would be mostly padding), 64 for prefill-sized groups."""
    return 16 if num_rows < 32 * num_experts else 64


def moe_tiles(counts: torch.Tensor, num_rows: int, block_m: Optional[int] = None) -> MoeTiles:
    """The tile table of ``num_rows`` rows sorted by expert, ``counts`` [E] rows each (on the device)."""
    num_experts = counts.shape[0]
    block_m = block_m or default_block_m(num_rows, num_experts)
    device = counts.device
    seg_end = torch.cumsum(counts.to(torch.int64), 0)
    seg_start = seg_end - counts.to(torch.int64)
    experts = torch.arange(num_experts, device=device, dtype=torch.int64)
    # Expert e owns tiles [base[e], base[e] + cdiv(count_e, block_m)): bases strictly increase from
    # 0, and floor((s + c) / m) - floor(s / m) + 1 >= cdiv(c, m) leaves room for every tile; the
    # last expert's tiles end by num_rows // block_m + E.
    tile_base = seg_start // block_m + experts
    programs = torch.arange(num_rows // block_m + num_experts, device=device, dtype=torch.int64)
    expert = torch.searchsorted(tile_base, programs, right=True) - 1  # >= 0: tile_base[0] == 0
    start = seg_start[expert] + (programs - tile_base[expert]) * block_m
    end = torch.minimum(start + block_m, seg_end[expert])
    index = torch.int32 if num_rows < 2**31 else torch.int64
    return MoeTiles(tile_expert=expert.to(torch.int32), tile_start=start.to(index), tile_end=end.to(index),
                    num_rows=num_rows, num_experts=num_experts, block_m=block_m)


@dataclass(frozen=True)
class MoePlan:
    """Tile sizes of one call (picked from shapes and dtypes only)."""

    block_n: int
    block_k: int
    num_warps: int


def plan_moe(tiles: MoeTiles, fp32: bool) -> MoePlan:
    """64 output columns by 64 of K (32 in float32, whose tiles take twice the registers); 8 warps
    for 64-row tiles."""
    return MoePlan(block_n=64, block_k=32 if fp32 else 64, num_warps=8 if tiles.block_m >= 64 else 4)


def moe_grouped_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    counts: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    tiles: Optional[MoeTiles] = None,
    plan: Optional[MoePlan] = None,
) -> torch.Tensor:
    """``a`` [rows, K] grouped by expert (``counts`` [E] int rows each, in expert order) times each
    row's expert's ``weight[e].T`` ([E, N, K]) plus ``bias[e]`` ([E, N]): a new [rows, N] tensor in
    ``a``'s dtype. ``tiles`` (``moe_tiles(counts, rows)``) lets both projections share one table;
    ``plan`` overrides the tile sizes."""
    num_rows, k_features = a.shape
    num_experts, n_features, w_k = weight.shape
    if w_k != k_features:
        raise ValueError(f"weight {tuple(weight.shape)} does not take rows of {k_features} (a {tuple(a.shape)})")
    if counts.shape != (num_experts,):
        raise ValueError(f"counts {tuple(counts.shape)} must hold one count per expert ({num_experts})")
    if bias is not None and bias.shape != (num_experts, n_features):
        raise ValueError(f"bias {tuple(bias.shape)} must be [{num_experts}, {n_features}]")
    out = a.new_empty(num_rows, n_features)
    if min(num_rows, num_experts, n_features) == 0:
        return out
    if tiles is None:
        tiles = moe_tiles(counts, num_rows)
    elif (tiles.num_rows, tiles.num_experts) != (num_rows, num_experts):
        raise ValueError("tiles were built for another row or expert count")
    fp32 = compute_in_fp32(a, weight)
    plan = plan or plan_moe(tiles, fp32)
    bias_arg = bias if bias is not None else out  # never read without HAS_BIAS
    bias_strides = (bias.stride(0), bias.stride(1)) if bias is not None else (0, 0)
    grid = (tiles.tile_expert.shape[0], triton.cdiv(n_features, plan.block_n))
    _moe_grouped_gemm_kernel[grid](
        a, weight, bias_arg, out, tiles.tile_expert, tiles.tile_start, tiles.tile_end,
        a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), weight.stride(2), *bias_strides,
        out.stride(0), out.stride(1),
        n_features, k_features,
        HAS_BIAS=bias is not None, BLOCK_M=tiles.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        FP32=fp32, DOT_PRECISION="ieee" if fp32 else "tf32", num_warps=plan.num_warps,
    )
    return out

"""RMSNorm, alone or fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gridserve.kernels.triton_ops._common import pow2, rows_of


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    n_cols, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """One program per row, as the reference: float32 statistics, cast back before the weight.

    With a residual, ``x + residual`` is rounded to the residual's dtype, stored, then normalized.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + res).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, summed, mask=mask)
        x = summed.to(tl.float32)
        in_dtype = residual_out_ptr.dtype.element_ty
    else:
        in_dtype = x_ptr.dtype.element_ty
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * inv_rms).to(in_dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, weight, eps, out, residual=None, residual_out=None) -> None:
    """Run the kernel over 2-D row views; without a residual, ``x`` / ``out`` stand in for it."""
    has_residual = residual is not None
    residual = residual if has_residual else x
    residual_out = residual_out if has_residual else out
    block = pow2(x.shape[1])
    _rms_norm_kernel[(x.shape[0],)](
        x, residual, weight, out, residual_out,
        x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
        x.shape[1], eps,
        BLOCK=block, HAS_RESIDUAL=has_residual, num_warps=min(max(block // 256, 1), 16),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back to the input dtype before the weight (as HF Llama)."""
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rows = rows_of(x)
    if rows.shape[0]:
        _launch(rows, weight.contiguous(), eps, out.view(-1, x.shape[-1]))
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; return rms_norm(residual), residual`` in one pass over the row."""
    res_dtype = torch.promote_types(x.dtype, residual.dtype)
    residual_out = torch.empty(x.shape, dtype=res_dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(res_dtype, weight.dtype), device=x.device)
    rows = rows_of(x)
    if rows.shape[0]:
        hidden = x.shape[-1]
        _launch(
            rows, weight.contiguous(), eps, out.view(-1, hidden),
            residual=rows_of(residual), residual_out=residual_out.view(-1, hidden),
        )
    return out, residual_out
